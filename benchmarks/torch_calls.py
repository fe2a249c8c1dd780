"""How many torch operators a decode cycle makes from Python, where, and what one costs right after a
pass: each runs cold once the engine's weight stream has evicted the caches.

    python benchmarks/torch_calls.py [--method hybrid] [--temperature 0] [--prompts 4] [--tokens 64] [--rounds 60]

Calls: one generation at a time (a batch of one, as `tierspec generate` runs) over ``--prompts``
MT-Bench prompts, every torch function and tensor method called from Python counted by a
``TorchFunctionMode`` (attribute reads such as ``shape``, ``dtype``, ``data_ptr`` left out: they run no
operator), by the tierspec line that called it; printed per decode cycle (the generations' starts, their
caches' first allocations, spread over their cycles), the sites of 0.3 a cycle and more listed. Cold costs: each of a few operators alone, right after a one-row pass of the default
model (medians of ``--rounds``), beside an empty call and a Python list's slice. To compare
checkouts, run each: ``PYTHONPATH=<folder> python benchmarks/torch_calls.py``.
"""

from __future__ import annotations

import argparse
import array
import json
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode

#: Tensor attributes and queries that run no operator (counted by the mode all the same).
NOT_OPERATORS = {"__get__", "dtype", "shape", "device", "is_contiguous", "data_ptr", "dim", "size", "numel",
                 "element_size", "stride", "storage_offset", "__len__", "is_floating_point", "untyped_storage",
                 "requires_grad", "_version", "names", "grad_fn", "layout"}


class CallSites(TorchFunctionMode):
    """Counts torch calls by (name, the tierspec line that made them)."""

    def __init__(self):
        super().__init__()
        self.sites: Counter = Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", str(func))
        if name not in NOT_OPERATORS:
            frame = sys._getframe(1)
            while frame is not None and "tierspec/" not in frame.f_code.co_filename:
                frame = frame.f_back
            where = "?" if frame is None else \
                f"{frame.f_code.co_filename.split('tierspec/')[-1]}:{frame.f_lineno} ({frame.f_code.co_name})"
            self.sites[(name, where)] += 1
        return func(*args, **(kwargs or {}))


def count_calls(target, method: str, temperature: float, prompts: int, tokens: int) -> tuple[int, Counter]:
    from tierspec.batch import BatchDecoder
    from tierspec.data import load_prompts
    from tierspec.decode import DecodeConfig
    from tierspec.methods import MethodOptions, build_method
    from tierspec.prompting import encode_prompt, eos_ids
    from tierspec.sampling import SamplingConfig

    texts = [p.text for p in load_prompts("mt_bench")]
    ids = [encode_prompt(target, texts[i % len(texts)]) for i in range(prompts)]
    config = DecodeConfig(max_new_tokens=tokens, sampling=SamplingConfig(temperature), eos_token_ids=eos_ids(target))
    chosen = build_method(method, target, None, MethodOptions())
    BatchDecoder(target, max_batch=1).run_all(ids[:1], chosen, config)  # measurements and first allocations
    batch, counter = BatchDecoder(target, max_batch=1), CallSites()
    with counter:
        batch.run_all(ids, chosen, config)
    return batch.times.cycles, counter.sites


def cold_costs(target, rounds: int) -> dict[str, float]:
    """µs of each operator alone right after a one-row pass (medians)."""
    from tierspec.cached_model import CachedModel
    from tierspec.engine import threads_for

    ints, floats, items = torch.zeros(600, dtype=torch.long), torch.randn(4, 576), list(range(600))
    operators = {
        "nothing (a Python call)": lambda: None,
        "a Python list's slice": lambda: items[10:20],
        "array.array of 3 ints": lambda: array.array("q", [1, 2, 3]),
        "a tensor's slice": lambda: ints[10:20],
        "a slice's tolist": lambda: ints[10:20].tolist(),
        "torch.tensor of 3 ints": lambda: torch.tensor([1, 2, 3], dtype=torch.int64),
        "torch.empty": lambda: torch.empty(3, 576),
        "torch.cat of two rows": lambda: torch.cat((floats[0:1], floats[1:2])),
        "two elements written": lambda: ints.__setitem__(slice(10, 12), torch.tensor([1, 2])),
    }
    times = {name: [] for name in operators}
    runner = CachedModel(target.model)
    token = torch.tensor([11])
    with threads_for(target.model), torch.inference_mode():
        runner.forward(torch.arange(100) + 200)
        for _ in range(rounds):
            for name, operator in operators.items():
                runner.forward(token, logits_for=1)
                runner.rollback(100)
                started = time.perf_counter()
                operator()
                times[name].append(time.perf_counter() - started)
    skip = min(5, rounds // 10)
    return {name: round(1e6 * statistics.median(values[skip:]), 1) for name, values in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--method", default="hybrid")
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=60)
    parser.add_argument("--out", type=Path, default=Path("results/torch_calls.json"))
    args = parser.parse_args()

    import tierspec
    from tierspec.costs import few_row_threads
    from tierspec.util import atomic_write_text

    target = tierspec.load_model("smollm2-135m", dtype="auto")
    few_row_threads(target)  # the threads a generation's few-row products run on, as the decode loop settles them
    cycles, sites = count_calls(target, args.method, args.temperature, args.prompts, args.tokens)
    costs = cold_costs(target, args.rounds)
    per_cycle = sum(sites.values()) / cycles
    listed = [(count / cycles, name, where) for (name, where), count in sites.most_common() if count / cycles >= 0.3]
    lines = [f"`python benchmarks/torch_calls.py {' '.join(sys.argv[1:])}`: {per_cycle:.1f} torch calls a decode cycle "
             f"of `{args.method}` at temperature {args.temperature:g} ({cycles} cycles), those of 0.3 a cycle and more:\n",
             "| a cycle | call | from |", "|---|---|---|"]
    lines += [f"| {share:.2f} | `{name}` | `{where}` |" for share, name, where in listed]
    lines += ["", f"Right after a one-row pass, µs (medians of {args.rounds}):\n", "| operator | µs |", "|---|---|"]
    lines += [f"| {name} | {micros:.1f} |" for name, micros in costs.items()]
    print("\n".join(lines))
    atomic_write_text(args.out, json.dumps({"calls_per_cycle": round(per_cycle, 1), "cycles": cycles,
                                            "sites": [{"per_cycle": round(share, 3), "call": name, "from": where}
                                                      for share, name, where in listed],
                                            "cold_us": costs}, indent=2))


if __name__ == "__main__":
    main()
