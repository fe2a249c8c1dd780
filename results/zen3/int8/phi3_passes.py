# Phi-3-mini random-weight Q4_K_M passes (llama.cpp refused the file): run after run4.sh as
#   PYTHONPATH=$PWD flock -x /tmp/tierspec-cpu.lock python results/zen3/int8/phi3_passes.py > results/zen3/int8/phi3_passes.log
import sys, statistics, torch
sys.path.insert(0, "benchmarks")  # run from the repository root
from pass_cost import time_passes
from scale import CONTEXT, tierspec_model
from tierspec.cached_model import CachedModel
from tierspec.engine import threads_for
path = "/root/.cache/tierspec/scale/phi-3-mini-Q4_K_M-v2.gguf"
for dtype in ("auto", "float32"):
    model = tierspec_model(path, dtype)
    runner = CachedModel(model)
    with torch.inference_mode(), threads_for(runner.model):
        runner.forward(torch.arange(CONTEXT) % runner.vocab_size, logits_for=1)
        rounds = [time_passes(runner, CONTEXT, (1, 8, 16)) for _ in range(3)]
    print(dtype, {k: round(1e3 * statistics.median(r[k] for r in rounds), 1) for k in (1, 8, 16)}, flush=True)
    del runner, model
