#!/bin/bash
# In-process batch cycles at the server test's 64-token replies (cycles64.py): the code before this stop (d5e864b)
# and after, each a worktree with the extensions copied in and the same cost tables (copied to each code
# fingerprint), taking turns, three rounds; `hybrid`, one and eight generations, greedy and t=1.
BEFORE=${BEFORE:-/tmp/base74}; AFTER=${AFTER:-/tmp/after74}
for round in 1 2 3; do
 for side in before after; do
  if [ $side = before ]; then dir=$BEFORE; else dir=$AFTER; fi
  for size in 1 8; do
   for temperature in 0 1; do
    echo "$side r$round B=$size t=$temperature $(PYTHONPATH=$dir flock -x /tmp/tierspec-cpu.lock python results/zen4/stop74/cycles64.py $size $temperature hybrid 2>&1 | tail -1)"
   done
  done
 done
done
