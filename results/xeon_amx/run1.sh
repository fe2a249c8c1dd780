#!/usr/bin/env bash
# Intel Xeon with AMX (family 6 model 207: AVX-512 with VNNI, BF16 and FP16, AMX-TILE/INT8/BF16; a 2-core VM,
# 2 MB of L2 a core), 2026-12-05, stop 58's code: the first run of the AMX path on real tiles — what the
# tiles add beside VNNI's kernel, the prefill beside llama.cpp's and OpenVINO's, a pass by rows, and Spec-Bench
# greedy beside both peers and at temperature 1 (the issue's measure) on this CPU.
#   nohup bash results/xeon_amx/run1.sh > results/xeon_amx/run1.log 2>&1 &
set -u
cd "$(dirname "$0")/../.."
out=results/xeon_amx
source results/zen3/step.sh
step isa_compare python benchmarks/isa_compare.py --paths amx,avx512bf16 --rounds 7 --out $out/isa_compare.md
step prefill python benchmarks/prefill.py --configs auto --rounds 3 --openvino --out $out/prefill.md
step pass_cost python benchmarks/pass_cost.py --configs auto:auto --llamacpp --rounds 7 --out $out/pass_cost.md
step spec_bench_peers_t0 tierspec bench --dataset spec_bench --per-category 5 --max-new-tokens 128 --temperature 0 --seed 0 --methods ar,hybrid,llamacpp-greedy,llamacpp-lookup,ov-greedy,ov-lookup --out $out/spec_bench-peers-t0 --no-progress
step spec_bench_t1 tierspec bench --dataset spec_bench --per-category 5 --max-new-tokens 128 --temperature 1 --seed 0 --methods ar,hybrid,eagle,llamacpp-greedy --out $out/spec_bench-t1 --no-progress
echo "all done $(date -u +%FT%TZ)"
