#!/usr/bin/env bash
# Zen 4 (AMD EPYC family 25 model 17: AVX-512 with VNNI and BF16, no AMX; 2 cores), 2026-12-06, stop 67: the current
# code's numbers on this CPU in one campaign — the issue's commands and BENCHMARKS.md's at-a-glance rows, as the
# Xeon's run 14 (results/xeon_amx/run14.sh). Resumable; every step under the exclusive lock.
#   nohup bash results/zen4/run20.sh > results/zen4/run20.log 2>&1 &
set -u
cd "$(dirname "$0")/../.."
out=results/zen4/int8
source results/zen3/step.sh
step batch_cycle_stop67 python benchmarks/batch_cycle.py --sizes 1,8 --methods hybrid,ar --temperature 0 \
    --out $out/batch_cycle_stop67.json
step loop_time_stop67 python benchmarks/loop_time.py --methods ar,hybrid --temperatures 0,1 --prompts 4 --tokens 128 \
    --repeats 3 --out $out/loop_time_stop67.json
step serve_load_stop67 python benchmarks/serve_load.py --concurrency 1,2,4,8,16 --peers --out $out/serve_load_stop67.json
step spec_bench_peers_t0_stop67 tierspec bench --dataset spec_bench --per-category 5 --max-new-tokens 128 --temperature 0 \
    --seed 0 --methods ar,hybrid,llamacpp-greedy,llamacpp-lookup,ov-greedy,ov-lookup --out $out/spec_bench-peers-t0-stop67 --no-progress
step spec_bench_t1_stop67 tierspec bench --dataset spec_bench --per-category 5 --max-new-tokens 128 --temperature 1 \
    --seed 0 --methods ar,hybrid,llamacpp-greedy --out $out/spec_bench-t1-stop67 --no-progress
step pass_cost_stop67 python benchmarks/pass_cost.py --configs auto:auto --llamacpp --rounds 7 --out $out/pass_cost_stop67.md
step prefill_stop67 python benchmarks/prefill.py --configs auto --rounds 3 --openvino --out $out/prefill_stop67.md
step prefill_2048_stop67 python benchmarks/prefill.py --configs auto --rounds 3 --openvino --tokens 2048 \
    --out $out/prefill_2048_stop67.md
step kquant_stop67 python benchmarks/kquant_passes.py gemma3-270m smollm2-135m --dtypes auto --rounds 3
step memory_startup_stop67 python benchmarks/memory_startup.py --repeats 3 --out $out/memory_startup_stop67.md
echo "all done $(date -u +%FT%TZ)"
