"""The two lossless sampling rules on the same drafts: how many drafted tokens each keeps, and what
the coupled rule costs or gains in speed (docs/algorithms.md §Exact speculative decoding; README
"Same seed, same text").

    python benchmarks/sampling_rules.py [--per-category 5] [--max-new-tokens 128] [--temperature 1]
                                        [--methods eagle,hybrid,adaptive-pld]

Every method runs with the coupled rule, beside `ar` on the same prompt and seed (interleaved,
one process): its text is then `ar`'s, so the per-prompt speed-up compares the same text. In each
cycle the same draft is also scored under the residual rule: the expected number of drafts it
keeps, Σ_i Π_{j≤i} min(1, q_j(x_j) / p_j(x_j)), where the coupled rule kept the drafts equal to
the target's perturbed argmax. The two rules then see the same contexts, drafts, draft lengths
and target passes, and differ only in what they keep (a run of each rule samples different texts,
and the spread between texts swamps the difference). τ of the residual rule follows from its
expected kept tokens; its speed is predicted as the coupled speed × τ_residual / τ_coupled (a
cycle costs the same under both: the same passes; the rules' own arithmetic is < 1 ms).

Writes results/sampling_rules.md and .json.
"""

from __future__ import annotations

import argparse
import json
import zlib
from collections import defaultdict
from pathlib import Path

import torch

from tierspec.data import load_prompts, select
from tierspec.decode import DecodeConfig, DecodeRun
from tierspec.methods import build_method
from tierspec.models import load_model
from tierspec.prompting import encode_prompt, eos_ids
from tierspec.proposal import Verdict
from tierspec.rules import ExactRule
from tierspec.sampling import SamplingConfig, logits_to_probs
from tierspec.walks import acceptance_probability, draft_prob_of_tokens
from tierspec.util import atomic_write_text

ROOT = Path(__file__).resolve().parents[1]


class ScoredCoupledRule(ExactRule):
    """The coupled rule, recording per cycle (source, drafted, kept, the residual rule's
    probability of keeping drafts 1..i for each i)."""

    def __init__(self):
        super().__init__("coupled")
        self.cycles: list[tuple[str, int, int, list[float]]] = []

    def decide(self, proposal, scores, sampling, noise) -> Verdict:
        verdict = super().decide(proposal, scores, sampling, noise)
        k = len(proposal)
        if k:
            q = logits_to_probs(scores.logits[:k], sampling)  # [k, V]
            keep = acceptance_probability(draft_prob_of_tokens(proposal), q[torch.arange(k), proposal.tokens])
            self.cycles.append((proposal.source, k, verdict.accepted, torch.cumprod(keep.double(), 0).tolist()))
        return verdict


def run(target, method, prompt_ids, config, seed) -> tuple[list[int], float, int]:
    run = DecodeRun(target, method, prompt_ids, config, seed).finish()
    return run.token_ids, run.stats.wall_seconds, run.stats.target_calls


def acceptance_by_position(cycles, kept_reach) -> list[float]:
    """P(draft i kept | drafts before it kept), i = 1..6, from (drafted, reach) per cycle."""
    out = []
    for i in range(6):
        reached = kept = 0.0
        for k, reach in kept_reach(cycles):
            if k > i:
                reached += 1.0 if i == 0 else reach[i - 1]
                kept += reach[i]
        out.append(kept / reached if reached else float("nan"))
    return out


def coupled_reach(cycles):
    for _, k, accepted, _ in cycles:
        yield k, [1.0 if i < accepted else 0.0 for i in range(k)]


