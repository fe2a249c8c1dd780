"""Peak memory and start-up of `tierspec generate` in fresh processes.

    python benchmarks/memory_startup.py [--repeats 3] [--out results/memory_startup.md]

Every row is a fresh `tierspec generate` process (the model and its cost table already cached
under $TIERSPEC_CACHE: run any generation once before). Peak RSS is the child's ``ru_maxrss``
(the whole process: torch, the tokenizer, the model, the KV buffer); start-up is the wall time
of a short generation (8 tokens), median of ``--repeats``. Rows run interleaved, repeat by
repeat, so a busy spell of a shared machine hits all of them alike.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

PROMPT = "Explain in a few sentences why the sky is blue."
ROWS = {
    # label: extra arguments
    "ar, float32": ["--method", "ar", "--dtype", "float32"],
    "ar, default dtype (auto)": ["--method", "ar"],
    "default method and dtype": [],
}


def command(arguments: list[str], max_new_tokens: int) -> list[str]:
    return ["tierspec", "generate", PROMPT, "--max-new-tokens", str(max_new_tokens), "--temperature", "0", *arguments]


def start_up(arguments: list[str]) -> float:
    """Wall seconds of one fresh `tierspec generate` process of 8 tokens (what a user waits)."""
    start = time.perf_counter()
    done = subprocess.run(command(arguments, 8), capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"{' '.join(command(arguments, 8))} failed:\n{done.stderr}")
    return time.perf_counter() - start


def measure_rss(arguments: list[str], max_new_tokens: int) -> float:
    """Peak RSS (MiB) of one fresh `tierspec generate` process, read by a wrapper process of its own
    (``RUSAGE_CHILDREN`` is a maximum over all children, so each row needs its own parent)."""
    code = ("import resource, subprocess, sys; subprocess.run(sys.argv[1:], check=True, capture_output=True); "
            "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)")
    out = subprocess.run([sys.executable, "-c", code, *command(arguments, max_new_tokens)], capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(f"{' '.join(command(arguments, max_new_tokens))} failed:\n{out.stderr}")
    return int(out.stdout.strip()) / 1024  # Linux: KiB


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None, help="also write the table (markdown) here")
    args = parser.parse_args()
    for extra in ROWS.values():  # warm the caches (model conversion, cost tables) outside the measurement
        start_up(extra)
    starts = {label: [] for label in ROWS}
    peaks = {label: [] for label in ROWS}
    for repeat in range(args.repeats):
        for label, extra in ROWS.items():
            starts[label].append(start_up(extra))
            peaks[label].append(measure_rss(extra, 128))
        print(f"repeat {repeat + 1}/{args.repeats}", file=sys.stderr)
    base = statistics.median(peaks["ar, float32"])
    lines = [f"`python benchmarks/memory_startup.py --repeats {args.repeats}` — fresh processes, "
             f"{os.cpu_count()} cores, model and cost tables cached; start-up: `tierspec generate` of 8 tokens "
             f"(median of {args.repeats}, wall seconds); peak RSS: the same of 128 tokens (median, MiB).",
             "",
             "| run | start-up s (8 tokens) | range | peak RSS MiB (128 tokens) | vs ar float32 |",
             "|---|---|---|---|---|"]
    for label in ROWS:
        s, p = starts[label], statistics.median(peaks[label])
        lines.append(f"| {label} | {statistics.median(s):.2f} | {min(s):.2f}–{max(s):.2f} | {p:.0f} | {p / base:.2f} |")
    table = "\n".join(lines)
    print(table)
    if args.out:
        from tierspec.util import atomic_write_text

        atomic_write_text(args.out, table + "\n")


if __name__ == "__main__":
    main()
