#!/usr/bin/env bash
# The measurement campaign of 2026-12-03 on an AMD EPYC Zen 3 (family 25 model 1; AVX2+FMA+F16C, no
# AVX-512, no AMX), 2 cores: each step under the exclusive CPU lock, one after another, llama.cpp and
# OpenVINO GenAI timed in the same runs. Resumable: a step whose .done marker exists is skipped.
#   nohup bash results/zen3/run.sh > results/zen3/run.log 2>&1 &
set -u
cd "$(dirname "$0")/../.."
out=results/zen3
source results/zen3/step.sh
step warm tierspec generate "Name three primary colours." --stats
step pass_cost python benchmarks/pass_cost.py --llamacpp --configs auto:auto,int8:gguf --rounds 5 --out $out/pass_cost.md
step prefill python benchmarks/prefill.py --configs auto,int8 --rounds 3 --out $out/prefill.md
step loop_time python benchmarks/loop_time.py --out $out/loop_time.json
step spec_bench tierspec bench --dataset spec_bench --per-category 5 --max-new-tokens 128 --temperature 0 --methods ar,hybrid,adaptive-pld,hybrid-tree,llamacpp-greedy,ov-greedy --out $out/spec_bench --no-progress
step serve_load python benchmarks/serve_load.py --concurrency 1,2,4,8 --requests-per-client 2 --max-tokens 128 --peers --out $out/serve_load.json --report $out/serving-report.md
step json_extract tierspec bench --dataset json_extract --limit 16 --max-new-tokens 256 --temperature 0 --methods ar,hybrid,adaptive-pld --out $out/json_extract --no-progress
step json_free tierspec bench --dataset json_extract --free-text --limit 16 --max-new-tokens 256 --temperature 0 --methods ar,hybrid,adaptive-pld --out $out/json_extract-free --no-progress
step spec_bench_t1 tierspec bench --dataset spec_bench --per-category 5 --max-new-tokens 128 --temperature 1 --seed 0 --methods ar,hybrid,llamacpp-greedy --out $out/spec_bench-t1 --no-progress
echo "all done $(date -u +%FT%TZ)"
