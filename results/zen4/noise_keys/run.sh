#!/bin/bash
# In-process batch cycles (benchmarks/batch_cycle.py's BatchDecoder.run_all on 16 MT-Bench prompts, 128 tokens,
# `hybrid`, one and eight sequences, greedy and t=1): the code before this stop (4afd868, a worktree at $BEFORE with
# its extensions built) and after (this checkout) taking turns, two rounds; ms a cycle by phase. Run from the
# repository root under the CPU lock; both read the same cost tables (copied to each fingerprint).
BEFORE=${BEFORE:-/tmp/base73}
for round in 1 2; do
 for side in before after; do
  if [ $side = before ]; then dir=$BEFORE; else dir=$PWD; fi
  for size in 1 8; do
   for temperature in 0 1; do
    echo "$side r$round B=$size t=$temperature $(PYTHONPATH=$dir python results/zen4/noise_keys/cycles.py $size $temperature hybrid 1 2>&1 | tail -1)"
   done
  done
 done
done
