#!/bin/bash
# The server at top-p 0.95 (t=1) and with two penalties (greedy), 1 and 8 clients, against 951d56b (the code
# before stop 71's filtered draws and touched-token penalties; its tree with its extensions built in
# /tmp/base71), two alternated rounds. Stop 72, AMD EPYC (Zen 4), 2026-12-07.
set -e
cd "$(dirname "$0")/../../.."
flock -x /tmp/tierspec-cpu.lock python benchmarks/serve_load.py --concurrency 1,8 --rounds 2 \
    --settings 1/p0.95,0/pres0.5/freq0.3 --before /tmp/base71 --out results/zen4/serve_filters/batch_load.json \
    | tee results/zen4/serve_filters/run.log
