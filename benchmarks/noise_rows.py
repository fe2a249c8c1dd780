"""What a sampled row's keyed draw costs on each noise loop (csrc/noise/keyed_noise.c): plain, AVX2 and
AVX-512, on the default model's own logits, right after the pass that made them and again warm.

    python benchmarks/noise_rows.py [--rows 1,4,12] [--repeats 20] [--out results/noise_rows/noise_rows.json]

For each row count R, a pass of the default model over R prompt tokens (the engine, as a generation runs
it) leaves R rows of logits [R, 49,152]; each loop the CPU runs then draws every row's token under its
own key (``sampling.keyed_tokens``, one thread), timed once right after the pass ("after a pass": the
caches as the decode loop finds them) and once more on the same rows ("warm"). Medians over
``--repeats`` passes, µs per row; the loops' tokens are compared (they must be equal: every loop is
the same arithmetic). Not shown: the keys' making and the Python around the call (benchmarks/loop_time.py
times the whole loop)."""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from tierspec import _keyed_noise, load_model, sampling
from tierspec.data import load_prompts
from tierspec.engine import torch_ops_on_one_thread
from tierspec.prompting import encode_prompt
from tierspec.util import atomic_write_text

LOOP_NAMES = ("plain", "avx2", "avx512")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,4,12")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--out", type=Path, default=Path("results/noise_rows/noise_rows.json"))
    args = parser.parse_args()
    target = load_model("smollm2-135m", dtype="auto")
    prompt = encode_prompt(target, load_prompts("mt_bench")[0].text)
    loops = list(range(_keyed_noise.best_loop() + 1))
    sampling.share_rows_among(1)
    table, rows_out = [], []
    with torch_ops_on_one_thread(), torch.inference_mode():
        for count in (int(r) for r in args.rows.split(",")):
            times = {(loop, when): [] for loop in loops for when in ("after a pass", "warm")}
            for repeat in range(args.repeats):
                keys = [(1 + repeat) * 1_000_003 + row for row in range(count)]
                tokens = {}
                for loop in loops:
                    out = target.model(prompt[:count].view(1, -1))
                    logits = (out.logits if hasattr(out, "logits") else out[0])[0].float().contiguous()
                    sampling._NOISE_LOOP = loop
                    for when in ("after a pass", "warm"):
                        began = time.perf_counter()
                        tokens[loop] = sampling.keyed_tokens(logits, keys)
                        times[loop, when].append((time.perf_counter() - began) / count * 1e6)
                if len({tuple(t) for t in tokens.values()}) != 1:
                    raise SystemExit(f"the loops drew different tokens for {count} rows: {tokens}")
            for loop in loops:
                row = {"rows": count, "loop": LOOP_NAMES[loop]}
                row.update({f"{when} µs/row": round(statistics.median(times[loop, when]), 1)
                            for when in ("after a pass", "warm")})
                rows_out.append(row)
                table.append(f"| {count} | {LOOP_NAMES[loop]} | {row['after a pass µs/row']} | {row['warm µs/row']} |")
    text = "\n".join([f"`python benchmarks/noise_rows.py --rows {args.rows} --repeats {args.repeats}` "
                      f"(medians, µs per row; every loop the same tokens):", "",
                      "| rows | loop | after a pass | warm |", "|---|---|---|---|", *table])
    print(text)
    atomic_write_text(args.out, json.dumps({"table": text, "rows": rows_out}, indent=2))


if __name__ == "__main__":
    main()
