#!/usr/bin/env bash
# Zen 4 (AMD EPYC family 25 model 17: AVX-512 with VNNI and BF16, no AMX; 2 cores), 2026-12-05, stop 54: a pass's
# per-sequence Python made for all rows at once, every layer's cache length in one array, a lone request as a
# batched pass of one, the hybrid's draft bar made once per cost model — against 30ae1c2 (the session's start; its C
# is this checkout's, so its folder takes this build) in the loop, batches and the server.
#   nohup bash results/zen4/run11.sh > results/zen4/run11.log 2>&1 &
set -u
cd "$(dirname "$0")/../.."
out=results/zen4/int8
source results/zen3/step.sh
before=$(before_checkout 30ae1c2)
step loop_time_stop54 python benchmarks/loop_time.py --methods ar,hybrid --temperatures 0,1 --prompts 4 --tokens 128 --repeats 3 --before "$before" --out $out/loop_time_stop54.json
# the batch in process, this checkout and the one before taking turns (the script is this checkout's, the package each's)
step batch_cycle_stop54_before_1 env PYTHONPATH="$before" python benchmarks/batch_cycle.py --sizes 1,8 --methods hybrid,ar --prompts 32 --out $out/batch_cycle_stop54_before_1.json
step batch_cycle_stop54_after_1 python benchmarks/batch_cycle.py --sizes 1,8 --methods hybrid,ar --prompts 32 --out $out/batch_cycle_stop54_after_1.json
step batch_cycle_stop54_before_2 env PYTHONPATH="$before" python benchmarks/batch_cycle.py --sizes 1,8 --methods hybrid,ar --prompts 32 --out $out/batch_cycle_stop54_before_2.json
step batch_cycle_stop54_after_2 python benchmarks/batch_cycle.py --sizes 1,8 --methods hybrid,ar --prompts 32 --out $out/batch_cycle_stop54_after_2.json
step serve_load_stop54 python benchmarks/serve_load.py --concurrency 1,8 --requests-per-client 2 --max-tokens 128 --peers --before "$before" --rounds 2 --out $out/serve_load_stop54.json
echo "all done $(date -u +%FT%TZ)"
