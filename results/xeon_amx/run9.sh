#!/usr/bin/env bash
# Intel Xeon with AMX (as run1.sh), 2026-12-06, stop 63: a pass's chain rows attend in blocks from one row, and a
# sequence's few rows in two blocks for two threads (06d1f50). Before/after against the stop's start (a4ed32e, whose
# C differs: built from its own sources; this checkout's benchmark scripts, whose pass_cost.py now settles the
# few-row threads as a generation does), whole runs alternated, then Spec-Bench on the current code with its peers:
#   nohup bash results/xeon_amx/run9.sh > results/xeon_amx/run9.log 2>&1 &
set -u
cd "$(dirname "$0")/../.."
out=results/xeon_amx
source results/zen3/step.sh
before=$(before_own_build a4ed32e)
for round in 1 2; do
    for side in before after; do
        root=$PWD; [ $side = before ] && root=$before
        step pass_cost_${side}_${round} env PYTHONPATH=$root python benchmarks/pass_cost.py --configs auto:auto \
            --rounds 9 --context 256 --out $out/pass_cost_${side}_${round}.md
        step pass_cost_2048_${side}_${round} env PYTHONPATH=$root python benchmarks/pass_cost.py --configs auto:auto \
            --rounds 9 --context 2048 --out $out/pass_cost_2048_${side}_${round}.md
        step batched_pass_cost_${side}_${round} env PYTHONPATH=$root python benchmarks/batched_pass_cost.py \
            --contexts 300,1000 --rows 1,2 --repeats 20 --out $out/batched_pass_cost_${side}_${round}.json
    done
done
step spec_bench_peers_t0_stop63 tierspec bench --dataset spec_bench --per-category 5 --max-new-tokens 128 --temperature 0 \
    --seed 0 --methods ar,hybrid,llamacpp-greedy,llamacpp-lookup,ov-greedy,ov-lookup --out $out/spec_bench-peers-t0-stop63 --no-progress
echo "all done $(date -u +%FT%TZ)"
