#!/usr/bin/env bash
# Intel Xeon with AMX (as run1.sh), 2026-12-06, stop 63, the final attention (b10af17: run 9's blocks, and a one-row
# pass's groups of query heads halved for two threads, split only where the threads are unbalanced) against the
# stop's start (a4ed32e, built from its own sources), whole runs alternated; then the pass by rows beside llama.cpp
# and a prefill beside llama.cpp and OpenVINO on the current code (run first at 4ca51c6, then again here):
#   nohup bash results/xeon_amx/run10.sh > results/xeon_amx/run10.log 2>&1 &
set -u
cd "$(dirname "$0")/../.."
out=results/xeon_amx
source results/zen3/step.sh
before=$(before_own_build a4ed32e)
for round in 1 2; do
    for side in before after; do
        root=$PWD; [ $side = before ] && root=$before
        for context in 256 1024 2048; do
            step pass_cost_final_${context}_${side}_${round} env PYTHONPATH=$root python benchmarks/pass_cost.py \
                --configs auto:auto --rounds 9 --context $context --out $out/pass_cost_final_${context}_${side}_${round}.md
        done
        step batched_pass_cost_final_${side}_${round} env PYTHONPATH=$root python benchmarks/batched_pass_cost.py \
            --contexts 300,1000 --rows 1,2 --repeats 20 --out $out/batched_pass_cost_final_${side}_${round}.json
    done
done
step pass_cost_peers python benchmarks/pass_cost.py --configs auto:auto --llamacpp --rounds 7 --out $out/pass_cost_peers.md
step prefill_stop63 python benchmarks/prefill.py --configs auto --rounds 3 --openvino --out $out/prefill_stop63.md
echo "all done $(date -u +%FT%TZ)"
