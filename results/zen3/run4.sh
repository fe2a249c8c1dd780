#!/usr/bin/env bash
# Fourth part of the 2026-12-03 campaign (same CPU and rules as run.sh): Qwen3-0.6B and Phi-3-mini
# random-weight Q4_K_M files of their published shapes (benchmarks/scale.py), their passes at
# --dtype auto (int8 rows here) and float32 rows beside llama.cpp on the same files. (Run twice: llama.cpp
# refused the first Phi-3 file, written without Phi-3's control tokens; the file was rewritten by 25cc1b0.)
#   nohup bash results/zen3/run4.sh > results/zen3/int8/run4.log 2>&1 &
set -u
cd "$(dirname "$0")/../.."
out=results/zen3/int8
source results/zen3/step.sh
step write_new_shapes python -c "import sys; sys.path.insert(0, 'benchmarks'); import scale; [print(scale.write_file(m, 'Q4_K_M')) for m in ('qwen3-0.6b', 'phi-3-mini')]"
step kquant_new python benchmarks/kquant_passes.py $HOME/.cache/tierspec/scale/qwen3-0.6b-Q4_K_M-v2.gguf $HOME/.cache/tierspec/scale/phi-3-mini-Q4_K_M-v2.gguf --dtypes auto,float32 --rounds 3
echo "all done $(date -u +%FT%TZ)"
