#!/usr/bin/env bash
# Sixteenth part of the campaign (same CPU and rules as run.sh), 2026-12-04: the loop's Python after a pass
# (the pass sweeps the caches: each numpy call on the way to a row's token cost 10-50 us) -- the walk's argmaxes
# straight from Python ints (keyed_noise.argmax_rows), token keys made ahead, trims of the cycle. One
# generation's loop time, continuous batching and the server against the session's first commit (8ee4c59);
# Spec-Bench at temperature 1 with the peers (the issue's measure of the default method against ar).
#   nohup bash results/zen3/run16.sh > results/zen3/int8/run16.log 2>&1 &
set -u
cd "$(dirname "$0")/../.."
out=results/zen3/int8
source results/zen3/step.sh
before=$(before_checkout 8ee4c59)  # the keyed-noise extension of this checkout only adds argmax_rows
step loop_time_after_pass python benchmarks/loop_time.py --methods ar,hybrid --temperatures 0,1 --prompts 4 --tokens 128 --repeats 3 --before "$before" --out $out/loop_time_after_pass.json
for round in 1 2; do
    step batch_after_pass_$round python benchmarks/batch_cycle.py --sizes 1,8 --methods ar,hybrid --prompts 16 --max-new-tokens 96 --out $out/batch_after_pass_$round.json
    step batch_before_pass_$round env PYTHONPATH="$before" python "$before/benchmarks/batch_cycle.py" --sizes 1,8 --methods ar,hybrid --prompts 16 --max-new-tokens 96 --out $out/batch_before_pass_$round.json
done
step serve_load_after_pass python benchmarks/serve_load.py --concurrency 1,2,4,8,16 --requests-per-client 2 --max-tokens 128 --peers --before "$before" --rounds 2 --out $out/serve_load_after_pass.json
step spec_bench_after_pass_t1 tierspec bench --dataset spec_bench --per-category 5 --max-new-tokens 128 --temperature 1 --seed 0 --methods ar,hybrid,llamacpp-greedy --out $out/spec_bench-after-pass-t1 --no-progress
echo "all done $(date -u +%FT%TZ)"
