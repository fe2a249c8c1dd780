"""Compare draft-length policies for the draft head on prompts written for this probe (never
the shared evaluation sets): the cost-aware policy as shipped, its previous stopping bound
(continuation scored at the last drafted token's acceptance), and fixed lengths 1-4.

One run, interleaved per prompt (every variant of a prompt runs back to back), greedy, so each
ratio compares runs that met the same machine load. Writes results/policy_probe.json.

    python benchmarks/policy_probe.py [--tokens 128]
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path

import torch

from tierspec import load_model
from tierspec.decode import DecodeConfig, DecodeRun
from tierspec.methods import build_method
from tierspec.policies import CostAware, FixedLength
from tierspec.prompting import encode_prompt, eos_ids
from tierspec.util import atomic_write_text

PROMPTS = [
    "Explain how a refrigerator keeps food cold, step by step.",
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "A shop sells pencils at 3 for 45 cents. How much do 14 pencils cost? Show your work.",
    "What are the main differences between a virus and a bacterium?",
    "Translate into French: The train leaves at seven, so we should have breakfast early.",
    "Give me five tips for keeping a houseplant alive during winter.",
    "Summarise the causes of the French Revolution in one paragraph.",
    "Write a Python function that returns the n-th Fibonacci number iteratively, with a docstring.",
    "Why do cats purr? Answer in a few sentences.",
    "Plan a three-day trip to Rome for someone who loves history and food.",
    "If a car travels 150 km in 2.5 hours, what is its average speed? Explain.",
    "Describe the water cycle to a ten-year-old.",
]


class LastTokenBound(CostAware):
    """The previous stopping bound: further tokens scored at the last drafted token's estimate."""

    def unseen_later_acceptance(self, source: str, fallback: float) -> float:
        return fallback


def variants(target):
    yield "ar", lambda: build_method("ar", target)
    base = build_method("eagle", target)
    table = base.policy.pass_costs
    yield "cost-aware", lambda: replace(base, policy=CostAware(10, forward_costs=table))
    yield "cost-aware-last-bound", lambda: replace(base, policy=LastTokenBound(10, forward_costs=table))
    for k in (1, 2, 3, 4):
        yield f"fixed-{k}", lambda k=k: replace(base, policy=FixedLength(k, table))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--out", type=Path, default=Path("results/policy_probe.json"))
    args = parser.parse_args()
    torch.set_num_threads(2)
    target = load_model("smollm2-135m")
    made = dict(variants(target))
    methods = {name: make() for name, make in made.items()}  # one policy each, learning across prompts
    totals = {name: {"seconds": 0.0, "emitted": 0, "cycles": 0, "drafted": 0, "accepted": 0} for name in methods}
    reference: dict[int, list[int]] = {}
    for index, prompt in enumerate(PROMPTS):
        ids = encode_prompt(target, prompt, True)
        config = DecodeConfig(max_new_tokens=args.tokens, eos_token_ids=eos_ids(target))
        for name, method in methods.items():
            if isinstance(method.policy, CostAware):
                method.policy.start()
            run = DecodeRun(target, method, ids, config).finish()
            tokens, stats, seconds = run.token_ids, run.stats, run.stats.wall_seconds
            if name == "ar":
                reference[index] = tokens
            elif index in reference and tokens != reference[index]:
                raise AssertionError(f"{name} changed the greedy output of prompt {index}")
            total = totals[name]
            total["seconds"] += seconds
            total["emitted"] += len(tokens)
            total["cycles"] += stats.cycles
            total["drafted"] += stats.drafted
            total["accepted"] += stats.accepted
        print(f"prompt {index + 1}/{len(PROMPTS)} done", flush=True)
    ar_rate = totals["ar"]["emitted"] / totals["ar"]["seconds"]
    rows = {}
    for name, total in totals.items():
        rate = total["emitted"] / total["seconds"]
        rows[name] = {"tokens_per_s": round(rate, 2), "vs_ar": round(rate / ar_rate, 3),
                      "tau": round(total["emitted"] / total["cycles"], 3),
                      "drafted_per_cycle": round(total["drafted"] / total["cycles"], 3),
                      "acceptance": round(total["accepted"] / max(total["drafted"], 1), 3)}
        print(f"{name:24s} {rows[name]}")
    atomic_write_text(args.out, json.dumps({"tokens": args.tokens, "prompts": len(PROMPTS), "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
