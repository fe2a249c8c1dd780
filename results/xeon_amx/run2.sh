#!/usr/bin/env bash
# Intel Xeon with AMX (as run1.sh), 2026-12-05, stop 58's final code: the issue's loop and server measures on this CPU.
#   nohup bash results/xeon_amx/run2.sh > results/xeon_amx/run2.log 2>&1 &
set -u
cd "$(dirname "$0")/../.."
out=results/xeon_amx
source results/zen3/step.sh
step loop_time python benchmarks/loop_time.py --methods ar,hybrid,eagle --temperatures 0,1 --prompts 4 --tokens 128 --repeats 3 --out $out/loop_time.json
step serve_load python benchmarks/serve_load.py --concurrency 1,8 --requests-per-client 2 --max-tokens 128 --peers --out $out/serve_load.json
echo "all done $(date -u +%FT%TZ)"
