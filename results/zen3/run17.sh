#!/usr/bin/env bash
# Seventeenth part of the campaign (same CPU and rules as run.sh), 2026-12-04: the draft head's first catch-up
# over the prompt's last 64 positions (drafters/eagle.py FIRST_CATCH_UP) and cost tables made under load
# measured again (costs.FASTER_NOW). One generation's loop time against the session's first commit (daa6797);
# Spec-Bench at temperature 1 with the peers (the issue's measure of the default method against ar), then greedy.
#   nohup bash results/zen3/run17.sh > results/zen3/int8/run17.log 2>&1 &
set -u
cd "$(dirname "$0")/../.."
out=results/zen3/int8
source results/zen3/step.sh
before=$(before_checkout daa6797)
step loop_time_first_catch_up python benchmarks/loop_time.py --methods ar,hybrid --temperatures 0,1 --prompts 4 --tokens 128 --repeats 3 --before "$before" --out $out/loop_time_first_catch_up.json
step spec_bench_first_catch_up_t1 tierspec bench --dataset spec_bench --per-category 5 --max-new-tokens 128 --temperature 1 --seed 0 --methods ar,hybrid,llamacpp-greedy --out $out/spec_bench-first-catch-up-t1 --no-progress
step spec_bench_first_catch_up_t0 tierspec bench --dataset spec_bench --per-category 5 --max-new-tokens 128 --temperature 0 --seed 0 --methods ar,hybrid,llamacpp-greedy --out $out/spec_bench-first-catch-up-t0 --no-progress
echo "all done $(date -u +%FT%TZ)"
