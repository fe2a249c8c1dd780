#!/usr/bin/env bash
# Zen 4 (AMD EPYC family 25 model 17: AVX-512 with VNNI and BF16, no AMX; 2 cores), 2026-12-05, stop 54, the session's
# final pass code (an engine cache's lengths in shared lists, a lone request as a batched pass of one, a batched pass's
# per-sequence work made for all rows at once) against 30ae1c2 (the session's start; its C is this checkout's).
#   nohup bash results/zen4/run12.sh > results/zen4/run12.log 2>&1 &
set -u
cd "$(dirname "$0")/../.."
out=results/zen4/int8
source results/zen3/step.sh
before=$(before_checkout 30ae1c2)
# what a pass costs outside the engine's calls: whole runs of each checkout in turn, then both in one process
step pass_python_before_1 env PYTHONPATH="$before" python benchmarks/pass_python.py --batches 1,8 --rows 1,3 --rounds 150 --out $out/pass_python_before_1.json
step pass_python_after_1 python benchmarks/pass_python.py --batches 1,8 --rows 1,3 --rounds 150 --out $out/pass_python_after_1.json
step pass_python_before_2 env PYTHONPATH="$before" python benchmarks/pass_python.py --batches 1,8 --rows 1,3 --rounds 150 --out $out/pass_python_before_2.json
step pass_python_after_2 python benchmarks/pass_python.py --batches 1,8 --rows 1,3 --rounds 150 --out $out/pass_python_after_2.json
step pass_python_paired python benchmarks/pass_python.py --batches 1,8 --rows 1,3 --rounds 150 --before "$before" --out $out/pass_python_paired.json
# the loop, the pass backend's run timed as the pass in both checkouts
step loop_time_stop54b python benchmarks/loop_time.py --methods ar,hybrid --temperatures 0,1 --prompts 4 --tokens 128 --repeats 3 --before "$before" --out $out/loop_time_stop54b.json
# batches in process, each checkout's package in turn
step batch_cycle_stop54b_before_1 env PYTHONPATH="$before" python benchmarks/batch_cycle.py --sizes 1,8 --methods hybrid,ar --prompts 32 --out $out/batch_cycle_stop54b_before_1.json
step batch_cycle_stop54b_after_1 python benchmarks/batch_cycle.py --sizes 1,8 --methods hybrid,ar --prompts 32 --out $out/batch_cycle_stop54b_after_1.json
step batch_cycle_stop54b_before_2 env PYTHONPATH="$before" python benchmarks/batch_cycle.py --sizes 1,8 --methods hybrid,ar --prompts 32 --out $out/batch_cycle_stop54b_before_2.json
step batch_cycle_stop54b_after_2 python benchmarks/batch_cycle.py --sizes 1,8 --methods hybrid,ar --prompts 32 --out $out/batch_cycle_stop54b_after_2.json
echo "all done $(date -u +%FT%TZ)"
