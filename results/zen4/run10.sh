#!/usr/bin/env bash
# Zen 4 (AMD EPYC family 25 model 17: AVX-512 with VNNI and BF16, no AMX; 2 cores), 2026-12-05, stop 53: tree drafters
# reading their reduced vocabulary's noise only (gumbel_values) against 5dac4b2 (the whole vector a depth), sampled.
#   nohup bash results/zen4/run10.sh > results/zen4/run10.log 2>&1 &
set -u
cd "$(dirname "$0")/../.."
out=results/zen4/int8
source results/zen3/step.sh
before=$(before_own_build 5dac4b2)
step loop_time_tree_noise python benchmarks/loop_time.py --methods hybrid-tree,eagle-tree --temperatures 1 --prompts 4 --tokens 128 --repeats 2 --before "$before" --out $out/loop_time_tree_noise.json
echo "all done $(date -u +%FT%TZ)"
