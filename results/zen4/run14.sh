#!/usr/bin/env bash
# Zen 4 (AMD EPYC family 25 model 17: AVX-512 with VNNI and BF16, no AMX; 2 cores), 2026-12-05, stop 55's final code
# (the draft head's step with fewer torch operators: its cache's views made when read, its engine table kept, its
# embedding, norm and rotary rows on the engine's terms; a lone chain's pass as run13's) against e62812c (the
# session's start; no C changed, so its folder takes this build), and the issue's target commands at this commit.
#   nohup bash results/zen4/run14.sh > results/zen4/run14.log 2>&1 &
set -u
cd "$(dirname "$0")/../.."
out=results/zen4/int8
source results/zen3/step.sh
before=$(before_checkout e62812c)
# a head step right after a target pass: whole runs of each checkout in turn
for round in 1 2 3; do
    step head_step_before_$round env PYTHONPATH="$before" python benchmarks/head_step.py --rounds 200 --out $out/head_step_before_$round.json
    step head_step_after_$round python benchmarks/head_step.py --rounds 200 --out $out/head_step_after_$round.json
done
# the loop, both checkouts in one process
step loop_time_stop55b python benchmarks/loop_time.py --methods ar,hybrid,eagle --temperatures 0,1 --prompts 4 --tokens 128 --repeats 3 --before "$before" --out $out/loop_time_stop55b.json
# batches in process, each checkout's package in turn
for round in 1 2; do
    step batch_cycle_stop55b_before_$round env PYTHONPATH="$before" python benchmarks/batch_cycle.py --sizes 1,8 --methods hybrid,ar --prompts 32 --out $out/batch_cycle_stop55b_before_$round.json
    step batch_cycle_stop55b_after_$round python benchmarks/batch_cycle.py --sizes 1,8 --methods hybrid,ar --prompts 32 --out $out/batch_cycle_stop55b_after_$round.json
done
# the issue's target commands (eagle beside them: the head's steps are what changed)
step spec_bench_stop55b_t1 tierspec bench --dataset spec_bench --per-category 5 --max-new-tokens 128 --temperature 1 --seed 0 --methods ar,hybrid,eagle,llamacpp-greedy --out $out/spec_bench-stop55b-t1 --no-progress
step spec_bench_stop55b_t0 tierspec bench --dataset spec_bench --per-category 5 --max-new-tokens 128 --temperature 0 --seed 0 --methods ar,hybrid,eagle,llamacpp-greedy --out $out/spec_bench-stop55b-t0 --no-progress
step serve_load_stop55b python benchmarks/serve_load.py --concurrency 1,2,4,8,16 --requests-per-client 2 --max-tokens 128 --peers --out $out/serve_load_stop55b.json
echo "all done $(date -u +%FT%TZ)"
