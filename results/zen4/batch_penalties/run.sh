#!/bin/bash
# batch_cycle under presence 0.5 and frequency 0.3 (greedy and t=1), 1 and 8 sequences: before (/tmp/base72c: git archive
# 4c86f93, the extensions copied beside it) and after (this tree), alternated twice. Stop 72, AMD EPYC (Zen 4), 2026-12-07.
cd "$(dirname "$0")/../../.."
here=$(pwd)
for round in 1 2; do
  for temp in 0 1; do
    for root in /tmp/base72c $here; do
      tag=$([ $root = $here ] && echo after || echo before)
      echo "== round $round $tag temperature $temp"
      PYTHONPATH=$root flock -x /tmp/tierspec-cpu.lock python benchmarks/batch_cycle.py --sizes 1,8 --methods hybrid,ar \
        --temperature $temp --presence-penalty 0.5 --frequency-penalty 0.3 \
        --out results/zen4/batch_penalties/bc_${round}_${tag}_t${temp}.json 2>&1 | grep "^|" | grep -v "^|---"
    done
  done
done
