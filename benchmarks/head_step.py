"""What a draft-head step costs right after a target pass, as the hybrid and `eagle` run it: the
shipped head of the default model, drafting on the pass engine beside its GGUF target.

    python benchmarks/head_step.py [--rounds 200]

Each round runs a one-token pass of the target over a cached prompt of 200 tokens (its weights'
stream leaves the caches cold, as in a generation), rolls it back, then one self-fed head step
(`HeadRunner.step`: W_fc, the head's layer, its vocabulary's logits) after a 64-position catch-up,
and rolls that back. The engine's calls inside the step (`_qengine.run_stack`, `matmul`,
`dequant_rows`, `rms_norm`) are timed by wrapping them; the rest of the step is its Python and torch
work. Prints the medians (ms) of the pass, the step, the step's engine calls and its rest, and the
step's share of the pass (what the cost-aware policies charge a head step, as
`costs.measure_draft_step` measures it). To compare checkouts, alternate whole runs:
`PYTHONPATH=<folder> python benchmarks/head_step.py` (one engine copy a process).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from loop_time import Probe  # noqa: E402  (exclusive seconds of wrapped calls)

ENGINE_CALLS = ("run_stack", "matmul", "dequant_rows", "rms_norm")
PROMPT, CATCH_UP = 200, 64


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--out", type=Path, default=Path("results/head_step.json"))
    args = parser.parse_args()

    import tierspec
    from tierspec import _qengine
    from tierspec.cached_model import CachedModel
    from tierspec.costs import few_row_threads
    from tierspec.engine import threads_for
    from tierspec.heads.draft import HeadRunner, HeadStep
    from tierspec.methods import MethodOptions, draft_head_for
    from tierspec.util import atomic_write_text

    clock = Probe()
    for call in ENGINE_CALLS:
        clock.wrap(_qengine, call, "engine")
    target = tierspec.load_model("smollm2-135m", dtype="auto")
    few_row_threads(target)  # the threads a generation's few-row products run on, as the decode loop settles them
    head = draft_head_for(target, MethodOptions())
    if head.engine is None:
        raise SystemExit("the head does not draft on the engine here: nothing to time")
    config = head.config
    generator = torch.Generator().manual_seed(0)
    times = {"pass": [], "step": [], "engine": []}
    with threads_for(target.model), torch.inference_mode():
        runner = CachedModel(target.model)
        runner.forward(torch.arange(PROMPT) + 200)
        drafter = HeadRunner(head)
        features = torch.randn(CATCH_UP, config.feature_width, generator=generator)
        last = drafter.extend(features, torch.arange(CATCH_UP) * 7 % config.vocab_size, from_target=True)[-1:]
        token = torch.tensor([11])
        for _ in range(args.rounds):
            started = time.perf_counter()
            runner.forward(token, logits_for=1)
            times["pass"].append(time.perf_counter() - started)
            runner.rollback(PROMPT)
            clock.totals.clear()
            started = time.perf_counter()
            drafter.step(HeadStep(drafter, last, token))
            times["step"].append(time.perf_counter() - started)
            times["engine"].append(clock.totals["engine"])
            drafter.rollback(CATCH_UP)
    skip = min(10, args.rounds // 10)  # the first rounds warm the allocator and the code
    medians = {name: 1e3 * statistics.median(values[skip:]) for name, values in times.items()}
    rest = 1e3 * statistics.median([s - e for s, e in zip(times["step"][skip:], times["engine"][skip:])])
    row = {"pass_ms": round(medians["pass"], 3), "step_ms": round(medians["step"], 3),
           "step_engine_ms": round(medians["engine"], 3), "step_rest_ms": round(rest, 3),
           "step_share_of_pass": round(medians["step"] / medians["pass"], 3)}
    table = ["| pass | head step | its engine calls | its rest | step / pass |", "|---|---|---|---|---|",
             f"| {row['pass_ms']:.3f} | {row['step_ms']:.3f} | {row['step_engine_ms']:.3f} | {row['step_rest_ms']:.3f} | "
             f"{row['step_share_of_pass']:.3f} |"]
    print(f"`python benchmarks/head_step.py {' '.join(sys.argv[1:])}` — ms, medians of {args.rounds - skip} rounds:\n")
    print("\n".join(table))
    atomic_write_text(args.out, json.dumps({"row": row, "table": "\n".join(table)}, indent=2))


if __name__ == "__main__":
    main()
