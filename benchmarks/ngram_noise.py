"""Whether the noise a sampled n-gram draft will be judged by predicts its acceptance: at temperature
above 0 the coupled rule keeps draft token c at position t iff c = argmax_v(log π_t(v) + g_t(v)), and
g_t is keyed by (seed, t) — known before the pass. A drafter guessing c without π (prompt lookup)
still knows g_t(c); given it, P(accept) = exp(−(1 − π_t(c)) / π_t(c) · e^(−g_t(c))) rises steeply with g.

    python benchmarks/ngram_noise.py [--method hybrid] [--per-category 4] [--tokens 128] [--temperature 1]

Runs ``--method`` on Spec-Bench prompts (``--per-category`` a category, seed 1 of the selection,
generation seed 0), records every n-gram proposal's tokens with the Gumbel value of each at its
position (computed from the keyed noise as csrc/noise/keyed_noise.c's ``gumbel_at`` does, in float64;
checked against the kernel's rows first), and compares them with the tokens generated there: a
draft at depth d counts when the drafts before it matched. Prints, per depth 0 and 1, how often a
draft matched by bins of its noise. What it does not show: the policy's choices (every proposed
draft is scored, verified or not) or any speed."""

from __future__ import annotations

import argparse
import math

import torch

import tierspec
from tierspec import _keyed_noise
from tierspec.data import load_prompts, select
from tierspec.decode import DecodeConfig, DecodeRun
from tierspec.drafters import ngram
from tierspec.methods import build_method
from tierspec.prompting import encode_prompt, eos_ids
from tierspec.sampling import SamplingConfig, gumbel_rows

GOLDEN_GAMMA = 0x9E3779B97F4A7C15  # csrc/noise/keyed_noise.c
BINS = [-math.inf, 0.0, 1.0, 2.0, 3.0, math.inf]


def gumbel_value(key: int, token: int) -> float:
    """g(token) of ``key``'s token noise, in float64 (the kernel's float32 value to its rounding)."""
    bits = _keyed_noise.mix64((key + (token + 1) * GOLDEN_GAMMA) & (2**64 - 1))
    uniform = (bits >> 12) * 2.0**-52 + 2.0**-53
    return -math.log(-math.log(uniform))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--method", default="hybrid")
    parser.add_argument("--per-category", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=1.0)
    args = parser.parse_args()
    row = gumbel_rows([123456789], 49152)[0]
    worst = max(abs(gumbel_value(123456789, t) - float(row[t])) for t in range(0, 49152, 97))
    if worst > 1e-5:
        raise SystemExit(f"the noise computed here parts from the kernel's by {worst}")
    target = tierspec.load_model("smollm2-135m")
    method = build_method(args.method, target)
    proposals: list[tuple[int, list[tuple[int, float]]]] = []
    lookup = ngram.NgramDrafter.propose

    def recorded(self, context, request):
        proposal = lookup(self, context, request)
        if len(proposal) and request.noise is not None:
            start, noise = request.noise.start, request.noise.noise
            proposals.append((start, [(token, gumbel_value(noise.key(start + i), token))
                                      for i, token in enumerate(proposal.tokens.tolist())]))
        return proposal

    ngram.NgramDrafter.propose = recorded
    config = DecodeConfig(max_new_tokens=args.tokens, sampling=SamplingConfig(args.temperature), eos_token_ids=eos_ids(target))
    seen: list[tuple[int, float, bool]] = []  # (depth, noise, matched)
    prompts = select(load_prompts("spec_bench"), per_category=args.per_category, seed=1)
    for prompt in prompts:
        proposals.clear()
        ids = encode_prompt(target, prompt.text)
        run = DecodeRun(target, method, ids, config, seed=0).finish()
        text = ids.tolist() + run.token_ids
        for start, drafts in proposals:
            for depth, (token, noise) in enumerate(drafts):
                if start + depth >= len(text):
                    break
                matched = text[start + depth] == token
                seen.append((depth, noise, matched))
                if not matched:
                    break
    print(f"`python benchmarks/ngram_noise.py --method {args.method} --per-category {args.per_category} --tokens "
          f"{args.tokens} --temperature {args.temperature:g}` — {len(prompts)} Spec-Bench prompts\n")
    print("| depth | noise g | drafts | matched |\n|---|---|---|---|")
    for depth in (0, 1):
        for low, high in zip(BINS, BINS[1:]):
            hits = [m for d, g, m in seen if d == depth and low <= g < high]
            print(f"| {depth} | [{low:g}, {high:g}) | {len(hits)} | {sum(hits) / max(1, len(hits)):.3f} |")
        hits = [m for d, g, m in seen if d == depth]
        print(f"| {depth} | all | {len(hits)} | {sum(hits) / max(1, len(hits)):.3f} |")


if __name__ == "__main__":
    main()
