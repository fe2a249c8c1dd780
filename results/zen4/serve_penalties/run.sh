#!/bin/bash
# The server under presence 0.5 and frequency 0.3 (greedy), 1 and 8 clients: this tree against /tmp/base72c
# (git archive 4c86f93: the penalties as torch operators, its extensions built beside it), two alternated rounds.
# Stop 72, AMD EPYC (Zen 4), 2026-12-07.
set -e
cd "$(dirname "$0")/../../.."
flock -x /tmp/tierspec-cpu.lock python benchmarks/serve_load.py --concurrency 1,8 --rounds 2 --settings 0/pres0.5/freq0.3 \
    --before /tmp/base72c --out results/zen4/serve_penalties/batch_load.json | tee results/zen4/serve_penalties/run.log
