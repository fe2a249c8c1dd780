#!/usr/bin/env bash
# Zen 4 (AMD EPYC family 25 model 17: AVX-512 with VNNI and BF16, no AMX; 2 cores), 2026-12-05, stop 52: the n-gram
# lookup's dormancy with the head on its own schedule (run6 paused the head's tries too: greedy τ 1.53 → 1.50): the
# issue's Spec-Bench measures at temperature 1 and 0.
#   nohup bash results/zen4/run7.sh > results/zen4/run7.log 2>&1 &
set -u
cd "$(dirname "$0")/../.."
out=results/zen4/int8
source results/zen3/step.sh
step spec_bench_lookup_dormant_t1 tierspec bench --dataset spec_bench --per-category 5 --max-new-tokens 128 --temperature 1 --seed 0 --methods ar,hybrid,llamacpp-greedy --out $out/spec_bench-lookup-dormant-t1 --no-progress
step spec_bench_lookup_dormant_t0 tierspec bench --dataset spec_bench --per-category 5 --max-new-tokens 128 --temperature 0 --seed 0 --methods ar,hybrid,llamacpp-greedy --out $out/spec_bench-lookup-dormant-t0 --no-progress
echo "all done $(date -u +%FT%TZ)"
