"""The decode loop's own time per cycle, step by step, before and after a change, in one process.

    python benchmarks/loop_time.py --before /tmp/loop_base [--methods ar,hybrid] [--prompts 4]
                                   [--tokens 128] [--repeats 2] [--passes] [--speed hybrid,hybrid-tree]

``--before`` names a folder holding another checkout's ``tierspec`` package (for instance
``git archive <commit> tierspec | tar -x -C /tmp/loop_base``, with the compiled engine copied
beside it); it is imported under the name ``tierspec_before`` next to this checkout's ``tierspec``,
so both run on the same machine state, interleaved prompt by prompt (the order alternates), on
their own copy of the default model. Both use one pass-cost table (this checkout's, measured
once and cached), so both choose the same draft lengths and emit the same tokens (checked).

What is timed, per cycle, greedy (the median over the runs): each step's own time with the model
passes taken out —

    noise     the block's keyed noise (``Noise.block``; nothing in greedy mode)
    propose   the drafter (its model steps — the draft head's — are not the loop's)
    trim      the policy's cut of the proposal
    verify    the verifier pass and the rule (the target's forward is not the loop's)
    commit    the commit (cache rollback, the committed tokens, the drafter's rollback)
    observe   the policy learning from the verdict
    stats     the generation's totals (``GenerationStats.add``)
    other     the rest of the cycle function (the request, the cycle's record)

by wrapping those functions on the method's objects and the loop's module (a probe: every wrapper
costs the same in both versions). ``loop`` is their sum: the cycle's wall time less the target's
passes and the draft head's steps. ``--passes`` also times a chain pass through each version's
verifier (k = 1 .. 16 drafts at a 256-token context, logits compared bitwise); ``--speed`` runs
whole generations of the given methods, interleaved, and reports tokens per second.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

STEPS = ("noise", "propose", "trim", "verify", "commit", "observe", "stats", "other")
MODEL = ("target pass", "draft head")


def import_before(folder: Path):
    """The ``tierspec`` package found in ``folder``, imported as ``tierspec_before``."""
    package = folder / "tierspec"
    spec = importlib.util.spec_from_file_location("tierspec_before", package / "__init__.py",
                                                  submodule_search_locations=[str(package)])
    module = importlib.util.module_from_spec(spec)
    sys.modules["tierspec_before"] = module
    spec.loader.exec_module(module)
    return module


def submodule(package, *names):
    """The first of ``names`` (dotted, under ``package``) that exists: the two versions lay out
    their modules differently."""
    for name in names:
        try:
            return importlib.import_module(f"{package.__name__}.{name}")
        except ImportError:
            continue
    raise ImportError(f"none of {names} in {package.__name__}")


class Clock:
    """Exclusive time per step: a wrapped call's time less the wrapped calls inside it."""

    def __init__(self):
        self.totals: dict[str, float] = defaultdict(float)
        self._stack: list[list] = []
        self.active = False

    def wrap(self, name: str, function):
        def timed(*args, **kwargs):
            if not self.active:
                return function(*args, **kwargs)
            started = time.perf_counter()
            self._stack.append([name, 0.0])
            try:
                return function(*args, **kwargs)
            finally:
                elapsed = time.perf_counter() - started
                _, inner = self._stack.pop()
                self.totals[name] += elapsed - inner
                if self._stack:
                    self._stack[-1][1] += elapsed

        timed.wrapped = function
        return timed


