#!/bin/bash
# batch_cycle under presence 0.5 and frequency 0.3, greedy, 1 and 8 sequences: before (/tmp/base72d: git archive
# 4a3b5b0, counts mirrored in Python lists and flushed at modify) and after (this tree: counts written into the numpy
# buffers at commit), alternated twice. Stop 72, AMD EPYC (Zen 4), 2026-12-07.
cd "$(dirname "$0")/../../.."
here=$(pwd)
for round in 1 2; do
  for root in /tmp/base72d $here; do
    tag=$([ $root = $here ] && echo after || echo before)
    echo "== round $round $tag"
    PYTHONPATH=$root flock -x /tmp/tierspec-cpu.lock python benchmarks/batch_cycle.py --sizes 1,8 --methods hybrid,ar \
      --presence-penalty 0.5 --frequency-penalty 0.3 --out results/zen4/batch_penalties_slots/bc_${round}_${tag}.json \
      2>&1 | grep "^|" | grep -v "^|---"
  done
done
