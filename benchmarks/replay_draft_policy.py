"""Replay a draft-length policy over recorded greedy outputs, without running the model.

    python benchmarks/replay_draft_policy.py --records results/spec_bench [--policies adaptive,fixed3,oracle]

Greedy lossless decoding emits exactly the target's greedy text whatever the drafter does, so
given `ar`'s recorded outputs the n-gram drafter's proposals and how many of them the target
accepts are determined: the proposal is a lookup over prompt + output so far, the accepted
prefix is its longest common prefix with the recorded continuation. Only time has to be
modelled: each cycle costs the measured forward-cost table's price for k + 1 tokens (padded
to the cheapest size, as the decode loop pads) plus a fixed per-cycle overhead. The predicted
speed-up is ar's modelled time over the policy's, per category, decode only (prefill is the
same for every method and left out, so the predictions overstate measured speed-ups a little).

This is for comparing policies on principle (which one wastes fewer passes), not a
substitute for a timed run: the benchmark is the judge.
"""

from __future__ import annotations

import argparse
from collections import defaultdict
from pathlib import Path

import numpy as np
import torch
from tierspec.policies import CostAware, CycleOutcome
from tierspec.prompting import encode_prompt
from tierspec.proposal import Proposal, Verdict
from tierspec.bench.runner import read_records
from tierspec.costs import forward_costs
from tierspec.data import load_prompts
from tierspec.drafters import NgramDrafter
from tierspec.models import load_model


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    mismatch = np.flatnonzero(a[:n] != b[:n])
    return int(mismatch[0]) if mismatch.size else n


class Fixed:
    """Draft min(k, found) tokens every cycle (pld with a fixed k)."""

    def __init__(self, k: int, ngram_size: int = 3):
        self.k, self.ngram = k, NgramDrafter(ngram_size)

    def start(self, prompt_ids):
        pass

    def propose(self, context: np.ndarray, cap: int, truth: np.ndarray) -> np.ndarray:
        return self.ngram.lookup(context, min(self.k, cap))[0]

    def observe(self, accepted, next_token):
        pass


class Oracle:
    """Drafts exactly the tokens that will be accepted (an upper bound for any length policy)."""

    def __init__(self, ngram_size: int = 3):
        self.ngram = NgramDrafter(ngram_size)

    def start(self, prompt_ids):
        pass

    def propose(self, context, cap, truth):
        found = self.ngram.lookup(context, cap)[0]
        return found[: common_prefix(found, truth)]

    def observe(self, accepted, next_token):
        pass


class Adaptive:
    """tierspec's cost-aware draft-length policy (``policies.CostAware``) over n-gram lookup,
    driven with a fixed cost function instead of the measured table's cost model."""

    def __init__(self, cost, max_draft: int = 10, ngram_size: int = 3):
        self.ngram = NgramDrafter(ngram_size)
        self.policy = CostAware(max_draft, cost=lambda k, source="": cost(k))
        self.drafted = self.verified = None

    def start(self, prompt_ids):
        self.policy.start()

    def propose(self, context, cap, truth):
        found, size = self.ngram.lookup(context, min(cap, self.policy.max_draft))
        self.drafted = (Proposal.chain(torch.from_numpy(found.copy()), match_sizes=[size] * len(found), source="ngram")
                        if len(found) else Proposal.empty(source="ngram"))
        self.verified = self.drafted.prefix(self.policy.trim(self.drafted))
        return found[: len(self.verified)]

    def observe(self, accepted, next_token):
        verdict = Verdict.chain(accepted, next_token, [])
        self.policy.observe(CycleOutcome(self.drafted, self.verified, verdict))


def replay(policy, prompt_ids: np.ndarray, output: np.ndarray, cost) -> tuple[float, int, int]:
    """(modelled seconds, cycles, drafted) for decoding ``output`` after ``prompt_ids``."""
    policy.start(prompt_ids)
    sequence = np.concatenate([prompt_ids, output])
    position, seconds, cycles, drafted_total = 0, 0.0, 0, 0
    while position < len(output):
        context = sequence[: len(prompt_ids) + position]
        remaining = len(output) - position
        truth = output[position:]
        draft = policy.propose(context, remaining - 1, truth)
        accepted = common_prefix(draft, truth)
        spent = cost(len(draft))
        seconds += spent
        cycles += 1
        drafted_total += len(draft)
        policy.observe(accepted, int(truth[accepted]) if accepted < len(truth) else -1)
        position += accepted + 1
    return seconds, cycles, drafted_total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", nargs="+", default=["results/spec_bench"])
    parser.add_argument("--policies", default="ar,fixed2,fixed3,fixed5,adaptive,oracle")
    parser.add_argument("--overhead-ms", type=float, default=3.0, help="per-cycle cost outside the verify pass")
    parser.add_argument("--dataset", default="spec_bench")
    args = parser.parse_args()

    target = load_model()
    table = forward_costs(target, max_tokens=11)
    overhead = args.overhead_ms / 1000

    def cost(k: int) -> float:
        return table.cost(k + 1) + overhead

    texts = {p.id: p for p in load_prompts(args.dataset)}
    runs = []
    for folder in args.records:
        for record in read_records(Path(folder) / "records.jsonl"):
            if record["method"] == "ar":
                prompt = texts[record["prompt_id"]]
                runs.append((prompt.category, encode_prompt(target, prompt.text).numpy(), np.array(record["token_ids"])))
    factories = {
        "fixed2": lambda: Fixed(2), "fixed3": lambda: Fixed(3), "fixed4": lambda: Fixed(4),
        "fixed5": lambda: Fixed(5), "fixed10": lambda: Fixed(10), "oracle": Oracle,
        "adaptive": lambda: Adaptive(cost),
    }
    names = [n for n in args.policies.split(",") if n != "ar"]
    time = defaultdict(float)
    shared = {name: factories[name]() for name in names}  # one instance across prompts, like a bench run
    for category, prompt_ids, output in runs:
        time[("ar", category)] += cost(0) * len(output)
        for name in names:
            seconds, _, _ = replay(shared[name], prompt_ids, output, cost)
            time[(name, category)] += seconds
    categories = sorted({c for c, _, _ in runs})
    print(f"{len(runs)} outputs; predicted decode speed-up vs ar (overhead {args.overhead_ms} ms/cycle)")
    print("policy".ljust(12) + "overall".rjust(9) + "".join(c[:8].rjust(10) for c in categories))
    for name in names:
        ar_total = sum(time[("ar", c)] for c in categories)
        overall = ar_total / sum(time[(name, c)] for c in categories)
        row = "".join(f"{time[('ar', c)] / time[(name, c)]:10.2f}" for c in categories)
        print(name.ljust(12) + f"{overall:9.2f}" + row)


if __name__ == "__main__":
    main()