class Version:
    """One version of tierspec, its model and its probes."""

    def __init__(self, label: str, package, table_seconds: dict[int, float] | None, threads: int):
        self.label, self.package = label, package
        torch.set_num_threads(threads)
        self.target = package.load_model("smollm2-135m")
        self.decode = submodule(package, "decode")
        self.costs = submodule(package, "costs")
        self.data = submodule(package, "data")
        self.prompting = submodule(package, "prompting")
        self.methods = submodule(package, "methods")
        self.sampling = submodule(package, "sampling")
        self.cached_model = submodule(package, "cached_model")
        self.head = submodule(package, "heads.draft", "eagle.head")
        self.table_seconds = table_seconds
        self.clock = Clock()
        self._probe_classes()

    def _probe_classes(self) -> None:
        clock = self.clock
        for owner, attribute, name in ((self.cached_model.CachedModel, "forward", "target pass"),
                                       (self.head.HeadRunner, "extend", "draft head"),
                                       (self.head.HeadRunner, "logits", "draft head"),
                                       (self.sampling.Noise, "block", "noise"),
                                       (self.decode.GenerationStats, "add", "stats")):
            setattr(owner, attribute, clock.wrap(name, getattr(owner, attribute)))
        for attribute, name in (("_cycle", "other"), ("_commit", "commit")):
            setattr(self.decode, attribute, clock.wrap(name, getattr(self.decode, attribute)))
        if hasattr(self.decode, "_verdict"):  # this version: the loop runs the pass and hands the rule its scores
            self.decode._verdict = clock.wrap("verify", self.decode._verdict)

    def method(self, name: str):
        built = self.methods.build_method(name, self.target)
        if self.table_seconds is not None and hasattr(built.policy, "cost") and built.policy.cost.forward_costs:
            table = self.costs.ForwardCosts(dict(self.table_seconds))  # the same table in both versions
            built.policy.cost = type(built.policy.cost)(table, built.policy.cost.draft_fractions)
            if hasattr(built, "forward_costs"):
                built.forward_costs = table
        clock = self.clock
        built.drafter.propose = clock.wrap("propose", built.drafter.propose)
        built.policy.trim = clock.wrap("trim", built.policy.trim)
        built.policy.observe = clock.wrap("observe", built.policy.observe)
        if not hasattr(self.decode, "_verdict"):  # the earlier version: the rule ran the pass itself
            built.rule.verify = clock.wrap("verify", built.rule.verify)
        return built

    def run(self, method, prompt_ids: torch.Tensor, tokens: int) -> tuple[list[int], int, float, dict[str, float]]:
        """(tokens, cycles, seconds, per-step seconds) of one greedy generation."""
        config = self.decode.DecodeConfig(max_new_tokens=tokens, eos_token_ids=self.prompting.eos_ids(self.target))
        self.clock.totals.clear()
        self.clock.active = True
        try:
            run = self.decode.DecodeRun(self.target, method, prompt_ids, config).finish()
        finally:
            self.clock.active = False
        return run.token_ids, run.stats.cycles, run.stats.wall_seconds, dict(self.clock.totals)


def loop_rows(versions: list[Version], names: list[str], prompts: list, tokens: int, repeats: int) -> dict:
    """Per method and version: ms per cycle of each step, the median over the runs (prompts ×
    repeats; a median, since a shared machine stalls now and then)."""
    built = {(v.label, name): v.method(name) for v in versions for name in names}
    ids = {v.label: [v.prompting.encode_prompt(v.target, p.text) for p in prompts] for v in versions}
    for v in versions:  # warm-up: the first generation of a process pays one-off costs
        for name in names:
            v.run(built[(v.label, name)], ids[v.label][0], 8)
    runs = defaultdict(list)  # (version, method) → [{step: ms per cycle}]
    outputs: dict = {}
    for repeat in range(repeats):
        for index in range(len(prompts)):
            order = versions if (index + repeat) % 2 == 0 else versions[::-1]
            for name in names:
                for v in order:
                    out, count, seconds, steps = v.run(built[(v.label, name)], ids[v.label][index], tokens)
                    outputs.setdefault((name, index), {})[v.label] = (out, count)
                    row = {step: 1000 * steps.get(step, 0.0) / count for step in STEPS + MODEL}
                    row["loop"] = sum(row[step] for step in STEPS)
                    row["cycle"] = 1000 * seconds / count
                    row["cycles"] = count
                    runs[(v.label, name)].append(row)
    for (name, index), got in outputs.items():
        if len({tuple(out) for out, _ in got.values()}) != 1:
            raise SystemExit(f"{name}, prompt {index}: the versions emitted different tokens {sorted(got)}")
    rows = {}
    for (label, name), per_run in runs.items():
        row = {step: statistics.median(r[step] for r in per_run) for step in STEPS + ("loop",) + MODEL + ("cycle",)}
        row["cycles"] = sum(r["cycles"] for r in per_run)
        rows.setdefault(name, {})[label] = row
    return rows


def pass_rows(versions: list[Version], context: int = 256, repeats: int = 15) -> dict:
    """Per k = 1 .. 16: the median seconds of one chain pass through each version's verifiers
    (pending token + k drafts at a ``context``-token cache), and whether the logits agree bitwise."""
    ks = range(1, 17)
    times = {v.label: {k: [] for k in ks} for v in versions}
    logits = {}
    prompt = (torch.arange(context + 1) * 7919 + 13) % 40000

    def one_pass(v: Version, k: int):
        verifiers = v.decode.Verifiers(v.target, context + 40)
        verifiers.prefill(prompt)
        drafts = (torch.arange(k) * 104729 + 5) % 40000
        started = time.perf_counter()
        if hasattr(verifiers, "target_pass"):
            result = verifiers.target_pass(drafts).logits
        else:
            proposal = submodule(v.package, "proposal").Proposal.chain(drafts)
            result = verifiers.target(proposal).logits
        return time.perf_counter() - started, result

    with torch.inference_mode():
        for v in versions:
            one_pass(v, 4)  # warm-up
        for repeat in range(repeats):
            for k in ks:
                for v in (versions if (repeat + k) % 2 == 0 else versions[::-1]):
                    seconds, rows = one_pass(v, k)
                    times[v.label][k].append(seconds)
                    logits[(v.label, k)] = rows
    out = {}
    for k in ks:
        out[k] = {v.label: 1000 * statistics.median(times[v.label][k]) for v in versions}
        out[k]["bitwise"] = len(versions) < 2 or all(torch.equal(logits[(versions[0].label, k)], logits[(v.label, k)])
                                                     for v in versions[1:])
    return out


