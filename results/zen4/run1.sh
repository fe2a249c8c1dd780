#!/usr/bin/env bash
# Zen 4 (AMD EPYC family 25 model 17: AVX-512 with VNNI and BF16, no AMX; 2 cores), 2026-12-04: the issue's
# Spec-Bench measure at temperature 1 on this CPU at 57fb6ab (the code of stop 49), before this session's changes.
#   nohup bash results/zen4/run1.sh > results/zen4/run1.log 2>&1 &
set -u
cd "$(dirname "$0")/../.."
out=results/zen4/int8
source results/zen3/step.sh
step pass_cost_57fb6ab python benchmarks/pass_cost.py --configs auto:auto --rounds 5 --out $out/pass_cost_57fb6ab.md
step spec_bench_57fb6ab_t1 tierspec bench --dataset spec_bench --per-category 5 --max-new-tokens 128 --temperature 1 --seed 0 --methods ar,hybrid,llamacpp-greedy --out $out/spec_bench-57fb6ab-t1 --no-progress
echo "all done $(date -u +%FT%TZ)"
