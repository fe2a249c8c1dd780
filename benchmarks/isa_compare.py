"""The engine's kernel paths side by side on this CPU: one 8-bit product by rows, then whole passes by
rows and a long prompt's prefill on the default model, each path taking its turn in every round.

    python benchmarks/isa_compare.py [--paths amx,avx512bf16] [--rounds 5] [--out results/.../isa.md]

Which kernels serve a row count is the engine's choice (docs/engine.md §Kernel paths): on an AMX CPU
the ``amx`` path takes 8-bit products over 64 rows and more on the tiles and VNNI's kernel below, so
``amx`` beside ``avx512bf16`` (VNNI at every width) shows what the tiles add, row count by row count.
Every path gives the same bits (tests/models/test_engine_kernels.py): this is about time only.

Products: a 1,536 x 576 weight (the default model's MLP shape) of Q4_1 and of Q8_0 blocks, random
values quantised by gguf-py, the median over rounds of the mean of ``--calls`` products. Passes: the
default model's cached pass of k new tokens at 256 cached tokens (as ``pass_cost.py``), and a
1,024-token prefill from an empty cache (as ``prefill.py``), medians over rounds. A path this process
cannot run (``tierspec.engine.engine().isas()``) is refused. The host's speed drifts within minutes
on a shared VM: compare paths within one run only.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import quantize

from tierspec import quant
from tierspec.cached_model import CachedModel
from tierspec.engine import engine, threads_for
from tierspec.models import load_model
from tierspec.quant import QuantWeight, numerics_for

PRODUCT_ROWS = [1, 4, 16, 32, 64, 256]
PASS_ROWS = [1, 16, 64, 128]
CONTEXT = 256
PREFILL = 1024


def product_weight(kind: str, rows: int = 1536, width: int = 576) -> QuantWeight:
    values = np.random.default_rng(0).standard_normal((rows, width)).astype(np.float32)
    blocks = torch.from_numpy(quantize(values, GGMLQuantizationType[kind]).copy())
    return QuantWeight(blocks, getattr(quant, kind), width, numerics_for(torch.int8))


def time_product(weight: QuantWeight, x: torch.Tensor, calls: int) -> float:
    weight.multiply(x)
    started = time.perf_counter()
    for _ in range(calls):
        weight.multiply(x)
    return (time.perf_counter() - started) / calls


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--paths", default="amx,avx512bf16", help="kernel paths to compare (comma-separated)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=30, help="products timed per round and row count")
    parser.add_argument("--out", type=Path, default=None, help="also write the tables (markdown) here")
    args = parser.parse_args()
    qe = engine()
    paths = args.paths.split(",")
    unknown = [path for path in paths if path not in qe.isas()]
    if unknown:
        print(f"this process cannot run {unknown}: its paths are {qe.isas()}", file=sys.stderr)
        return 2
    before = qe.isa()
    weights = {kind: product_weight(kind) for kind in ("Q4_1", "Q8_0")}
    x = torch.randn(max(PRODUCT_ROWS), 576, generator=torch.Generator().manual_seed(1))
    runner = CachedModel(load_model("smollm2-135m", dtype="auto").model)
    vocab = runner.vocab_size
    products = {(kind, path, m): [] for kind in weights for path in paths for m in PRODUCT_ROWS}
    passes = {(path, k): [] for path in paths for k in PASS_ROWS + ["prefill"]}
    try:
        with torch.inference_mode(), threads_for(runner.model):
            for round_index in range(args.rounds):
                print(f"round {round_index + 1}/{args.rounds}", file=sys.stderr)
                for path in paths:
                    qe.select_isa(path)
                    for kind, weight in weights.items():
                        for m in PRODUCT_ROWS:
                            products[(kind, path, m)].append(time_product(weight, x[:m].contiguous(), args.calls))
                    runner.rollback(0)
                    runner.forward(torch.arange(CONTEXT) % vocab, logits_for=1)
                    for k in PASS_ROWS:
                        tokens = (torch.arange(k) * 7 + 11) % vocab
                        runner.forward(tokens)  # untimed warm-up
                        runner.rollback(CONTEXT)
                        started = time.perf_counter()
                        runner.forward(tokens)
                        passes[(path, k)].append(time.perf_counter() - started)
                        runner.rollback(CONTEXT)
                    runner.rollback(0)
                    prompt = (torch.arange(PREFILL) * 13 + round_index) % vocab
                    started = time.perf_counter()
                    runner.forward(prompt, logits_for=1)
                    passes[(path, "prefill")].append(time.perf_counter() - started)
                    runner.rollback(0)
    finally:
        qe.select_isa(before)
    lines = [f"One 1,536 x 576 product of 8-bit rows, median of {args.rounds} interleaved rounds (us), "
             f"{torch.get_num_threads()} threads, `{engine().probe()['isa']}` CPU:", "",
             "| weight | path | " + " | ".join(f"{m} rows" for m in PRODUCT_ROWS) + " |",
             "|---|---|" + "---|" * len(PRODUCT_ROWS)]
    for kind in weights:
        for path in paths:
            cells = [f"{statistics.median(products[(kind, path, m)]) * 1e6:.1f}" for m in PRODUCT_ROWS]
            lines.append(f"| {kind} | {path} | " + " | ".join(cells) + " |")
    lines += ["", f"The default model's cached pass of k tokens at {CONTEXT} cached tokens and a {PREFILL}-token "
              f"prefill, median of {args.rounds} interleaved rounds (ms):", "",
              "| path | " + " | ".join(f"k={k}" for k in PASS_ROWS) + " | prefill |",
              "|---|" + "---|" * (len(PASS_ROWS) + 1)]
    for path in paths:
        cells = [f"{statistics.median(passes[(path, k)]) * 1e3:.1f}" for k in PASS_ROWS + ["prefill"]]
        lines.append(f"| {path} | " + " | ".join(cells) + " |")
    table = "\n".join(lines)
    print(table)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        temporary = args.out.with_suffix(args.out.suffix + ".tmp")
        temporary.write_text(table + "\n")
        temporary.replace(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
