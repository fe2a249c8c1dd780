#!/usr/bin/env bash
# Second part of the 2026-12-03 campaign (same CPU and rules as run.sh): K-quant files' passes
# (Gemma 3 270M Q4_K_M and scale.py's random-weight Qwen2.5-0.5B / Llama-3.2-1B Q4_K_M) at --dtype
# auto and int8 beside llama.cpp, and Gemma 3's text fidelity against transformers' float32 modules.
set -u
cd "$(dirname "$0")/../.."
out=results/zen3
source results/zen3/step.sh
step memory_startup python benchmarks/memory_startup.py --repeats 3 --out $out/memory_startup.md
step kquant python benchmarks/kquant_passes.py gemma3-270m $HOME/.cache/tierspec/scale/qwen2.5-0.5b-Q4_K_M-v2.gguf $HOME/.cache/tierspec/scale/llama-3.2-1b-Q4_K_M-v2.gguf --dtypes auto,int8 --rounds 3
step gemma_fidelity python benchmarks/model_fidelity.py --target gemma3-270m --prompts 24 --max-new-tokens 48 --out $out/models
# issue 36's "before" on this CPU: main before the AVX2 int8 / attention / layer merges (27650bb), built aside
step before_build bash -c 'rm -rf /tmp/before36 && mkdir -p /tmp/before36 && git archive 27650bb | tar -x -C /tmp/before36 && cd /tmp/before36 && python setup.py -q build_ext --inplace'
step pass_cost_before env PYTHONPATH=/tmp/before36 python /tmp/before36/benchmarks/pass_cost.py --llamacpp --configs auto:auto --rounds 5 --out $out/pass_cost_before.md
step json_extract_t1 tierspec bench --dataset json_extract --limit 16 --max-new-tokens 256 --temperature 1 --seed 0 --methods ar,hybrid,adaptive-pld --out $out/json_extract-t1 --no-progress
echo "all done $(date -u +%FT%TZ)"
