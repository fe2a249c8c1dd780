#!/bin/bash
# batch_cycle under presence 0.5 and frequency 0.3 penalties, greedy and t=1: before (/tmp/base72: 995d17c's package,
# the compiled extensions beside it) and after (this checkout), alternated, two rounds
cd /work/main
for round in 1 2; do
  for temperature in 0 1; do
    for root in /tmp/base72 /work/main; do
      tag=$(basename $root)
      echo "== round $round $tag t=$temperature"
      PYTHONPATH=$root python benchmarks/batch_cycle.py --sizes 1,8 --methods hybrid,ar --temperature $temperature \
        --presence-penalty 0.5 --frequency-penalty 0.3 --out results/zen4/batch_modifiers/bc_${round}_${tag}_t${temperature}.json \
        2>&1 | grep "^|" | grep -v "^|---"
    done
  done
done
