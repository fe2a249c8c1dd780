"""The decode loop's own time per cycle: a generation's wall time less its model passes and draft-head
steps, by method and temperature, optionally beside another checkout's in the same process.

    python benchmarks/loop_time.py [--methods ar,hybrid] [--temperatures 0,1] [--prompts 4] [--tokens 128]
                                   [--repeats 2] [--model smollm2-135m] [--before /tmp/loop_base] [--entry generate]
                                   [--out results/loop_time/loop_time.json]

``--entry generate`` times ``tierspec.generate`` (a streamed run and its text, as the library and the CLI run
it) instead of ``DecodeRun.finish``; it reports no phases.

A temperature may carry the sampling filters users set, as ``T/kK/pP`` (``1/p0.95``: top-p 0.95;
``0.7/k40/p0.9``: top-k 40 then top-p 0.9): the loop then also finds each row's allowed tokens.

Per method and temperature (seed 0), ``--prompts`` Spec-Bench prompts (one per category in turn)
run to ``--tokens`` tokens, ``--repeats`` times. Probes (the same in every version) time every
target pass (the pass backend's ``run`` — preparing the pass's rows is the pass's — and
``CachedModel.forward``, prefill included) and every draft-head step
(``HeadRunner.extend`` / ``logits``); what is left of the generation's wall time is the loop's own:
drafting's bookkeeping, the keyed noise, sampling and verifying, committing, the policies and the
statistics. Reported per cycle (the median over the runs: a shared machine stalls now and then):
``loop`` (the loop's own ms per cycle), ``pass`` and ``head`` (ms per cycle in them), tokens per
cycle, and for this checkout where a cycle's time went (``decode.CycleTimes``: draft, verify and
commit, less the head's steps). The targets (issue 37): the default method's ``loop`` ≤ 0.3 ms per
cycle greedy, and ``ar``'s ≤ 0.5 ms per token at temperature 1.

``--before`` names a folder holding another checkout's ``tierspec`` package (e.g.
``git archive <commit> tierspec | tar -x -C /tmp/loop_base``, the compiled engine copied beside it),
imported as ``tierspec_before`` beside this one and interleaved prompt by prompt; both read the
pass-cost table cached for the model, and their tokens are compared.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch


def import_before(folder: Path):
    """The ``tierspec`` package found in ``folder``, imported as ``tierspec_before``."""
    package = folder / "tierspec"
    spec = importlib.util.spec_from_file_location("tierspec_before", package / "__init__.py",
                                                  submodule_search_locations=[str(package)])
    module = importlib.util.module_from_spec(spec)
    sys.modules["tierspec_before"] = module
    spec.loader.exec_module(module)
    return module


class Probe:
    """Exclusive seconds inside wrapped callables by kind: a wrapped call's time less the wrapped
    calls inside it (a head step inside a pass is the head's, once)."""

    def __init__(self):
        self.totals: dict[str, float] = defaultdict(float)
        self._stack: list[list] = []

    def wrap(self, owner, attribute: str, kind: str) -> None:
        function = getattr(owner, attribute)

        def timed(*args, **kwargs):
            started = time.perf_counter()
            self._stack.append([0.0])
            try:
                return function(*args, **kwargs)
            finally:
                elapsed = time.perf_counter() - started
                (inner,) = self._stack.pop()
                self.totals[kind] += elapsed - inner
                if self._stack:
                    self._stack[-1][0] += elapsed

        setattr(owner, attribute, timed)


class Version:
    """One version of tierspec: its model, its probes, its methods."""

    def __init__(self, label: str, package, dtype: str = "auto", model: str = "smollm2-135m"):
        self.label, self.package = label, package
        self.module = lambda name: importlib.import_module(f"{package.__name__}.{name}")
        self.target = package.load_model(model, dtype=dtype)
        self.probe = Probe()
        self.probe.wrap(self.module("cached_model").CachedModel, "forward", "pass")
        # the pass backend's run, whatever it calls: a lone request runs as a batched pass of one since 2026-12-05
        passes = self.module("passes")
        self.probe.wrap(passes.EnginePasses, "run", "pass")
        self.probe.wrap(passes.SequentialPasses, "run", "pass")
        head = self.module("heads.draft").HeadRunner
        self.probe.wrap(head, "extend", "head")
        self.probe.wrap(head, "logits", "head")
        batched = self.module("heads.draft")
        if hasattr(batched, "_engine_steps"):  # this checkout: several sequences' head steps in one call
            self.probe.wrap(batched, "_engine_steps", "head")

    def method(self, name: str):
        return self.module("methods").build_method(name, self.target)

    def run(self, method, prompt_ids: torch.Tensor, tokens: int, setting: tuple[float, int, float],
            entry: str = "finish", name: str = "") -> dict:
        decode, sampling = self.module("decode"), self.module("sampling")
        self.probe.totals.clear()
        if entry == "generate":  # the library's call (and the CLI's loop): the streamed steps and their text
            temperature, top_k, top_p = setting
            run = self.package.generate(prompt_ids.tolist(), target=self.target, method=name, max_new_tokens=tokens,
                                        temperature=temperature, top_k=top_k, top_p=top_p, seed=0, chat_template=False)
            phases = {}
        else:
            config = decode.DecodeConfig(max_new_tokens=tokens, sampling=sampling.SamplingConfig(*setting),
                                         eos_token_ids=self.module("prompting").eos_ids(self.target))
            run = decode.DecodeRun(self.target, method, prompt_ids, config, seed=0)
            run.finish()
            phases = run.times.to_dict() if hasattr(run, "times") else {}  # an earlier version keeps no phases
        cycles = run.stats.cycles
        passes, head = self.probe.totals["pass"], self.probe.totals["head"]
        row = {"cycles": cycles, "tokens": len(run.token_ids), "ids": run.token_ids,
               "loop": 1000 * (run.stats.wall_seconds - passes - head) / cycles,
               "pass": 1000 * passes / cycles, "head": 1000 * head / cycles}
        if phases:
            row["draft (less the head)"] = 1000 * (phases["draft"] - head) / cycles
            row["verify"] = 1000 * phases["verify"] / cycles
            row["commit"] = 1000 * phases["commit"] / cycles
        return row


def sampling_setting(spec: str) -> tuple[float, int, float]:
    """``T``, ``T/kK``, ``T/pP`` or ``T/kK/pP`` as (temperature, top_k, top_p)."""
    temperature, top_k, top_p = float(spec.split("/")[0]), 0, 1.0
    for part in spec.split("/")[1:]:
        if part.startswith("k"):
            top_k = int(part[1:])
        elif part.startswith("p"):
            top_p = float(part[1:])
        else:
            raise SystemExit(f"a sampling setting is T, T/kK, T/pP or T/kK/pP, not {spec!r}")
    return temperature, top_k, top_p


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--methods", default="ar,hybrid")
    parser.add_argument("--temperatures", default="0,1", help="temperatures, each optionally with top-k and "
                        "top-p: T/kK/pP (module docstring)")
    parser.add_argument("--prompts", type=int, default=4, help="Spec-Bench prompts, one per category in turn")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--dtype", default="auto", help="the model's numerics, as the CLI's --dtype (auto: what "
                        "`tierspec generate` runs: int8 rows on an x86 CPU with int8 dot products)")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads(), help="the engine's threads")
    parser.add_argument("--model", default="smollm2-135m", help="a known model's name (docs/models.md)")
    parser.add_argument("--before", type=Path, help="a folder holding another checkout's tierspec package")
    parser.add_argument("--sampled-texts-differ", action="store_true",
                        help="--before draws other noise (a checkout before the keyed-noise kernels): its sampled "
                             "texts differ by design, so only greedy texts are compared")
    parser.add_argument("--entry", choices=("finish", "generate"), default="finish",
                        help="finish: DecodeRun.finish, the issue's measure; generate: tierspec.generate of the "
                             "prompt's ids, the streamed steps and their text as the library and the CLI run them")
    parser.add_argument("--out", type=Path, default=Path("results/loop_time/loop_time.json"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    import tierspec
    from tierspec.util import atomic_write_text

    after = Version("this", tierspec, args.dtype, args.model)
    versions = [after]
    if args.before is not None:  # both read the pass-cost table cached under one key: the same drafts
        versions.insert(0, Version("before", import_before(args.before), args.dtype, args.model))
    data = after.module("data")
    prompts = data.select(data.load_prompts("spec_bench"), per_category=1, seed=0)[: args.prompts]
    names = [n.strip() for n in args.methods.split(",") if n.strip()]
    temperatures = [t.strip() for t in args.temperatures.split(",") if t.strip()]
    settings = {t: sampling_setting(t) for t in temperatures}
    built = {(v.label, name): v.method(name) for v in versions for name in names}
    ids = {v.label: [v.module("prompting").encode_prompt(v.target, p.text) for p in prompts] for v in versions}
    for v in versions:  # warm-up: the first generation of a process pays one-off costs
        for name in names:
            v.run(built[(v.label, name)], ids[v.label][0], 8, (0.0, 0, 1.0), args.entry, name)
    runs = defaultdict(list)
    for repeat in range(args.repeats):
        for index in range(len(prompts)):
            for temperature in temperatures:
                for name in names:
                    outputs = {}
                    for v in (versions if (index + repeat) % 2 == 0 else versions[::-1]):
                        row = v.run(built[(v.label, name)], ids[v.label][index], args.tokens, settings[temperature],
                                    args.entry, name)
                        outputs[v.label] = row.pop("ids")
                        runs[(name, temperature, v.label)].append(row)
                    differ_by_design = args.sampled_texts_differ and settings[temperature][0] > 0
                    if len({tuple(out) for out in outputs.values()}) != 1 and not differ_by_design:
                        raise SystemExit(f"{name} at temperature {temperature}, prompt {index}: the versions "
                                         "emitted different tokens")
    result = {"command": " ".join(sys.argv), "entry": args.entry, "model": args.model, "dtype": args.dtype, "tokens": args.tokens, "prompts": [p.id for p in prompts],
              "repeats": args.repeats, "threads": args.threads, "rows": []}
    for (name, temperature, label), rows in runs.items():
        keys = [k for k in rows[0] if k not in ("cycles", "tokens")]
        summary = {k: round(statistics.median(r[k] for r in rows), 4) for k in keys}
        cycles, tokens = sum(r["cycles"] for r in rows), sum(r["tokens"] for r in rows)
        summary.update(method=name, temperature=temperature, version=label, cycles=cycles,
                       tokens_per_cycle=round(tokens / cycles, 3), loop_per_token=round(
                           statistics.median(r["loop"] * r["cycles"] / r["tokens"] for r in rows), 4))
        result["rows"].append(summary)
    lines = [f"`{result['command']}` — ms per cycle, medians over {len(prompts)} prompts × {args.repeats}:", "",
             "| method | T | version | loop | loop per token | draft (less the head) | verify | commit | pass | head "
             "| tokens/cycle |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in result["rows"]:
        def cell(key: str) -> str:
            return f"{row[key]:.3f}" if key in row else "–"

        lines.append(f"| `{row['method']}` | {row['temperature']} | {row['version']} | {cell('loop')} | "
                     f"{cell('loop_per_token')} | {cell('draft (less the head)')} | {cell('verify')} | "
                     f"{cell('commit')} | {cell('pass')} | {cell('head')} | {row['tokens_per_cycle']} |")
    result["table"] = "\n".join(lines)
    print(result["table"])
    atomic_write_text(args.out, json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
