#!/usr/bin/env bash
# Fifth part of the 2026-12-03 campaign (same CPU and rules as run.sh): Phi-3-mini's passes again after
# the vectorised attention took 96-wide heads (any multiple of 32 up to 256), beside llama.cpp on the same file.
#   nohup bash results/zen3/run5.sh > results/zen3/int8/run5.log 2>&1 &
set -u
cd "$(dirname "$0")/../.."
out=results/zen3/int8
source results/zen3/step.sh
step kquant_phi3_attention python benchmarks/kquant_passes.py $HOME/.cache/tierspec/scale/phi-3-mini-Q4_K_M-v2.gguf --dtypes auto --rounds 3
echo "all done $(date -u +%FT%TZ)"
