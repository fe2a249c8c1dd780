#!/usr/bin/env bash
# Intel Xeon with AMX (as run1.sh), 2026-12-06, stop 63: the final attention (4ca51c6) against the stop's start
# (a4ed32e, built from its own sources) end to end on long prompts (CNN/DailyMail articles, 400-1,200 tokens),
# whole runs alternated:
#   nohup bash results/xeon_amx/run11.sh > results/xeon_amx/run11.log 2>&1 &
set -u
cd "$(dirname "$0")/../.."
out=results/xeon_amx
source results/zen3/step.sh
before=$(before_own_build a4ed32e)
for round in 1 2; do
    for side in before after; do
        root=$PWD; [ $side = before ] && root=$before
        step cnn_${side}_${round} env PYTHONPATH=$root tierspec bench --dataset cnn_dailymail --limit 12 \
            --max-new-tokens 128 --temperature 0 --seed 0 --methods ar,hybrid --out $out/cnn-stop63-${side}-${round} --no-progress
    done
done
echo "all done $(date -u +%FT%TZ)"
