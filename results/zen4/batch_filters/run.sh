#!/bin/bash
# batch_cycle at top-p 0.95 (t=1) and 0.7/k40/p0.9, before (/tmp/base71's package) and after, alternated twice
cd /work/main
for round in 1 2; do
  for filt in "--temperature 1 --top-p 0.95" "--temperature 0.7 --top-k 40 --top-p 0.9"; do
    for root in /tmp/base71 /work/main; do
      tag=$(basename $root)
      echo "== round $round $tag $filt"
      PYTHONPATH=$root python benchmarks/batch_cycle.py --sizes 1,8 --methods hybrid,ar $filt --out results/zen4/batch_filters/bc_${round}_${tag}_$(echo $filt | tr -d ' -.').json 2>&1 | grep "^|" | grep -v "^|---"
    done
  done
done
