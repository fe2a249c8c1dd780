"""Where the default method's time goes against plain decoding on the issue's Spec-Bench prompts, in seconds
and calls: `ar` and `hybrid` alternated prompt by prompt (2 prompts a category, 128 tokens, seed 0), each
generation's wall time split into the prompt's prefill (`Verifiers.run_prefill`), the cycles' target passes
(`GenerationStats.pass_seconds`), the draft head's steps (`HeadRunner.extend` / `logits`, their rows) and the rest
(the loop's own work); the cycles by what they drafted (source, tokens) and the drafts they kept; and each
prompt's passes by rows, as the median k-row pass over the median 1-row pass of the same generation, beside the
pass-cost table the policy reads. Every text is checked against `ar`'s.

    python results/zen3/stop77/t1_accounting.py TEMPERATURE [PER_CATEGORY]
"""
import collections
import importlib
import statistics
import sys
import time

import torch

import tierspec
from tierspec import data, prompting, sampling, verifiers
from tierspec.heads import draft
from tierspec.methods import _cost_table, build_method

decode = importlib.import_module("tierspec.decode")
temperature = float(sys.argv[1])
per_category = int(sys.argv[2]) if len(sys.argv) > 2 else 2
torch.set_num_threads(2)
target = tierspec.load_model("smollm2-135m", dtype="auto")
timers = collections.defaultdict(lambda: [0, 0.0, 0])


def wrap(owner, attribute, key, rows=None):
    function = getattr(owner, attribute)

    def timed(*args, **kwargs):
        started = time.perf_counter()
        try:
            return function(*args, **kwargs)
        finally:
            entry = timers[key]
            entry[0] += 1
            entry[1] += time.perf_counter() - started
            if rows is not None:
                entry[2] += rows(*args, **kwargs)

    setattr(owner, attribute, timed)


wrap(draft.HeadRunner, "extend", "head extend", lambda self, inputs, *a, **k: int(inputs.shape[0]))
wrap(draft.HeadRunner, "logits", "head logits")
wrap(verifiers.Verifiers, "run_prefill", "prefill")
methods = {name: build_method(name, target) for name in ("ar", "hybrid")}
table = _cost_table(target, 11)
prompts = data.select(data.load_prompts("spec_bench"), per_category=per_category, seed=0)
totals = collections.defaultdict(float)
drafted = collections.Counter()
kept = collections.Counter()
row_ratios = collections.defaultdict(list)
for index, prompt in enumerate(prompts):
    ids = prompting.encode_prompt(target, prompt.text)
    texts = {}
    for name in (("ar", "hybrid") if index % 2 == 0 else ("hybrid", "ar")):
        timers.clear()
        config = decode.DecodeConfig(max_new_tokens=128, sampling=sampling.SamplingConfig(temperature, 0, 1.0),
                                     eos_token_ids=prompting.eos_ids(target))
        started = time.perf_counter()
        run = decode.DecodeRun(target, methods[name], ids, config, seed=0)
        passes_by_rows = collections.defaultdict(list)
        for step in run:
            proposal = step.proposal
            source = proposal.source if proposal is not None and len(proposal) else "-"
            if name == "hybrid":
                drafted[(source, step.cycle.drafted)] += 1
                kept[(source, step.cycle.drafted)] += step.cycle.accepted
                passes_by_rows[step.cycle.drafted + 1].append(step.cycle.pass_seconds)
        wall = time.perf_counter() - started
        texts[name] = run.token_ids
        totals[name, "wall"] += wall
        totals[name, "passes"] += run.stats.pass_seconds
        totals[name, "cycles"] += run.stats.cycles
        totals[name, "tokens"] += len(run.token_ids)
        for key, (calls, seconds, rows) in timers.items():
            totals[name, key] += seconds
            totals[name, key + " calls"] += calls
            if rows:
                totals[name, key + " rows"] += rows
        if name == "hybrid" and passes_by_rows.get(1):
            one = statistics.median(passes_by_rows[1])
            for rows, seconds in passes_by_rows.items():
                if rows > 1:
                    row_ratios[rows].append(statistics.median(seconds) / one)
    if texts["ar"] != texts["hybrid"]:
        raise SystemExit(f"{prompt.id}: hybrid's text is not ar's")
print(f"temperature {temperature}, {len(prompts)} Spec-Bench prompts ({per_category} a category), 128 tokens, seed 0; "
      "every hybrid text ar's")
for name in ("ar", "hybrid"):
    wall, prefill, passes = totals[name, "wall"], totals[name, "prefill"], totals[name, "passes"]
    head = totals[name, "head extend"] + totals[name, "head logits"]
    print(f"{name:6s} wall {wall:7.3f} s = prefill {prefill:6.3f} ({100 * prefill / wall:4.1f}%) + passes {passes:6.3f} "
          f"+ head {head:5.3f} ({int(totals[name, 'head extend calls'])} extends over "
          f"{int(totals[name, 'head extend rows'])} rows, {int(totals[name, 'head logits calls'])} logits) "
          f"+ rest {wall - prefill - passes - head:5.3f}; {int(totals[name, 'cycles'])} cycles, "
          f"{int(totals[name, 'tokens'])} tokens")
print(f"hybrid / ar: wall {totals['ar', 'wall'] / totals['hybrid', 'wall']:.3f}x speed; passes "
      f"{totals['hybrid', 'passes'] / totals['ar', 'passes']:.3f}x ar's time; decoding alone (wall less prefill) "
      f"{(totals['ar', 'wall'] - totals['ar', 'prefill']) / (totals['hybrid', 'wall'] - totals['hybrid', 'prefill']):.3f}x")
print("hybrid's cycles by (source, drafted tokens): cycles, drafts kept a cycle")
for key in sorted(drafted):
    print(f"  {key}: {drafted[key]}, {kept[key] / drafted[key]:.3f}")
one = table.seconds[1]
print("a k-row pass over a 1-row pass: the table the policy reads | medians over prompts of each generation's own")
for rows in sorted(row_ratios):
    if rows in table.seconds:
        print(f"  {rows} rows: table {table.seconds[rows] / one:.3f} | generations {statistics.median(row_ratios[rows]):.3f} "
              f"({len(row_ratios[rows])} prompts)")
