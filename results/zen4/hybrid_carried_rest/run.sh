#!/bin/bash
# The Spec-Bench bench (ar and the default, 128 tokens, seed 0) at t=1 and greedy, the code
# before the carried rest (4afd868, a worktree at $BEFORE with its extensions built) and after
# (this checkout) taking turns, two rounds each; run from the repository root under the CPU lock.
# Tables: the before code's cost tables copied to the after code's fingerprint (one table for both).
BEFORE=${BEFORE:-/tmp/base73}
OUT=${OUT:-/tmp/s73}
for temperature in 1 0; do
  for round in 1 2; do
    for side in before after; do
      if [ $side = before ]; then dir=$BEFORE; else dir=$PWD; fi
      out=$OUT/t${temperature}_${side}_$round
      rm -rf $out
      (cd $dir && PYTHONPATH=$dir python -m tierspec.cli bench --dataset spec_bench --per-category 5 --max-new-tokens 128 \
        --temperature $temperature --seed 0 --methods ar,hybrid --no-nll --no-progress --out $out > $out.log 2>&1)
      echo "$side $round: $(grep -E '^\| .(ar|hybrid)' $out/summary.md | cut -c1-120 | tr '\n' ' ')"
    done
  done
done
