"""What the engine's float16 KV cache saves: the default model's cached pass over float32 and float16
caches, alternating in one process, by rows and cached context.

    python benchmarks/kv_cache_cost.py [--contexts 300,1000] [--rows 1,2,4,8,16] [--repeats 40] [--texts 0]

The model is loaded as the CLI loads it (``--dtype auto``); one runner per cache type holds the same
``--contexts`` prompt (its caches made in that type: ``FusedLayer.kv_dtype``); each repeat times a pass
of k new tokens (logits for all, as verification needs) on one runner then the other, each rolled back
after. Reported: median ms per pass, the engine's attention time per pass (``_qengine.profile``) and the
ratio float16 / float32 from the same repeats.

``--texts N``: also N Spec-Bench prompts (5 per category, the bench's selection) generated greedily with
``ar`` to 128 tokens over each cache type, alternating per prompt: how many texts are equal, and where
the others part (the float16 rounding against float32's, seen in the tokens).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import tierspec
from tierspec import _qengine
from tierspec.cached_model import CachedModel
from tierspec.costs import few_row_threads
from tierspec.engine import kernel_report, threads_for


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--contexts", default="300,1000")
    parser.add_argument("--rows", default="1,2,4,8,16")
    parser.add_argument("--repeats", type=int, default=40)
    parser.add_argument("--texts", type=int, default=0)
    args = parser.parse_args()
    target = tierspec.load_model("smollm2-135m", dtype="auto")
    few_row_threads(target)  # the threads a generation's few-row products run on, as the decode loop settles them
    layers = target.model.model.layers
    print(f"{torch.get_num_threads()} threads; {kernel_report()}")
    with torch.inference_mode(), threads_for(target.model):
        for context in (int(c) for c in args.contexts.split(",")):
            runners = {}
            for dtype in (torch.float32, torch.float16):
                for layer in layers:
                    layer.fused.kv_dtype = dtype
                runner = CachedModel(target.model)
                runner.forward(torch.arange(context) % runner.vocab_size, logits_for=1)
                runners[dtype] = runner
            print(f"\ncontext {context}: | rows | float32 ms (attention) | float16 ms (attention) | float16 / float32 |")
            for rows in (int(r) for r in args.rows.split(",")):
                tokens = torch.arange(rows) + 5
                times = {dtype: [] for dtype in runners}
                attention = {dtype: 0.0 for dtype in runners}
                for _ in range(args.repeats):
                    for dtype, runner in runners.items():
                        _qengine.profile(True)
                        started = time.perf_counter()
                        runner.forward(tokens, logits_for=rows)
                        times[dtype].append(time.perf_counter() - started)
                        attention[dtype] += _qengine.profile(False)[2]
                        runner.rollback(context)
                wide, half = (statistics.median(times[d]) * 1e3 for d in (torch.float32, torch.float16))
                print(f"| {rows} | {wide:.2f} ({attention[torch.float32] / args.repeats * 1e3:.2f}) | "
                      f"{half:.2f} ({attention[torch.float16] / args.repeats * 1e3:.2f}) | {half / wide:.3f} |")
    if args.texts:
        compare_texts(target, layers, args.texts)
    for layer in layers:
        layer.fused.kv_dtype = layer.fused.numerics.kv_dtype


def compare_texts(target, layers, count: int) -> None:
    from tierspec.data import load_prompts, select

    prompts = select(load_prompts("spec_bench"), per_category=5)[:count]
    equal, parted = 0, []
    for prompt in prompts:
        tokens = {}
        for dtype in (torch.float32, torch.float16):
            for layer in layers:
                layer.fused.kv_dtype = dtype
            tokens[dtype] = tierspec.generate(prompt.text, target=target, method="ar", max_new_tokens=128,
                                              temperature=0.0).token_ids
        wide, half = tokens[torch.float32], tokens[torch.float16]
        if wide == half:
            equal += 1
        else:
            parted.append(next((i for i, (a, b) in enumerate(zip(wide, half)) if a != b), min(len(wide), len(half))))
    print(f"\ngreedy `ar`, {len(prompts)} Spec-Bench prompts, 128 tokens: {equal} texts equal over float16 and float32 "
          f"caches; the others part at tokens {sorted(parted)}")


if __name__ == "__main__":
    main()
