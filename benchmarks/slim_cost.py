"""Cost of one slim-verifier (masked) forward against a full one, cached, after a 256-token context.

    python benchmarks/slim_cost.py

Medians of 15 forwards per size (after one warm-up), for 1 and 6 new tokens: what a VIA-SD slim
call costs in full-pass units on this machine.
"""
import statistics
import time

import torch

from tierspec.cached_model import CachedModel
from tierspec.models import load_model
from tierspec.layerskip.masks import RoutingMask

t = load_model("smollm2-135m")
runner = CachedModel(t.model)
masks = {"full": None, **{r: RoutingMask.load(f"masks/smollm2-135m-sublayer-{r}.json", t.identity) for r in ("r0.1", "r0.45")}}
ctx = 256
with torch.inference_mode():
    runner.forward(torch.arange(ctx) % runner.vocab_size, logits_for=1)
    for n in (1, 6):
        for rnd in range(2):
            for name, mask in masks.items():
                tokens = (torch.arange(n) * 7 + 11) % runner.vocab_size
                samples = []
                for i in range(16):
                    s = time.perf_counter(); runner.forward(tokens, logits_for=n, mask=mask); e = time.perf_counter() - s
                    runner.rollback(ctx)
                    if i: samples.append(e)
                if rnd: print(f"n={n} {name}: median {1000*statistics.median(samples):.1f} ms")
