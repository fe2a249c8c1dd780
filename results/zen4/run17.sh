#!/usr/bin/env bash
# Zen 4 (AMD EPYC family 25 model 17: AVX-512 with VNNI and BF16, no AMX; 2 cores), 2026-12-05, stop 56's final
# code: the server's 1- and 8-client load again (run 15's 8-client greedy pass ran slow), a lone pass's engine calls
# and Python with each checkout's package in whole alternating runs (run 15's loop ran both engines in one process),
# and the torch calls a cycle makes now.
#   nohup bash results/zen4/run17.sh > results/zen4/run17.log 2>&1 &
set -u
cd "$(dirname "$0")/../.."
out=results/zen4/int8
source results/zen3/step.sh
before=$(before_checkout 97367ab)
step serve_load_stop56b python benchmarks/serve_load.py --concurrency 1,8 --requests-per-client 2 --max-tokens 128 --peers --out $out/serve_load_stop56b.json
for round in 1 2; do
    step pass_python_stop56_before_$round env PYTHONPATH="$before" python benchmarks/pass_python.py --batches 1,8 --rows 1,3 --rounds 150 --out $out/pass_python_stop56_before_$round.json
    step pass_python_stop56_after_$round python benchmarks/pass_python.py --batches 1,8 --rows 1,3 --rounds 150 --out $out/pass_python_stop56_after_$round.json
done
step torch_calls_stop56 python benchmarks/torch_calls.py --out results/torch_calls/this.json
echo "all done $(date -u +%FT%TZ)"
