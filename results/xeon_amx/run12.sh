#!/usr/bin/env bash
# Intel Xeon with AMX (as run1.sh), 2026-12-06, stop 64: the cycle's per-sequence work made leaner (35c0cb8)
# against the stop's start (924b082, this checkout's engine copied beside it: no C changed), whole runs
# alternated; the single generation's loop beside the start in one process; then the server at 1 and 8
# clients beside OpenVINO's continuous batching on the current code:
#   nohup bash results/xeon_amx/run12.sh > results/xeon_amx/run12.log 2>&1 &
set -u
cd "$(dirname "$0")/../.."
out=results/xeon_amx
source results/zen3/step.sh
before=$(before_checkout 924b082)
for round in 1 2; do
    for side in before after; do
        root=$PWD; [ $side = before ] && root=$before
        for temperature in 0 1; do
            step batch_cycle_stop64_${side}_t${temperature}_${round} env PYTHONPATH=$root python benchmarks/batch_cycle.py \
                --sizes 1,8 --methods hybrid,ar --temperature $temperature --out $out/batch_cycle_stop64_${side}_t${temperature}_${round}.json
        done
    done
done
step loop_time_stop64 python benchmarks/loop_time.py --methods ar,hybrid --temperatures 0,1 --prompts 4 --tokens 128 \
    --repeats 3 --before $before --out $out/loop_time_stop64.json
step serve_load_stop64 python benchmarks/serve_load.py --concurrency 1,8 --requests-per-client 2 --max-tokens 128 --peers \
    --out $out/serve_load_stop64.json
echo "all done $(date -u +%FT%TZ)"
