#!/bin/bash
# The server at 1 and 8 clients, greedy and t=1, this checkout against the code before this stop (4afd868, a
# worktree at $BEFORE with its extensions built) taking turns for two rounds; run from the repository root under
# the CPU lock. Writes results/batch_load.json (moved here) and prints the tables (serve_load_ab.log).
BEFORE=${BEFORE:-/tmp/base73}
python benchmarks/serve_load.py --concurrency 1,8 --rounds 2 --before $BEFORE
