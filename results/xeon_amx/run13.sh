#!/usr/bin/env bash
# Intel Xeon with AMX (as run1.sh), 2026-12-06, stop 64: the 8-bit products' minimum term read from one array
# made once a product (b486f40) against the C before it (236eac3, built from its own sources), whole runs
# alternated: a cached pass by rows and a batch's pass; then the issue's temperature-1 Spec-Bench on the current code:
#   nohup bash results/xeon_amx/run13.sh > results/xeon_amx/run13.log 2>&1 &
set -u
cd "$(dirname "$0")/../.."
out=results/xeon_amx
source results/zen3/step.sh
before=$(before_own_build 236eac3)
for round in 1 2; do
    for side in before after; do
        root=$PWD; [ $side = before ] && root=$before
        step pass_cost_stop64_${side}_${round} env PYTHONPATH=$root python benchmarks/pass_cost.py --configs auto:auto \
            --rounds 9 --context 256 --out $out/pass_cost_stop64_${side}_${round}.md
        step batched_pass_cost_stop64_${side}_${round} env PYTHONPATH=$root python benchmarks/batched_pass_cost.py \
            --contexts 300,1000 --rows 1,2 --repeats 20 --out $out/batched_pass_cost_stop64_${side}_${round}.json
    done
done
step spec_bench_t1_stop64 tierspec bench --dataset spec_bench --per-category 5 --max-new-tokens 128 --temperature 1 \
    --seed 0 --methods ar,hybrid,llamacpp-greedy --out $out/spec_bench-t1-stop64 --no-progress
echo "all done $(date -u +%FT%TZ)"
