#!/usr/bin/env bash
# Zen 4 (AMD EPYC family 25 model 17: AVX-512 with VNNI and BF16, no AMX; 2 cores), 2026-12-05, stop 56's code
# (the LM head's product finds each row's first maximum for the greedy walks; drafts and a chain's pass tokens as
# lists) against 97367ab (the session's start; its code calls the product without maxima, so its folder takes this
# build), and the issue's target commands at this commit.
#   nohup bash results/zen4/run15.sh > results/zen4/run15.log 2>&1 &
set -u
cd "$(dirname "$0")/../.."
out=results/zen4/int8
source results/zen3/step.sh
before=$(before_checkout 97367ab)
# the loop, both checkouts in one process
step loop_time_stop56 python benchmarks/loop_time.py --methods ar,hybrid,eagle --temperatures 0,1 --prompts 4 --tokens 128 --repeats 3 --before "$before" --out $out/loop_time_stop56.json
# batches in process, each checkout's package in turn
for round in 1 2; do
    step batch_cycle_stop56_before_$round env PYTHONPATH="$before" python benchmarks/batch_cycle.py --sizes 1,8 --methods hybrid,ar --prompts 32 --out $out/batch_cycle_stop56_before_$round.json
    step batch_cycle_stop56_after_$round python benchmarks/batch_cycle.py --sizes 1,8 --methods hybrid,ar --prompts 32 --out $out/batch_cycle_stop56_after_$round.json
done
# the issue's target commands
step spec_bench_stop56_t1 tierspec bench --dataset spec_bench --per-category 5 --max-new-tokens 128 --temperature 1 --seed 0 --methods ar,hybrid,eagle,llamacpp-greedy --out $out/spec_bench-stop56-t1 --no-progress
step spec_bench_stop56_t0 tierspec bench --dataset spec_bench --per-category 5 --max-new-tokens 128 --temperature 0 --seed 0 --methods ar,hybrid,eagle,llamacpp-greedy --out $out/spec_bench-stop56-t0 --no-progress
step serve_load_stop56 python benchmarks/serve_load.py --concurrency 1,2,4,8,16 --requests-per-client 2 --max-tokens 128 --peers --out $out/serve_load_stop56.json
echo "all done $(date -u +%FT%TZ)"
