#!/usr/bin/env bash
# Intel Xeon with AMX (as run1.sh), 2026-12-05, stop 59: the issue's temperature-1 command at this code (sampled rows
# drawn inside the LM head's product), as run1.sh's spec_bench_t1 at stop 58's.
#   nohup bash results/xeon_amx/run4.sh > results/xeon_amx/run4.log 2>&1 &
set -u
cd "$(dirname "$0")/../.."
out=results/xeon_amx
source results/zen3/step.sh
step spec_bench_t1_stop59 tierspec bench --dataset spec_bench --per-category 5 --max-new-tokens 128 --temperature 1 --seed 0 \
    --methods ar,hybrid,eagle,llamacpp-greedy --out $out/spec_bench-t1-stop59 --no-progress
echo "all done $(date -u +%FT%TZ)"
