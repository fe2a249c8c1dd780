#!/usr/bin/env bash
# Zen 4 (AMD EPYC family 25 model 17: AVX-512 with VNNI and BF16, no AMX; 2 cores), 2026-12-05, stop 55: the draft
# head's engine step and a lone chain's pass with fewer torch operators, against e62812c (the session's start; no C
# changed, so its folder takes this build), and the issue's target commands at this commit.
#   nohup bash results/zen4/run13.sh > results/zen4/run13.log 2>&1 &
set -u
cd "$(dirname "$0")/../.."
out=results/zen4/int8
source results/zen3/step.sh
before=$(before_checkout e62812c)
# the loop, both checkouts in one process
step loop_time_stop55 python benchmarks/loop_time.py --methods ar,hybrid --temperatures 0,1 --prompts 4 --tokens 128 --repeats 3 --before "$before" --out $out/loop_time_stop55.json
# a pass outside the engine's calls: whole runs of each checkout in turn
step pass_python_stop55_before_1 env PYTHONPATH="$before" python benchmarks/pass_python.py --batches 1,8 --rows 1,3 --rounds 150 --out $out/pass_python_stop55_before_1.json
step pass_python_stop55_after_1 python benchmarks/pass_python.py --batches 1,8 --rows 1,3 --rounds 150 --out $out/pass_python_stop55_after_1.json
step pass_python_stop55_before_2 env PYTHONPATH="$before" python benchmarks/pass_python.py --batches 1,8 --rows 1,3 --rounds 150 --out $out/pass_python_stop55_before_2.json
step pass_python_stop55_after_2 python benchmarks/pass_python.py --batches 1,8 --rows 1,3 --rounds 150 --out $out/pass_python_stop55_after_2.json
# batches in process, each checkout's package in turn
step batch_cycle_stop55_before_1 env PYTHONPATH="$before" python benchmarks/batch_cycle.py --sizes 1,8 --methods hybrid,ar --prompts 32 --out $out/batch_cycle_stop55_before_1.json
step batch_cycle_stop55_after_1 python benchmarks/batch_cycle.py --sizes 1,8 --methods hybrid,ar --prompts 32 --out $out/batch_cycle_stop55_after_1.json
step batch_cycle_stop55_before_2 env PYTHONPATH="$before" python benchmarks/batch_cycle.py --sizes 1,8 --methods hybrid,ar --prompts 32 --out $out/batch_cycle_stop55_before_2.json
step batch_cycle_stop55_after_2 python benchmarks/batch_cycle.py --sizes 1,8 --methods hybrid,ar --prompts 32 --out $out/batch_cycle_stop55_after_2.json
# the issue's target commands
step spec_bench_stop55_t1 tierspec bench --dataset spec_bench --per-category 5 --max-new-tokens 128 --temperature 1 --seed 0 --methods ar,hybrid,llamacpp-greedy --out $out/spec_bench-stop55-t1 --no-progress
step spec_bench_stop55_t0 tierspec bench --dataset spec_bench --per-category 5 --max-new-tokens 128 --temperature 0 --seed 0 --methods ar,hybrid,eagle,llamacpp-greedy --out $out/spec_bench-stop55-t0 --no-progress
step serve_load_stop55 python benchmarks/serve_load.py --concurrency 1,2,4,8,16 --requests-per-client 2 --max-tokens 128 --peers --out $out/serve_load_stop55.json
echo "all done $(date -u +%FT%TZ)"
