#!/usr/bin/env bash
# Third part of the 2026-12-03 campaign (same CPU and rules as run.sh), after --dtype auto became
# int8 rows on AVX2 (quant.default_numerics): the passes, prefill, loop, Spec-Bench greedy and t=1,
# serving, JSON extraction, K-quant passes and start-up again, peers in the same runs.
#   nohup bash results/zen3/run3.sh > results/zen3/int8/run3.log 2>&1 &
set -u
cd "$(dirname "$0")/../.."
out=results/zen3/int8
source results/zen3/step.sh
step warm tierspec generate "Name three primary colours." --stats
step pass_cost python benchmarks/pass_cost.py --llamacpp --configs auto:auto,float32:gguf --rounds 5 --out $out/pass_cost.md
step prefill python benchmarks/prefill.py --configs auto,float32 --rounds 3 --out $out/prefill.md
step loop_time python benchmarks/loop_time.py --out $out/loop_time.json
step spec_bench tierspec bench --dataset spec_bench --per-category 5 --max-new-tokens 128 --temperature 0 --methods ar,hybrid,adaptive-pld,hybrid-tree,llamacpp-greedy,ov-greedy --out $out/spec_bench --no-progress
step serve_load python benchmarks/serve_load.py --concurrency 1,2,4,8 --requests-per-client 2 --max-tokens 128 --peers --out $out/serve_load.json --report $out/serving-report.md
step spec_bench_t1 tierspec bench --dataset spec_bench --per-category 5 --max-new-tokens 128 --temperature 1 --seed 0 --methods ar,hybrid,llamacpp-greedy --out $out/spec_bench-t1 --no-progress
step json_extract tierspec bench --dataset json_extract --limit 16 --max-new-tokens 256 --temperature 0 --methods ar,hybrid,adaptive-pld --out $out/json_extract --no-progress
step kquant python benchmarks/kquant_passes.py gemma3-270m $HOME/.cache/tierspec/scale/qwen2.5-0.5b-Q4_K_M-v2.gguf $HOME/.cache/tierspec/scale/llama-3.2-1b-Q4_K_M-v2.gguf --dtypes auto --rounds 3
step memory_startup python benchmarks/memory_startup.py --repeats 3 --out $out/memory_startup.md
echo "all done $(date -u +%FT%TZ)"
