#!/usr/bin/env bash
# Fourteenth part of the campaign (same CPU and rules as run.sh), 2026-12-04: what a batched pass pays beyond
# one sequence's pass of as many rows, by cached context (the batch's attention reads a cache per sequence).
#   nohup bash results/zen3/run14.sh > results/zen3/int8/run14.log 2>&1 &
set -u
cd "$(dirname "$0")/../.."
out=results/zen3/int8
source results/zen3/step.sh
step batched_pass_cost python benchmarks/batched_pass_cost.py --contexts 20,300,900 --sequences 8 --rows 1,2 --repeats 30 --out $out/batched_pass_cost.json
# one generation's loop time beside the checkout before this session (874bf72): the depth-by-depth walk of
# sampled chains is the session's change on that path
before=$(before_checkout 874bf72)
step loop_time_depth python benchmarks/loop_time.py --methods ar,hybrid --temperatures 0,1 --prompts 4 --tokens 128 --repeats 2 --before "$before" --out $out/loop_time_depth.json
echo "all done $(date -u +%FT%TZ)"
