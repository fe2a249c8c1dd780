#!/usr/bin/env bash
# Tenth part of the 2026-12-03 campaign (same CPU and rules as run.sh): the JSON-extraction set after
# constrained ar became plain decoding (one token a pass), beside `forced` (ar drafting the grammar's forced
# tokens alone: jump-forward) and llama.cpp following each schema with its own grammar, in the same runs;
# greedy, seeded at temperature 1, and the same prompts as free text.
#   nohup bash results/zen3/run10.sh > results/zen3/int8/run10.log 2>&1 &
set -u
cd "$(dirname "$0")/../.."
out=results/zen3/int8
source results/zen3/step.sh
step json_forced tierspec bench --dataset json_extract --per-category 4 --max-new-tokens 256 --temperature 0 --methods ar,forced,hybrid,adaptive-pld,llamacpp-greedy --out $out/json_extract-forced --no-progress
step json_forced_t1 tierspec bench --dataset json_extract --per-category 4 --max-new-tokens 256 --temperature 1 --seed 0 --methods ar,forced,hybrid,llamacpp-greedy --out $out/json_extract-forced-t1 --no-progress
step json_free tierspec bench --dataset json_extract --per-category 4 --max-new-tokens 256 --temperature 0 --free-text --methods ar,hybrid --out $out/json_extract-free --no-progress
echo "all done $(date -u +%FT%TZ)"
