#!/usr/bin/env bash
# Zen 4 (AMD EPYC family 25 model 17: AVX-512 with VNNI and BF16, no AMX; 2 cores), 2026-12-05, stop 57's code:
# a chain's rows attending in blocks (the prefill's attention) and the ov-* peers without OpenVINO's prefix
# caching — the prefill beside llama.cpp's and OpenVINO's, a pass by rows, Spec-Bench greedy beside both peers
# and the issue's temperature-1 measure.
#   nohup bash results/zen4/run18.sh > results/zen4/run18.log 2>&1 &
set -u
cd "$(dirname "$0")/../.."
out=results/zen4/int8
source results/zen3/step.sh
step prefill_stop57 python benchmarks/prefill.py --configs auto --rounds 3 --openvino --out $out/prefill_stop57.md
step prefill_stop57_2048 python benchmarks/prefill.py --configs auto --rounds 3 --tokens 2048 --openvino --out $out/prefill_stop57_2048.md
step pass_cost_stop57 python benchmarks/pass_cost.py --configs auto:auto --llamacpp --rounds 7 --out $out/pass_cost_stop57.md
step spec_bench_stop57_peers_t0 tierspec bench --dataset spec_bench --per-category 5 --max-new-tokens 128 --temperature 0 --seed 0 --methods ar,hybrid,llamacpp-greedy,llamacpp-lookup,ov-greedy,ov-lookup --out $out/spec_bench-stop57-peers-t0 --no-progress
step spec_bench_stop57_t1 tierspec bench --dataset spec_bench --per-category 5 --max-new-tokens 128 --temperature 1 --seed 0 --methods ar,hybrid,eagle,llamacpp-greedy --out $out/spec_bench-stop57-t1 --no-progress
echo "all done $(date -u +%FT%TZ)"
