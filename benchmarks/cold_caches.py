"""What a pass's weight stream costs the code that runs after it: a few small torch operators timed
warm, and right after streaming as many bytes as the default model's pass reads (its int8 layers and
LM head), with the same operators in between.

    python benchmarks/cold_caches.py [--megabytes 150] [--rounds 30]

Why: the decode loop's own time (``loop_time.py``) is measured between passes, and every pass of a
model larger than the last-level cache evicts the interpreter's and torch's code and data; the
first operators after it pay for that whatever they are. Prints the median microseconds of each
operator both ways (1 torch thread, as a generation runs them)."""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch


def operators(x: torch.Tensor, weight: torch.Tensor) -> list[float]:
    """Seconds of: an addition, an RMS norm and numpy's argmax, each on one row."""
    times = []
    started = time.perf_counter()
    _ = x + 0.0
    times.append(time.perf_counter() - started)
    started = time.perf_counter()
    torch.nn.functional.rms_norm(x, (x.shape[-1],), weight, 1e-5)
    times.append(time.perf_counter() - started)
    started = time.perf_counter()
    x.numpy().argmax()
    times.append(time.perf_counter() - started)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--megabytes", type=int, default=150, help="bytes streamed between rounds (a pass's weights)")
    parser.add_argument("--rounds", type=int, default=30)
    args = parser.parse_args()
    torch.set_num_threads(1)
    weights = np.ones(args.megabytes * 1_000_000, dtype=np.int8)
    x, weight = torch.randn(1, 576), torch.ones(576)
    names = ("x + 0", "rms_norm", "numpy argmax")
    with torch.inference_mode():
        for label, stream in (("warm", False), (f"after streaming {args.megabytes} MB", True)):
            rounds = []
            for _ in range(args.rounds):
                if stream:
                    np.bitwise_xor.reduce(weights[::64])  # one read of every cache line
                rounds.append(operators(x, weight))
            medians = [statistics.median(r[i] for r in rounds) * 1e6 for i in range(len(names))]
            print(f"{label:>26}: " + ", ".join(f"{name} {us:.1f} µs" for name, us in zip(names, medians)))


if __name__ == "__main__":
    main()
