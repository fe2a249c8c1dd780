#!/bin/bash
# In-process batch cycles (cycles.py: BatchDecoder.run_all on 16 MT-Bench prompts, $TOKENS-token replies, `hybrid`,
# one and eight sequences, greedy and t=1): the code before (a worktree at $BEFORE with its extensions built) and
# after ($AFTER, default this checkout) taking turns, $ROUNDS rounds; ms a cycle by phase. Run from the repository
# root; each run takes the CPU lock; both sides read the same cost tables (copied to each code fingerprint).
# Stop 73: `bash results/zen4/noise_keys/run.sh` (4afd868 at /tmp/base73; 128 tokens, two rounds).
# Stop 74: `BEFORE=/tmp/base74 AFTER=/tmp/after74 TOKENS=64 ROUNDS=3 bash results/zen4/noise_keys/run.sh` (d5e864b, bdb6f8a).
BEFORE=${BEFORE:-/tmp/base73}; AFTER=${AFTER:-$PWD}; TOKENS=${TOKENS:-128}; ROUNDS=${ROUNDS:-2}
for round in $(seq 1 $ROUNDS); do
 for side in before after; do
  if [ $side = before ]; then dir=$BEFORE; else dir=$AFTER; fi
  for size in 1 8; do
   for temperature in 0 1; do
    echo "$side r$round B=$size t=$temperature $(PYTHONPATH=$dir flock -x /tmp/tierspec-cpu.lock python results/zen4/noise_keys/cycles.py $size $temperature hybrid 1 $TOKENS 2>&1 | tail -1)"
   done
  done
 done
done
