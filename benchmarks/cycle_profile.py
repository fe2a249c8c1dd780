"""Where a cycle's time goes with the draft head: for fixed draft lengths k = 0 (plain decoding)
.. 4 on prompts written for this probe, the wall time per cycle, the drafting time per cycle, the
verification pass predicted by the forward-cost table, and the acceptance of drafted tokens.

    python benchmarks/cycle_profile.py [--report-only]

Greedy, 128 new tokens, one run, each length's runs back to back per prompt. Writes
results/cycle_profile.json, and results/draft_head-profile.md (quoted in BENCHMARKS.md) from it
and from results/policy_probe.json (``python benchmarks/policy_probe.py``).
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path

import torch

from tierspec import load_model
from tierspec.decode import DecodeConfig, DecodeRun, GenerationStats
from tierspec.methods import build_method
from tierspec.policies import FixedLength
from tierspec.prompting import encode_prompt, eos_ids
from tierspec.util import atomic_write_text

PROMPTS = [
    "Describe the water cycle to a ten-year-old.",
    "What are the main differences between a virus and a bacterium?",
    "A shop sells pencils at 3 for 45 cents. How much do 14 pencils cost? Show your work.",
    "Translate into French: The train leaves at seven, so we should have breakfast early.",
]


def report() -> str:
    profile = json.loads(Path("results/cycle_profile.json").read_text())
    lines = ["## Where the draft head's time goes", "",
             "`python benchmarks/cycle_profile.py` — `eagle` at fixed draft lengths k on 4 prompts written for the "
             "probe (greedy, 128 tokens, one run); verification cost from the forward-cost table (passes padded to "
             "the cheapest size), the rest is the loop (acceptance walk, commit, feature hand-over).", "",
             "| k | tok/s | vs ar | tokens / cycle | accepted / drafted | ms / cycle | drafting | verification (table) | rest |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in profile["rows"]:
        acceptance = "–" if r["acceptance"] is None else f"{r['acceptance']:.2f}"
        lines.append(f"| {r['k']} | {r['tokens_per_s']} | {r['vs_ar']:.2f}× | {r['tokens_per_cycle']:.2f} | {acceptance} | "
                     f"{r['cycle_ms']} | {r['draft_ms']} | {r['table_verify_ms']} | {r['rest_ms']} |")
    probe_path = Path("results/policy_probe.json")
    if probe_path.exists():
        probe = json.loads(probe_path.read_text())
        lines += ["", f"`python benchmarks/policy_probe.py` — draft-length policies for `eagle` on {probe['prompts']} "
                  f"prompts written for the probe (greedy, {probe['tokens']} tokens, one run, interleaved per prompt):", "",
                  "| policy | tok/s | vs ar | τ | drafted / cycle | accepted / drafted |", "|---|---|---|---|---|---|"]
        for name, r in probe["rows"].items():
            lines.append(f"| {name} | {r['tokens_per_s']} | {r['vs_ar']:.3f}× | {r['tau']} | {r['drafted_per_cycle']} | "
                         f"{r['acceptance']} |")
    # The reading below is computed from the rows above, so a rerun cannot contradict it.
    by_k = {r["k"]: r for r in profile["rows"]}
    best = max((r for r in profile["rows"] if r["k"] > 0), key=lambda r: r["vs_ar"])
    if 1 in by_k and 2 in by_k:
        lines += ["", f"Drafting a second token turns a {by_k[1]['table_verify_ms']} ms verification (2 tokens) into a "
                  f"{by_k[2]['table_verify_ms']} ms one (3 tokens) plus a draft step, and the second token counts only "
                  f"if the first was accepted (accepted / drafted at k = 1: {by_k[1]['acceptance']}). The best fixed "
                  f"length here is k = {best['k']} ({best['vs_ar']:.2f}× ar)."]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--report-only", action="store_true", help="rewrite the markdown report from the JSON files")
    if parser.parse_args().report_only:
        atomic_write_text(Path("results/draft_head-profile.md"), report())
        return
    torch.set_num_threads(2)
    target = load_model("smollm2-135m")
    eagle = build_method("eagle", target)
    table = eagle.policy.pass_costs
    methods = {0: build_method("ar", target), **{k: replace(eagle, policy=FixedLength(k, table)) for k in (1, 2, 3, 4)}}
    totals = {k: GenerationStats() for k in methods}
    for prompt in PROMPTS:
        ids = encode_prompt(target, prompt, True)
        config = DecodeConfig(max_new_tokens=128, eos_token_ids=eos_ids(target))
        for k, method in methods.items():
            for _ in range(2):  # the first run of each warms caches; the second is kept
                stats = DecodeRun(target, method, ids, config).finish().stats
            total = totals[k]
            for name in ("drafted", "accepted", "emitted", "cycles", "wall_seconds", "draft_seconds", "target_calls"):
                setattr(total, name, getattr(total, name) + getattr(stats, name))
    rows = []
    ar_rate = totals[0].emitted / totals[0].wall_seconds
    for k, total in totals.items():
        cycle_ms = 1000 * total.wall_seconds / total.cycles
        draft_ms = 1000 * total.draft_seconds / total.cycles
        verify_ms = 1000 * table.cost(k + 1)
        rows.append({"k": k, "tokens_per_s": round(total.emitted / total.wall_seconds, 2),
                     "vs_ar": round(total.emitted / total.wall_seconds / ar_rate, 3),
                     "tokens_per_cycle": round(total.emitted / total.cycles, 3),
                     "acceptance": round(total.accepted / total.drafted, 3) if total.drafted else None,
                     "cycle_ms": round(cycle_ms, 1), "draft_ms": round(draft_ms, 2),
                     "table_verify_ms": round(verify_ms, 1),
                     "rest_ms": round(cycle_ms - draft_ms - verify_ms, 1)})
        print(rows[-1], flush=True)
    atomic_write_text(Path("results/cycle_profile.json"), json.dumps({"prompts": PROMPTS, "rows": rows}, indent=2))
    atomic_write_text(Path("results/draft_head-profile.md"), report())


if __name__ == "__main__":
    main()
