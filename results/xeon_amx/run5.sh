#!/usr/bin/env bash
# Intel Xeon with AMX (as run1.sh), 2026-12-05, stop 59: what the keyed draws cost inside the LM head's product against
# the same draws after it (the walk's way before), by rows.
#   nohup bash results/xeon_amx/run5.sh > results/xeon_amx/run5.log 2>&1 &
set -u
cd "$(dirname "$0")/../.."
out=results/xeon_amx
source results/zen3/step.sh
step pass_breakdown_draws python benchmarks/pass_breakdown.py --passes 200 --maxima 1,2,4,8,12 --out $out/pass_breakdown_draws.json
echo "all done $(date -u +%FT%TZ)"
