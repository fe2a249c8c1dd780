#!/usr/bin/env bash
# Eleventh part of the 2026-12-03 campaign (same CPU and rules as run.sh): continuous batching after the
# hybrid stopped trying a head that even certain drafts would not pay for in a batch, and the KV buffers
# stopped being zero-filled (c424569), against the checkout before (70da527) in alternating runs of the
# same script, then the server under load with OpenVINO's continuous batching in the same run.
#   nohup bash results/zen3/run11.sh > results/zen3/int8/run11.log 2>&1 &
set -u
cd "$(dirname "$0")/../.."
out=results/zen3/int8
source results/zen3/step.sh
before=$(before_checkout 70da527)  # the C engine is the same in both
for round in 1 2; do
    step batch_cycle_after_$round python benchmarks/batch_cycle.py --sizes 1,8 --methods ar,hybrid --prompts 16 --max-new-tokens 96 --out $out/batch_cycle_after_$round.json
    step batch_cycle_before_$round env PYTHONPATH="$before" python "$before/benchmarks/batch_cycle.py" --sizes 1,8 --methods ar,hybrid --prompts 16 --max-new-tokens 96 --out $out/batch_cycle_before_$round.json
done
step serve_load_batching python benchmarks/serve_load.py --concurrency 1,2,4,8 --requests-per-client 2 --max-tokens 128 --peers --out $out/serve_load_batching.json --report $out/serving-report-batching.md
echo "all done $(date -u +%FT%TZ)"
