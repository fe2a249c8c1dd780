#!/usr/bin/env bash
# Zen 4 (AMD EPYC family 25 model 17: AVX-512 with VNNI and BF16, no AMX; 2 cores), 2026-12-05, stop 56's code:
# the properties BENCHMARKS.md's current-code sections quote beside run 15's targets — a pass by rows beside
# llama.cpp's on the same file, peak memory and start-up, K-quant passes (Gemma 3 270M Q4_K_M) beside llama.cpp,
# and Spec-Bench greedy beside llama.cpp's and OpenVINO GenAI's greedy and prompt-lookup decoding.
#   nohup bash results/zen4/run16.sh > results/zen4/run16.log 2>&1 &
set -u
cd "$(dirname "$0")/../.."
out=results/zen4/int8
source results/zen3/step.sh
step pass_cost_stop56 python benchmarks/pass_cost.py --configs auto:auto --llamacpp --rounds 7 --out $out/pass_cost_stop56.md
step memory_startup_stop56 python benchmarks/memory_startup.py --repeats 3 --out $out/memory_startup_stop56.md
step kquant_stop56 python benchmarks/kquant_passes.py gemma3-270m smollm2-135m --dtypes auto --rounds 3
step spec_bench_stop56_peers_t0 tierspec bench --dataset spec_bench --per-category 5 --max-new-tokens 128 --temperature 0 --seed 0 --methods ar,hybrid,llamacpp-greedy,llamacpp-lookup,ov-greedy,ov-lookup --out $out/spec_bench-stop56-peers-t0 --no-progress
echo "all done $(date -u +%FT%TZ)"
