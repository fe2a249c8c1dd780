#!/usr/bin/env bash
# Intel Xeon with AMX (as run1.sh), 2026-12-05, stop 59: sampled rows drawn inside the LM head's product and the
# hot path's records slotted, against stop 58's final code (a441dbf, its extensions built from its own sources),
# processes alternating; then the issue's loop and server measures at this code.
#   nohup bash results/xeon_amx/run3.sh > results/xeon_amx/run3.log 2>&1 &
set -u
cd "$(dirname "$0")/../.."
out=results/xeon_amx
source results/zen3/step.sh
before=$(before_own_build a441dbf)
for round in 1 2; do
    for temp in 1 0; do
        step batch_cycle_before_t${temp}_$round env PYTHONPATH="$before" python "$before/benchmarks/batch_cycle.py" --sizes 1,8 \
            --methods hybrid,ar --prompts 16 --temperature $temp --out $out/batch_cycle_before_t${temp}_$round.json
        step batch_cycle_after_t${temp}_$round python benchmarks/batch_cycle.py --sizes 1,8 --methods hybrid,ar --prompts 16 \
            --temperature $temp --out $out/batch_cycle_after_t${temp}_$round.json
    done
done
step loop_time3 python benchmarks/loop_time.py --methods ar,hybrid --temperatures 0,1 --prompts 4 --tokens 128 --repeats 3 \
    --out $out/loop_time3.json
step serve_load3 python benchmarks/serve_load.py --concurrency 1,2,4,8,16 --requests-per-client 2 --max-tokens 128 --peers \
    --out $out/serve_load3.json
echo "all done $(date -u +%FT%TZ)"
