#!/usr/bin/env bash
# Zen 4 (AMD EPYC family 25 model 17: AVX-512 with VNNI and BF16, no AMX; 2 cores), 2026-12-05, stop 57's final
# code: the issue's loop and server targets at the current code (run 18 measured the prefill, passes and Spec-Bench).
#   nohup bash results/zen4/run19.sh > results/zen4/run19.log 2>&1 &
set -u
cd "$(dirname "$0")/../.."
out=results/zen4/int8
source results/zen3/step.sh
step loop_time_stop57 python benchmarks/loop_time.py --methods ar,hybrid,eagle --temperatures 0,1 --prompts 4 --tokens 128 --repeats 3 --out $out/loop_time_stop57.json
step serve_load_stop57 python benchmarks/serve_load.py --concurrency 1,8 --requests-per-client 2 --max-tokens 128 --peers --out $out/serve_load_stop57.json
echo "all done $(date -u +%FT%TZ)"
