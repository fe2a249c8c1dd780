"""Matrix-product time of one decoding pass, by number of rows: nn.Linear's x·Wᵀ against the
few-row form (W·xᵀ)ᵀ of ``tierspec.kernels``, on the default model's shapes.

    python benchmarks/few_row_linear.py

30 layers of (q, k, v, o, gate, up, down) with SmolLM2-135M's shapes plus the 49,152-row LM
head, random float32 weights (330 MB, so weights stream from memory as in the real model),
median of 7 passes. Run it alone on the machine; it prints milliseconds per pass.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.nn.functional as F

from tierspec.kernels import FewRowLinear

HIDDEN, INTERMEDIATE, KV, VOCAB, LAYERS = 576, 1536, 192, 49152, 30
SHAPES = [(HIDDEN, HIDDEN), (HIDDEN, KV), (HIDDEN, KV), (HIDDEN, HIDDEN),
          (HIDDEN, INTERMEDIATE), (HIDDEN, INTERMEDIATE), (INTERMEDIATE, HIDDEN)]


def main() -> None:
    torch.manual_seed(0)
    layers = [[torch.nn.Linear(i, o, bias=False) for i, o in SHAPES] for _ in range(LAYERS)]
    layers.append([torch.nn.Linear(HIDDEN, VOCAB, bias=False)])
    few_row = FewRowLinear(1, 1, bias=False)

    def one_pass(rows: int, kind: str) -> None:
        inputs = {HIDDEN: torch.randn(rows, HIDDEN), INTERMEDIATE: torch.randn(rows, INTERMEDIATE)}
        for block in layers:
            for layer in block:
                x = inputs[layer.in_features]
                if kind == "linear":
                    F.linear(x, layer.weight)
                else:
                    few_row.weight = layer.weight
                    few_row(x)

    def median_ms(rows: int, kind: str) -> float:
        one_pass(rows, kind)
        times = []
        for _ in range(7):
            started = time.perf_counter()
            one_pass(rows, kind)
            times.append(time.perf_counter() - started)
        return statistics.median(times) * 1e3

    print(f"threads {torch.get_num_threads()}; ms per pass (matrix products only)")
    print("rows   nn.Linear   few-row   ratio")
    with torch.inference_mode():
        for rows in (1, 2, 3, 4, 5, 6, 8, 11, 16):
            linear, fast = median_ms(rows, "linear"), median_ms(rows, "few-row")
            print(f"{rows:4d} {linear:11.1f} {fast:9.1f} {linear / fast:7.2f}")


if __name__ == "__main__":
    main()
