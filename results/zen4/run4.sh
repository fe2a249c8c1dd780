#!/usr/bin/env bash
# Zen 4 (AMD EPYC family 25 model 17: AVX-512 with VNNI and BF16, no AMX; 2 cores), 2026-12-04, stop 51: the draft
# head's products on the target's measured few-row threads (methods.draft_head_for); the issue's Spec-Bench measure at
# temperature 1 (with the head alone, eagle, beside the default) and greedy.
#   nohup bash results/zen4/run4.sh > results/zen4/run4.log 2>&1 &
set -u
cd "$(dirname "$0")/../.."
out=results/zen4/int8
source results/zen3/step.sh
step spec_bench_head_threads_t1 tierspec bench --dataset spec_bench --per-category 5 --max-new-tokens 128 --temperature 1 --seed 0 --methods ar,hybrid,eagle,llamacpp-greedy --out $out/spec_bench-head-threads-t1 --no-progress
step spec_bench_head_threads_t0 tierspec bench --dataset spec_bench --per-category 5 --max-new-tokens 128 --temperature 0 --seed 0 --methods ar,hybrid,eagle,llamacpp-greedy --out $out/spec_bench-head-threads-t0 --no-progress
step loop_time_head_threads python benchmarks/loop_time.py --methods ar,hybrid --temperatures 0,1 --prompts 4 --tokens 128 --repeats 3 --out $out/loop_time_head_threads.json
echo "all done $(date -u +%FT%TZ)"
# appended after the steps above ran (at 215ec13, the same computation): the server's batching at 1 and 8 clients with
# OpenVINO's continuous batching beside it (the issue's serve_load measure, at two client counts)
step serve_load_few_rows python benchmarks/serve_load.py --concurrency 1,8 --requests-per-client 2 --max-tokens 128 --peers --out $out/serve_load_few_rows.json --report $out/serve_load_few_rows.md
echo "all done $(date -u +%FT%TZ)"
