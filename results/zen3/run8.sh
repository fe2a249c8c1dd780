#!/usr/bin/env bash
# Eighth part of the 2026-12-03 campaign (same CPU and rules as run.sh): Gemma 3 270M's greedy text with the
# default numerics (`--dtype auto`: int8 rows here) against transformers' float32 modules on the same file.
#   nohup bash results/zen3/run8.sh > results/zen3/int8/run8.log 2>&1 &
set -u
cd "$(dirname "$0")/../.."
out=results/zen3/int8
source results/zen3/step.sh
step gemma_fidelity_auto python benchmarks/model_fidelity.py --target gemma3-270m --prompts 24 --max-new-tokens 48 --dtype auto --out $out/models
echo "all done $(date -u +%FT%TZ)"
