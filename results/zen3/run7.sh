#!/usr/bin/env bash
# Seventh part of the 2026-12-03 campaign (same CPU and rules as run.sh): Spec-Bench again after the draft head's
# step was costed as measured (costs.draft_step_cost) instead of by its weight bytes, greedy and at temperature 1;
# then where a one-token pass's time goes (benchmarks/pass_breakdown.py).
#   nohup bash results/zen3/run7.sh > results/zen3/int8/run7.log 2>&1 &
set -u
cd "$(dirname "$0")/../.."
out=results/zen3/int8
source results/zen3/step.sh
step spec_bench_headstep_t1 tierspec bench --dataset spec_bench --per-category 5 --max-new-tokens 128 --temperature 1 --seed 0 --methods ar,hybrid,llamacpp-greedy --out $out/spec_bench-headstep-t1 --no-progress
step spec_bench_headstep tierspec bench --dataset spec_bench --per-category 5 --max-new-tokens 128 --temperature 0 --methods ar,hybrid,adaptive-pld,llamacpp-greedy --out $out/spec_bench-headstep --no-progress
step pass_breakdown python benchmarks/pass_breakdown.py --norm-twice --featured --out $out/pass_breakdown.json
echo "all done $(date -u +%FT%TZ)"