def residual_reach(cycles):
    for _, k, _, reach in cycles:
        yield k, reach


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--methods", default="eagle,hybrid,adaptive-pld")
    parser.add_argument("--per-category", type=int, default=5)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--out", type=Path, default=ROOT / "results" / "sampling_rules")
    args = parser.parse_args()
    target = load_model("smollm2-135m")
    sampling = SamplingConfig(args.temperature)
    config = DecodeConfig(args.max_new_tokens, sampling, eos_ids(target))
    prompts = select(load_prompts("spec_bench"), args.per_category, None, 0)
    names = [m.strip() for m in args.methods.split(",") if m.strip()]
    methods = {"ar": build_method("ar", target)}
    rules = {}
    for name in names:
        methods[name] = build_method(name, target)
        methods[name].rule = rules[name] = ScoredCoupledRule()
    warm = encode_prompt(target, prompts[0].text)
    for method in methods.values():
        run(target, method, warm, DecodeConfig(8, sampling, eos_ids(target)), 0)
    for rule in rules.values():
        rule.cycles.clear()
    per_prompt = defaultdict(list)  # method → [(tokens/s, emitted, target calls, same text as ar)]
    for index, prompt in enumerate(prompts):
        ids = encode_prompt(target, prompt.text)
        seed = zlib.crc32(prompt.id.encode())
        order = list(methods)
        order = order[index % len(order):] + order[: index % len(order)]  # interleaved
        outputs = {}
        for name in order:
            tokens, seconds, calls = run(target, methods[name], ids, config, seed)
            outputs[name] = tokens
            per_prompt[name].append((len(tokens) / seconds, len(tokens), calls))
        for name in names:
            per_prompt[name][-1] += (outputs[name] == outputs["ar"],)
        print(f"{index + 1}/{len(prompts)} {prompt.id}", flush=True)

    ar_rates = [r[0] for r in per_prompt["ar"]]
    summary = {"settings": vars(args) | {"out": str(args.out), "prompts": len(prompts)}, "methods": {}}
    for name in names:
        rows, cycles = per_prompt[name], rules[name].cycles
        emitted, calls = sum(r[1] for r in rows), sum(r[2] for r in rows)
        kept_coupled = sum(c[2] for c in cycles)
        kept_residual = sum(sum(c[3]) for c in cycles)
        drafted = sum(c[1] for c in cycles)
        speedup = sum(r[0] for r in rows) / sum(ar_rates)
        tau_coupled = emitted / calls
        tau_residual = (emitted - kept_coupled + kept_residual) / calls
        by_source = {}
        for source in sorted({c[0] for c in cycles}):
            mine = [c for c in cycles if c[0] == source]
            by_source[source] = {
                "cycles": len(mine), "drafted": sum(c[1] for c in mine),
                "kept_per_draft_coupled": sum(c[2] for c in mine) / sum(c[1] for c in mine),
                "kept_per_draft_residual": sum(sum(c[3]) for c in mine) / sum(c[1] for c in mine),
                "by_position_coupled": acceptance_by_position(mine, coupled_reach),
                "by_position_residual": acceptance_by_position(mine, residual_reach),
            }
        summary["methods"][name] = {
            "same_text_as_ar": sum(r[3] for r in rows) / len(rows),
            "speedup_coupled": speedup,
            "speedup_residual_predicted": speedup * tau_residual / tau_coupled,
            "tau_coupled": tau_coupled, "tau_residual": tau_residual,
            "drafted": drafted, "kept_coupled": kept_coupled, "kept_residual_expected": kept_residual,
            "by_source": by_source,
        }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(args.out.with_suffix(".json"), json.dumps(summary, indent=2))
    lines = [f"## The lossless sampling rules on the same drafts (temperature {args.temperature:g})", "",
             f"`python benchmarks/sampling_rules.py --per-category {args.per_category} --max-new-tokens "
             f"{args.max_new_tokens} --temperature {args.temperature:g} --methods {args.methods}` — Spec-Bench, "
             f"{len(prompts)} prompts, the default model, one process, `ar` interleaved with each method on the same "
             "prompt and seed. Coupled: measured (its text is `ar`'s: the speed-up compares the same text). Residual: "
             "the same drafts scored by min(1, q/p) (expected kept tokens); its speed-up is predicted from τ.", "",
             "| method | same text as ar | speed-up coupled | speed-up residual (predicted) | τ coupled | τ residual "
             "| kept / drafted coupled | kept / drafted residual |", "|---|---|---|---|---|---|---|---|"]
    for name, row in summary["methods"].items():
        lines.append(f"| `{name}` | {row['same_text_as_ar']:.2f} | {row['speedup_coupled']:.3f}× | "
                     f"{row['speedup_residual_predicted']:.3f}× | {row['tau_coupled']:.3f} | {row['tau_residual']:.3f} | "
                     f"{row['kept_coupled'] / max(row['drafted'], 1):.3f} | "
                     f"{row['kept_residual_expected'] / max(row['drafted'], 1):.3f} |")
    lines += ["", "Acceptance by draft position (P(draft i kept | drafts 1..i−1 kept)), per drafter source:", "",
              "| method | source | cycles | rule | 1 | 2 | 3 | 4 | 5 | 6 |", "|---|---|---|---|---|---|---|---|---|---|"]
    for name, row in summary["methods"].items():
        for source, numbers in row["by_source"].items():
            for rule in ("coupled", "residual"):
                cells = " | ".join("–" if value != value else f"{value:.3f}" for value in numbers[f"by_position_{rule}"])
                lines.append(f"| `{name}` | {source} | {numbers['cycles']} | {rule} | {cells} |")
    text = "\n".join(lines) + "\n"
    atomic_write_text(args.out.with_suffix(".md"), text)
    print(text)


if __name__ == "__main__":
    main()