def speed_rows(versions: list[Version], names: list[str], prompts: list, tokens: int, repeats: int) -> dict:
    """Per method and version: mean tokens per second over the prompts (whole generations)."""
    built = {(v.label, name): v.methods.build_method(name, v.target) for v in versions for name in names}
    for v in versions:
        for name in names:
            policy = built[(v.label, name)].policy
            if v.table_seconds is not None and getattr(getattr(policy, "cost", None), "forward_costs", None):
                table = v.costs.ForwardCosts(dict(v.table_seconds))
                policy.cost = type(policy.cost)(table, policy.cost.draft_fractions)
                if hasattr(built[(v.label, name)], "forward_costs"):
                    built[(v.label, name)].forward_costs = table
    ids = {v.label: [v.prompting.encode_prompt(v.target, p.text) for p in prompts] for v in versions}
    rates = defaultdict(list)
    for v in versions:
        for name in names:
            v.run(built[(v.label, name)], ids[v.label][0], 8)
    for repeat in range(repeats):
        for index in range(len(prompts)):
            for name in names:
                for v in (versions if (index + repeat) % 2 == 0 else versions[::-1]):
                    out, _, seconds, _ = v.run(built[(v.label, name)], ids[v.label][index], tokens)
                    rates[(name, v.label)].append(len(out) / seconds)
    return {name: {v.label: statistics.mean(rates[(name, v.label)]) for v in versions} for name in names}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", type=Path, help="a folder holding another checkout's tierspec package")
    parser.add_argument("--methods", default="ar,hybrid")
    parser.add_argument("--prompts", type=int, default=4, help="Spec-Bench prompts, one per category in turn")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads (the loop's own work is single-threaded)")
    parser.add_argument("--passes", action="store_true", help="also time chain passes for k = 1 .. 16")
    parser.add_argument("--speed", default="", help="also time whole generations of these methods (comma-separated)")
    parser.add_argument("--out", type=Path, default=Path("results/loop_time.json"))
    args = parser.parse_args()

    import tierspec

    after = Version("after", tierspec, None, args.threads)
    table = after.methods._cost_table(after.target, 16)  # measured once and cached; both versions use it
    after.table_seconds = dict(table.seconds)
    versions = [after]
    if args.before is not None:
        versions.insert(0, Version("before", import_before(args.before), after.table_seconds, args.threads))
    prompts = after.data.select(after.data.load_prompts("spec_bench"), per_category=1, seed=0)[: args.prompts]
    names = [n.strip() for n in args.methods.split(",") if n.strip()]
    result = {"tokens": args.tokens, "prompts": [p.id for p in prompts], "repeats": args.repeats,
              "threads": args.threads, "loop": loop_rows(versions, names, prompts, args.tokens, args.repeats)}
    for name, by_version in result["loop"].items():
        counts = ", ".join(f"{label}: {row['cycles']} cycles" for label, row in by_version.items())
        print(f"\n{name}: ms per cycle ({counts})")
        print(f"{'step':<12}" + "".join(f"{label:>10}" for label in by_version))
        for step in STEPS + ("loop",) + MODEL + ("cycle",):
            print(f"{step:<12}" + "".join(f"{row[step]:>10.3f}" for row in by_version.values()))
    if args.passes:
        result["passes"] = pass_rows(versions)
        print("\nchain pass ms (k drafts, 256-token context), bitwise equal logits:")
        for k, row in result["passes"].items():
            print(f"k={k:<3}" + "".join(f"{row[v.label]:>9.2f}" for v in versions) + f"  {row['bitwise']}")
    if args.speed:
        speed = [n.strip() for n in args.speed.split(",") if n.strip()]
        result["speed"] = speed_rows(versions, speed, prompts, args.tokens, args.repeats)
        print("\ntokens per second (mean over prompts):")
        for name, row in result["speed"].items():
            print(f"{name:<14}" + "".join(f"{row[v.label]:>9.2f}" for v in versions))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
