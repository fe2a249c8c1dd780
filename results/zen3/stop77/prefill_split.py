"""A prompt's prefill on the pass engine split by the engine's own clocks (`_qengine.profile`): one cached pass
over N tokens from an empty cache (the last token's logits), the fastest of 3 after a warm one; the stack's
time, its matrix products and its attention, and the attention's FLOPs by the shapes (2 * 2 * head_dim per
query head and causal key: QK^T and the weighted values).

    python results/zen3/stop77/prefill_split.py
"""
import time

import torch

import tierspec
from tierspec.costs import measuring_runner
from tierspec.engine import engine, threads_for

torch.set_num_threads(2)
target = tierspec.load_model("smollm2-135m", dtype="auto")
config = target.model.config
with threads_for(target.model), torch.inference_mode():
    for n in (256, 1024):
        runner = measuring_runner(target.model)
        ids = torch.arange(n) % 1000 + 100
        runner.forward(ids, logits_for=1)
        runner.rollback(0)
        best = None
        for _ in range(3):
            engine().profile(True)
            started = time.perf_counter()
            runner.forward(ids, logits_for=1)
            wall = time.perf_counter() - started
            runner.rollback(0)
            profile = engine().profile(False)
            if best is None or wall < best[0]:
                best = (wall, profile)
        wall, (stack, products, attention, *_) = best
        flops = config.num_hidden_layers * config.num_attention_heads * (n * (n + 1) / 2) * 4 * (
            config.hidden_size // config.num_attention_heads)
        print(f"{n} tokens: {wall:.3f} s ({1e3 * wall / n:.2f} ms a token); stack {stack:.3f}, products {products:.3f} "
              f"({100 * products / wall:.0f}%), attention {attention:.3f} ({100 * attention / wall:.0f}%: "
              f"{flops / 1e9:.1f} GFLOP, {flops / attention / 1e9:.0f} GFLOP/s)")
