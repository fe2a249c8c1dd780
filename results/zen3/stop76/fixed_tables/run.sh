#!/bin/bash
# The same code (6a93e8c's tierspec/, fingerprint 2811062d92df9c8f) under two forward-cost tables copied into its
# cache file before each run, alternated: X, the table that code measured itself on this Zen 3 (the fastest of 5
# rounds: 2 / 3 / 4 tokens 1.059 / 1.117 / 1.196x one), and Y, the same file with its seconds from 40 rounds' paired
# medians (1.117 / 1.239 / 1.300x; the per-position part X's). Order: t=1 X Y Y X, then greedy X Y Y X (runs.log).
# The cache file name is the key's hash on that machine; the first Y run at t=1 was restarted after an edit had
# changed the code's fingerprint (it measured tables of its own) — its output is not kept.
cd /work/main; export PYTHONPATH=/work/main
F=~/.cache/tierspec/forward-costs-c0880dcff807dd67.json
for spec in "1 X a" "1 Y a" "1 Y b" "1 X b" "0 X a" "0 Y a" "0 Y b" "0 X b"; do
  set -- $spec; T=$1; TAB=$2; R=$3
  out=results/zen3/stop76/fixed_tables/t${T}_${TAB}_${R}
  cp results/zen3/stop76/fixed_tables/table_${TAB}.json $F
  flock -x /tmp/tierspec-cpu.lock python -m tierspec.cli bench --dataset spec_bench --per-category 5 --max-new-tokens 128 \
      --temperature $T --seed 0 --methods ar,hybrid --no-progress --out $out
done
