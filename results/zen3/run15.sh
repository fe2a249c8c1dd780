#!/usr/bin/env bash
# Fifteenth part of the campaign (same CPU and rules as run.sh), 2026-12-04: the verifier passes record the
# draft head's features only where the head may run soon (Drafter.wants_features). Continuous batching and one
# generation's loop time against the checkout before it (968f7be), alternating; Spec-Bench at temperature 1
# with the peers (the issue's measure of the default method against ar).
#   nohup bash results/zen3/run15.sh > results/zen3/int8/run15.log 2>&1 &
set -u
cd "$(dirname "$0")/../.."
out=results/zen3/int8
source results/zen3/step.sh
before=$(before_checkout 968f7be)  # the C engine is the same in both
for round in 1 2; do
    step batch_features_after_$round python benchmarks/batch_cycle.py --sizes 1,8 --methods ar,hybrid --prompts 16 --max-new-tokens 96 --out $out/batch_features_after_$round.json
    step batch_features_before_$round env PYTHONPATH="$before" python "$before/benchmarks/batch_cycle.py" --sizes 1,8 --methods ar,hybrid --prompts 16 --max-new-tokens 96 --out $out/batch_features_before_$round.json
done
step loop_time_features python benchmarks/loop_time.py --methods ar,hybrid --temperatures 0,1 --prompts 4 --tokens 128 --repeats 2 --before "$before" --out $out/loop_time_features.json
step spec_bench_features_t1 tierspec bench --dataset spec_bench --per-category 5 --max-new-tokens 128 --temperature 1 --seed 0 --methods ar,hybrid,llamacpp-greedy --out $out/spec_bench-features-t1 --no-progress
echo "all done $(date -u +%FT%TZ)"
