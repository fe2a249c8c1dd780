#!/usr/bin/env bash
# Intel Xeon with AMX (as run1.sh), 2026-12-06, stop 61: the hybrid carries how long to rest the head and the
# n-gram lookup from one generation to the next (drafters/eagle.py ScheduleMemory) and its lookup's bar is in
# seconds: the issue's temperature-1 command and the greedy peers' run again on int8 rows (as run6.sh).
#   nohup bash results/xeon_amx/run7.sh > results/xeon_amx/run7.log 2>&1 &
set -u
cd "$(dirname "$0")/../.."
out=results/xeon_amx
source results/zen3/step.sh
step spec_bench_t1_stop61 tierspec bench --dataset spec_bench --per-category 5 --max-new-tokens 128 --temperature 1 --seed 0 \
    --methods ar,hybrid,eagle,llamacpp-greedy --out $out/spec_bench-t1-stop61 --no-progress
step spec_bench_peers_t0_stop61 tierspec bench --dataset spec_bench --per-category 5 --max-new-tokens 128 --temperature 0 \
    --seed 0 --methods ar,hybrid,llamacpp-greedy,llamacpp-lookup,ov-greedy,ov-lookup --out $out/spec_bench-peers-t0-stop61 --no-progress
# After the review: head_coupling.py draws the decode loop's own keyed noise (sampling.gumbel_rows) in place of
# its own torch.rand Gumbel vectors; run 6's head_coupling.json came from the latter.
step head_coupling_keyed python benchmarks/head_coupling.py --out $out/head_coupling_keyed.json
echo "all done $(date -u +%FT%TZ)"
