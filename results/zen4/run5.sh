#!/usr/bin/env bash
# Zen 4 (AMD EPYC family 25 model 17: AVX-512 with VNNI and BF16, no AMX; 2 cores), 2026-12-05, stop 52: the Python
# after a pass (the final norm on the engine's kernel, the n-gram index by latest ends, the loop's outer layers), measured
# beside the commit before it (484cad1) where the benchmark can run two checkouts, and on the issue's Spec-Bench measures.
#   nohup bash results/zen4/run5.sh > results/zen4/run5.log 2>&1 &
set -u
cd "$(dirname "$0")/../.."
out=results/zen4/int8
source results/zen3/step.sh
before=$(before_checkout 484cad1)
step loop_time_after_pass python benchmarks/loop_time.py --methods ar,hybrid --temperatures 0,1 --prompts 4 --tokens 128 --repeats 3 --before "$before" --out $out/loop_time_after_pass.json
step spec_bench_after_pass_t1 tierspec bench --dataset spec_bench --per-category 5 --max-new-tokens 128 --temperature 1 --seed 0 --methods ar,hybrid,llamacpp-greedy --out $out/spec_bench-after-pass-t1 --no-progress
step spec_bench_after_pass_t0 tierspec bench --dataset spec_bench --per-category 5 --max-new-tokens 128 --temperature 0 --seed 0 --methods ar,hybrid,llamacpp-greedy --out $out/spec_bench-after-pass-t0 --no-progress
echo "all done $(date -u +%FT%TZ)"
