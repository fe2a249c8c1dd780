#!/usr/bin/env bash
# Zen 4 (AMD EPYC family 25 model 17: AVX-512 with VNNI and BF16, no AMX; 2 cores), 2026-12-04: the engine's
# float16 KV caches (gguf_llama.KV_DTYPE): the pass against float32 caches alternating in one process; the
# issue's Spec-Bench measure at temperature 1 and greedy (compare with run1's at 57fb6ab through the peer's
# ratio: llama.cpp did not change); the loop's own time.
#   nohup bash results/zen4/run2.sh > results/zen4/run2.log 2>&1 &
set -u
cd "$(dirname "$0")/../.."
out=results/zen4/int8
source results/zen3/step.sh
step kv_half python benchmarks/kv_cache_cost.py --contexts 300,1000 --rows 1,2,4,8,16 --repeats 40
step spec_bench_kv_half_t1 tierspec bench --dataset spec_bench --per-category 5 --max-new-tokens 128 --temperature 1 --seed 0 --methods ar,hybrid,llamacpp-greedy --out $out/spec_bench-kv-half-t1 --no-progress
step spec_bench_kv_half_t0 tierspec bench --dataset spec_bench --per-category 5 --max-new-tokens 128 --temperature 0 --seed 0 --methods ar,hybrid,llamacpp-greedy --out $out/spec_bench-kv-half-t0 --no-progress
step loop_time_kv_half python benchmarks/loop_time.py --methods ar,hybrid --temperatures 0,1 --prompts 4 --tokens 128 --repeats 3 --out $out/loop_time_kv_half.json
echo "all done $(date -u +%FT%TZ)"
# appended after the steps above ran: greedy texts over float16 against float32 caches (30 prompts), and the engine's
# fidelity to the float32 model: auto (int8 rows, float16 caches) beside int8 rows on float32 caches (teacher-forced KL)
step kv_half_texts python benchmarks/kv_cache_cost.py --contexts 300 --rows 1 --repeats 5 --texts 30
step engine_fidelity_kv_half python benchmarks/engine_fidelity.py --prompts 24 --dtypes auto,int8,float32 --out $out/engine_fidelity-kv-half
echo "all done $(date -u +%FT%TZ)"
