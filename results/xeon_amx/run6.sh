#!/usr/bin/env bash
# Intel Xeon with AMX (as run1.sh), 2026-12-06, stop 60: the bench's --dtype auto now runs the default model as
# generate and the server do (int8 rows, float16 KV cache on the engine; every earlier Spec-Bench run here measured
# bfloat16 rows): the issue's temperature-1 command and the greedy peers' run again, and the draft head's coupled
# acceptance on sampled text (benchmarks/head_coupling.py: why temperature 1 does not pay).
#   nohup bash results/xeon_amx/run6.sh > results/xeon_amx/run6.log 2>&1 &
set -u
cd "$(dirname "$0")/../.."
out=results/xeon_amx
source results/zen3/step.sh
step head_coupling python benchmarks/head_coupling.py --out $out/head_coupling.json
step spec_bench_t1_int8 tierspec bench --dataset spec_bench --per-category 5 --max-new-tokens 128 --temperature 1 --seed 0 \
    --methods ar,hybrid,eagle,llamacpp-greedy --out $out/spec_bench-t1-int8 --no-progress
step spec_bench_peers_t0_int8 tierspec bench --dataset spec_bench --per-category 5 --max-new-tokens 128 --temperature 0 \
    --seed 0 --methods ar,hybrid,llamacpp-greedy,llamacpp-lookup,ov-greedy,ov-lookup --out $out/spec_bench-peers-t0-int8 --no-progress
echo "all done $(date -u +%FT%TZ)"
