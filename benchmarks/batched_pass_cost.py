"""What a batched pass pays beyond the same rows of one sequence: the pass engine's cost of B sequences'
new rows in one pass against one sequence's pass of as many rows, by cached context.

    python benchmarks/batched_pass_cost.py [--contexts 20,300,900] [--sequences 8] [--rows 1,2]
                                           [--repeats 30] [--out results/batched_pass_cost.json]

For each context length C and rows per sequence r: ``--sequences`` B caches of the default model
(``--dtype auto``), sequence i holding C + 10 i prompt tokens, then, alternating within each repeat,
(a) one batched pass of r new tokens for each of the B sequences (``cached_model.batched_pass``) and
(b) one pass of B·r new tokens on the first sequence alone (``CachedModel.forward``); every cache is
rolled back after each pass. Each pass is split into the layer stack (``engine.run_stack``), the LM
head's product and the rest (Python, the embedding, the final norm). Reported: the fastest and the
median of ``--repeats``.

Both passes multiply the same number of rows by the same weights, so what (a) pays beyond (b) is what
the batch adds: each sequence's rows attend to their own cache, B caches read where (b) reads one
(the products read the weights once for all rows either way), plus each sequence's Python
bookkeeping. A difference that grows with C is the attention's reading of the caches.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from tierspec import engine, load_model
from tierspec.cached_model import BatchItem, CachedModel, batched_pass
from tierspec.util import atomic_write_text


class PartTimer:
    """Seconds spent in ``engine.run_stack`` and in the LM head's forward, added up while installed."""

    def __init__(self, model):
        self.seconds = {"stack": 0.0, "head": 0.0}
        self._model, self._run_stack = model, engine.run_stack

    def _timed(self, part: str, function):
        def timed(*args, **kwargs):
            began = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                self.seconds[part] += time.perf_counter() - began
        return timed

    def __enter__(self):
        engine.run_stack = self._timed("stack", self._run_stack)
        self._model.lm_head.forward = self._timed("head", self._model.lm_head.forward)
        return self

    def __exit__(self, *exc):
        engine.run_stack = self._run_stack
        del self._model.lm_head.forward  # back to the class's method

    def reset(self) -> None:
        self.seconds = {"stack": 0.0, "head": 0.0}


def measure(model, context: int, sequences: int, rows: int, repeats: int) -> dict:
    runners = [CachedModel(model) for _ in range(sequences)]
    lengths = [context + 10 * i for i in range(sequences)]
    generator = torch.Generator().manual_seed(context)
    for runner, length in zip(runners, lengths):
        runner.reserve(length + sequences * rows + 1)
        runner.forward(torch.randint(0, 1000, (length,), generator=generator), logits_for=1)
    new = torch.arange(5, 5 + rows)
    alone = torch.arange(5, 5 + sequences * rows)
    samples: dict[str, dict[str, list[float]]] = {kind: {"total": [], "stack": [], "head": []} for kind in ("batched", "one")}
    with PartTimer(model) as timer:
        for repeat in range(repeats + 2):  # the first two warm the caches and are dropped
            for kind in ("batched", "one") if repeat % 2 == 0 else ("one", "batched"):
                timer.reset()
                began = time.perf_counter()
                if kind == "batched":
                    batched_pass(model, [BatchItem(runner, new) for runner in runners], None)
                else:
                    runners[0].forward(alone, logits_for=sequences * rows)
                total = time.perf_counter() - began
                for runner, length in zip(runners, lengths):
                    runner.rollback(length)
                if repeat >= 2:
                    samples[kind]["total"].append(total)
                    samples[kind]["stack"].append(timer.seconds["stack"])
                    samples[kind]["head"].append(timer.seconds["head"])
    row = {"context": context, "sequences": sequences, "rows_each": rows}
    for kind, parts in samples.items():
        for part, values in parts.items():
            row[f"{kind}_{part}_min_ms"] = round(1e3 * min(values), 2)
            row[f"{kind}_{part}_median_ms"] = round(1e3 * statistics.median(values), 2)
        row[f"{kind}_rest_median_ms"] = round(1e3 * statistics.median(
            t - s - h for t, s, h in zip(parts["total"], parts["stack"], parts["head"])), 2)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", default="20,300,900")
    parser.add_argument("--sequences", type=int, default=8)
    parser.add_argument("--rows", default="1,2", help="new rows per sequence, comma-separated")
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--out", type=Path, default=Path("results/batched_pass_cost.json"))
    args = parser.parse_args()
    if args.sequences < 2 or args.repeats < 1:
        parser.error("--sequences must be >= 2 and --repeats >= 1")
    target = load_model("smollm2-135m", dtype="auto")
    results = []
    with torch.inference_mode(), engine.torch_ops_on_one_thread():
        for context in [int(c) for c in args.contexts.split(",")]:
            for rows in [int(r) for r in args.rows.split(",")]:
                results.append(measure(target.model, context, args.sequences, rows, args.repeats))
                print(json.dumps(results[-1]), flush=True)
    lines = [f"`python benchmarks/batched_pass_cost.py --contexts {args.contexts} --sequences {args.sequences} --rows "
             f"{args.rows} --repeats {args.repeats}`, {torch.get_num_threads()} threads, ms (fastest / median of "
             f"{args.repeats}):", "",
             "| cached context | sequences × rows | batched pass | one sequence, as many rows | batch / one | "
             "stack: batched / one | LM head: batched / one | rest (median): batched / one |",
             "|---|---|---|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r['context']} | {r['sequences']} × {r['rows_each']} | {r['batched_total_min_ms']} / "
                     f"{r['batched_total_median_ms']} | {r['one_total_min_ms']} / {r['one_total_median_ms']} | "
                     f"{r['batched_total_min_ms'] / r['one_total_min_ms']:.2f}× | {r['batched_stack_min_ms']} / "
                     f"{r['one_stack_min_ms']} | {r['batched_head_min_ms']} / {r['one_head_min_ms']} | "
                     f"{r['batched_rest_median_ms']} / {r['one_rest_median_ms']} |")
    table = "\n".join(lines)
    print(table)
    atomic_write_text(args.out, json.dumps({"rows": results, "table": table}, indent=2))


if __name__ == "__main__":
    main()
