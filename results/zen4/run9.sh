#!/usr/bin/env bash
# Zen 4 (AMD EPYC family 25 model 17: AVX-512 with VNNI and BF16, no AMX; 2 cores), 2026-12-05, stop 53: the session's
# final code (46bcb59: the keyed draws on AVX-512 and a batch's per-sequence bookkeeping trimmed) against ff2f78b (its
# own noise kernel, built in its folder) in the loop, and the batch and the server as they stand.
#   nohup bash results/zen4/run9.sh > results/zen4/run9.log 2>&1 &
set -u
cd "$(dirname "$0")/../.."
out=results/zen4/int8
source results/zen3/step.sh
before=$(before_own_build ff2f78b)
step loop_time_stop53 python benchmarks/loop_time.py --methods ar,hybrid --temperatures 0,1 --prompts 4 --tokens 128 --repeats 3 --before "$before" --out $out/loop_time_stop53.json
step batch_cycle_stop53 python benchmarks/batch_cycle.py --sizes 1,8 --methods hybrid,ar --prompts 32 --out $out/batch_cycle_stop53.json
step serve_load_stop53 python benchmarks/serve_load.py --concurrency 1,8 --requests-per-client 2 --max-tokens 128 --peers --out $out/serve_load_stop53.json
echo "all done $(date -u +%FT%TZ)"
