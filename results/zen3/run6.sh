#!/usr/bin/env bash
# Sixth part of the 2026-12-03 campaign (same CPU and rules as run.sh): the decode loop's own time with the
# default numerics (loop_time.py now loads --dtype auto, as the CLI does: int8 rows here), this checkout
# beside the one before the per-pass layer scan was trimmed (/tmp/loop_base: `git archive bcf3ef3 tierspec`, the package as at d617678
# with the compiled modules copied beside it), interleaved prompt by prompt in one process.
#   nohup bash results/zen3/run6.sh > results/zen3/int8/run6.log 2>&1 &
set -u
cd "$(dirname "$0")/../.."
out=results/zen3/int8
source results/zen3/step.sh
step loop_time_auto python benchmarks/loop_time.py --before /tmp/loop_base --out $out/loop_time_auto.json
echo "all done $(date -u +%FT%TZ)"
