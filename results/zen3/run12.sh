#!/usr/bin/env bash
# Twelfth part of the 2026-12-03 campaign (same CPU and rules as run.sh), on this session's final code
# (the hybrid's head ceiling in a batch, KV buffers not zero-filled, a featured batched pass in one stack
# call, the sampled tokens of many rows on the engine's threads, the policies' cost caches): continuous
# batching against the checkout before the session (70da527) in alternating runs, the server under load
# with OpenVINO's continuous batching, and one generation's loop time beside the checkout before.
#   nohup bash results/zen3/run12.sh > results/zen3/int8/run12.log 2>&1 &
set -u
cd "$(dirname "$0")/../.."
out=results/zen3/int8
source results/zen3/step.sh
before=$(before_checkout 70da527)  # the C engine is the same in both
for round in 1 2; do
    step batch_final_after_$round python benchmarks/batch_cycle.py --sizes 1,4,8 --methods ar,hybrid --prompts 16 --max-new-tokens 96 --out $out/batch_final_after_$round.json
    step batch_final_before_$round env PYTHONPATH="$before" python "$before/benchmarks/batch_cycle.py" --sizes 1,4,8 --methods ar,hybrid --prompts 16 --max-new-tokens 96 --out $out/batch_final_before_$round.json
done
step serve_load_final python benchmarks/serve_load.py --concurrency 1,2,4,8 --requests-per-client 2 --max-tokens 128 --peers --out $out/serve_load_final.json
step loop_time_final python benchmarks/loop_time.py --methods ar,hybrid --temperatures 0,1 --prompts 4 --tokens 128 --repeats 2 --before "$before" --out $out/loop_time_final.json
echo "all done $(date -u +%FT%TZ)"
