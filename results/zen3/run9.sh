#!/usr/bin/env bash
# Ninth part of the 2026-12-03 campaign (same CPU and rules as run.sh; a new session's machine): Spec-Bench at
# temperature 1 and greedy after the hybrid's head retries back off (8, 16, 32, 64 idle cycles) and passes are
# costed at the context their rows attend to (the pass table timed after 256 and 1,024 cached positions).
#   nohup bash results/zen3/run9.sh > results/zen3/int8/run9.log 2>&1 &
set -u
cd "$(dirname "$0")/../.."
out=results/zen3/int8
source results/zen3/step.sh
step spec_bench_context_t1 tierspec bench --dataset spec_bench --per-category 5 --max-new-tokens 128 --temperature 1 --seed 0 --methods ar,hybrid,llamacpp-greedy --out $out/spec_bench-context-t1 --no-progress
step spec_bench_context tierspec bench --dataset spec_bench --per-category 5 --max-new-tokens 128 --temperature 0 --methods ar,hybrid,adaptive-pld,llamacpp-greedy --out $out/spec_bench-context --no-progress
echo "all done $(date -u +%FT%TZ)"
