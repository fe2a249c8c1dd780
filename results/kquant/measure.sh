cd /work/wt/kquant
lscpu | grep "Model name"
for root in /work/main /work/wt/kquant; do
  PYTHONPATH=$root timeout 1200 python benchmarks/kquant_passes.py gemma3-270m ~/.cache/tierspec/scale/qwen2.5-0.5b-Q4_K_M-v2.gguf ~/.cache/tierspec/scale/llama-3.2-1b-Q4_K_M-v2.gguf --rounds 3 2>&1 | grep -v "^llama_kv\|^tierspec: .*gguf:"
done
