#!/bin/bash
# batch_cycle at 0.7/k40/p0.9 and 1/k40, 1 and 8 sequences: before (/tmp/base72b: git archive 232a7c0, the
# extensions copied beside it) and after (this tree), alternated twice. Stop 72, AMD EPYC (Zen 4), 2026-12-07.
cd "$(dirname "$0")/../../.."
here=$(pwd)
for round in 1 2; do
  for filt in "--temperature 0.7 --top-k 40 --top-p 0.9" "--temperature 1 --top-k 40"; do
    for root in /tmp/base72b $here; do
      tag=$([ $root = $here ] && echo after || echo before)
      echo "== round $round $tag $filt"
      PYTHONPATH=$root flock -x /tmp/tierspec-cpu.lock python benchmarks/batch_cycle.py --sizes 1,8 --methods hybrid,ar $filt \
        --out results/zen4/batch_topk/bc_${round}_${tag}_$(echo $filt | tr -d ' -.').json 2>&1 | grep "^|" | grep -v "^|---"
    done
  done
done
