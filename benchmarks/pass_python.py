"""What a pass costs outside the engine's own calls, by how it is run: a sequence's own pass
(``CachedModel.forward``), the pass backend's run of one request (``passes.EnginePasses``: a
batched pass of one since 2026-12-05) and of B sequences' requests at once.

    python benchmarks/pass_python.py [--batches 1,8] [--rows 1,3] [--rounds 150] [--before FOLDER]

The default model is loaded as the CLI loads it; each sequence caches a prompt of 100 + 7·i tokens,
then every round runs each path's pass of ``--rows`` new tokens a sequence and rolls the caches
back, the paths taking turns within the round and each path's versions one after the other (so a
stall of the shared machine falls on all of them). The engine's calls (``_qengine.run_stack``, ``matmul``, ``dequant_rows``, ``rms_norm``) are
timed by wrapping them; what a pass takes beyond them is its Python and torch work, most of it the
first touches of code and data after the engine's weight stream evicted them (``cold_caches.py``).
Prints the medians (ms) of the whole pass, its engine calls and the rest. ``--before FOLDER``: the
same paths of another checkout's ``tierspec`` (its compiled extensions beside it), imported beside
this one, in the same rounds (``loop_time.py``'s ``--before``). Two copies of the engine then keep
two thread pools, and a pass that follows the other copy's waits for its own pool's worker: read
"the rest" of such a run, not its engine times (or alternate whole runs of each checkout, as
``PYTHONPATH=<folder> python benchmarks/pass_python.py``).
"""

from __future__ import annotations

import argparse
import importlib
import json
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from loop_time import Probe, import_before  # noqa: E402  (exclusive seconds of wrapped calls; another checkout)

ENGINE_CALLS = ("run_stack", "matmul", "dequant_rows", "rms_norm")


def paths(package, batches: list[int], rows: int):
    """(label, run one pass, roll back) for each path of one checkout's ``package``."""
    cached_model = importlib.import_module(f"{package.__name__}.cached_model")
    passes = importlib.import_module(f"{package.__name__}.passes")
    target = package.load_model("smollm2-135m", dtype="auto")
    importlib.import_module(f"{package.__name__}.costs").few_row_threads(target)  # as the decode loop settles them
    model = target.model
    backend = passes.pass_backend(model)
    largest = max(batches)
    runners = [cached_model.CachedModel(model) for _ in range(largest + 1)]
    with torch.inference_mode():
        for i, runner in enumerate(runners):
            runner.forward(torch.arange(100 + 7 * i) + 200)
    tokens = torch.arange(rows) + 300
    found = []

    def rollback(group):
        def undo():
            for runner in group:
                runner.rollback(runner.length - rows)
        return undo

    solo = runners[largest]
    found.append(("own pass", lambda: solo.forward(tokens, logits_for=rows), rollback([solo])))
    for size in batches:
        group = runners[:size]
        requests = [passes.PassRequest(runner, tokens, rows) for runner in group]
        found.append((f"backend, {size} sequence{'s' if size > 1 else ''}", lambda r=requests: backend.run(r),
                      rollback(group)))
    return target, found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--rows", default="1,3", help="new tokens a sequence per pass")
    parser.add_argument("--rounds", type=int, default=150)
    parser.add_argument("--before", type=Path, default=None)
    parser.add_argument("--out", type=Path, default=Path("results/pass_python.json"))
    args = parser.parse_args()

    import tierspec
    from tierspec.util import atomic_write_text

    versions = [("this", tierspec)]
    if args.before is not None:
        versions.insert(0, ("before", import_before(args.before)))
    batches = [int(b) for b in args.batches.split(",")]
    results = []
    for rows in [int(r) for r in args.rows.split(",")]:
        by_version = []
        for label, package in versions:
            clock, extension = Probe(), importlib.import_module(f"{package.__name__}._qengine")
            for call in ENGINE_CALLS:
                clock.wrap(extension, call, "engine")
            target, found = paths(package, batches, rows)
            by_version.append([(label, name, clock, run, undo) for name, run, undo in found])
        runs = [run for same_path in zip(*by_version) for run in same_path]  # each path's versions one after another
        threads = importlib.import_module("tierspec.engine").threads_for(target.model)
        totals, engine = defaultdict(list), defaultdict(list)
        with threads, torch.inference_mode():
            for _ in range(args.rounds):
                for label, name, clock, run, undo in runs:
                    clock.totals.clear()
                    started = time.perf_counter()
                    run()
                    totals[(label, name)].append(time.perf_counter() - started)
                    engine[(label, name)].append(clock.totals["engine"])
                    undo()
        for key in sorted(totals, key=lambda k: (k[0] != "before", k)):
            whole, calls = statistics.median(totals[key]), statistics.median(engine[key])
            rest = statistics.median([t - e for t, e in zip(totals[key], engine[key])])
            results.append({"version": key[0], "path": key[1], "rows": rows, "pass_ms": round(1e3 * whole, 3),
                            "engine_ms": round(1e3 * calls, 3), "rest_ms": round(1e3 * rest, 3)})
    table = ["| version | path | rows a sequence | pass | engine calls | the rest |", "|---|---|---|---|---|---|"]
    table += [f"| {r['version']} | {r['path']} | {r['rows']} | {r['pass_ms']:.3f} | {r['engine_ms']:.3f} | "
              f"{r['rest_ms']:.3f} |" for r in results]
    print(f"`python benchmarks/pass_python.py {' '.join(sys.argv[1:])}` — ms, medians of {args.rounds} rounds:\n")
    print("\n".join(table))
    atomic_write_text(args.out, json.dumps({"rows": results, "table": "\n".join(table)}, indent=2))


if __name__ == "__main__":
    main()
