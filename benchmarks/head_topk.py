"""How often the target's greedy token is among the shipped draft head's top 1 / 2 / 4 / 8 at draft
positions 1..4 (issue 20: what a token tree can recover that a chain cannot).

    python benchmarks/head_topk.py            # 24 Spec-Bench prompts (4 per category), 64 greedy tokens each

For each prompt the target writes 64 greedy tokens; then every generated position is a draft start,
as in the decode loop: the head has read the target's features of the committed positions, drafts
position 1 from its catch-up output, and each further position from its own predicted feature, fed
the *target's* tokens along the way (the path a tree must contain to be accepted that far). Two rates
per (position i, k):

- ``teacher``: the target's token is in the head's top k at position i, the path before it fed as the
  target's tokens whatever the head ranked them (how good the head is at depth i);
- ``chained``: the same, among the starts whose positions 1..i−1 were all in the top k too (for
  k = 1 this is the chain's acceptance by position; for k > 1, the conditional acceptance of a
  full k-ary tree's depth i), and ``reach``: the share of starts where positions 1..i all were —
  the expected accepted length of a full k-ary tree of depth 4 is the sum of the reaches.

Writes ``results/head_topk/summary.json`` and ``summary.md``.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from tierspec.cached_model import CachedModel
from tierspec.data import load_prompts, select
from tierspec.heads.draft import HeadRunner
from tierspec.methods import MethodOptions, draft_head_for
from tierspec.models import load_model
from tierspec.prompting import encode_prompt
from tierspec.util import atomic_write_text

ROOT = Path(__file__).resolve().parents[1]
KS = (1, 2, 4, 8)


def greedy_run(target, prompt_ids: torch.Tensor, new_tokens: int, feature_layers: tuple[int, ...]):
    """The target's greedy continuation [new_tokens] and its features f_t of every position of
    prompt + continuation [n, feature_width] (one pass over the whole sequence)."""
    runner = CachedModel(target.model)
    runner.reserve(len(prompt_ids) + new_tokens + 1)
    logits = runner.forward(prompt_ids, logits_for=1).logits
    out = []
    for _ in range(new_tokens):
        token = int(logits[-1].argmax())
        out.append(token)
        logits = runner.forward(torch.tensor([token])).logits
    sequence = torch.cat([prompt_ids, torch.tensor(out)])
    runner.reset()
    features = runner.forward(sequence, logits_for=1, with_hidden=True, hidden_layers=feature_layers).hidden
    return torch.tensor(out), sequence, features


def hits_for_prompt(head, sequence: torch.Tensor, features: torch.Tensor, prompt_length: int, depth: int) -> torch.Tensor:
    """hit[s, i, j]: at draft start s (pending position p = prompt_length − 1 + s), is the target's
    token at p + 1 + i among the head's top KS[j]? [starts, depth, len(KS)] bool."""
    runner = HeadRunner(head)
    draft_ids = head.draft_ids.cpu()
    rank_of = torch.full((head.config.vocab_size,), -1, dtype=torch.long)
    n = len(sequence)
    # The head over every committed position, fed the target's features: output t ≈ f_{t+1}.
    outputs = runner.extend(features[: n - 1], sequence[1:n], from_target=True)  # [n − 1, H]
    rows = []
    for p in range(prompt_length - 1, n - 1 - depth):
        runner.rollback(p)  # the head holds positions 0 .. p − 1 (target features)
        h = outputs[p - 1 : p]
        row = []
        for i in range(depth):
            order = runner.logits(h)[0].argsort(descending=True)[: max(KS)]
            rank_of.fill_(-1)
            rank_of[draft_ids[order]] = torch.arange(len(order))
            rank = int(rank_of[sequence[p + 1 + i]])
            row.append([0 <= rank < k for k in KS])
            if i + 1 < depth:
                h = runner.extend(h, sequence[p + 1 + i : p + 2 + i])  # self-fed, the target's token
        rows.append(row)
    return torch.tensor(rows, dtype=torch.bool)


def summarise(hits: torch.Tensor) -> dict:
    """Rates by position and k (see the module docstring) from hit [starts, depth, len(KS)]."""
    reach = hits.int().cumprod(dim=1).bool()  # positions 1..i all hit
    table = {}
    for j, k in enumerate(KS):
        rows = []
        for i in range(hits.shape[1]):
            before = reach[:, i - 1, j] if i else torch.ones(len(hits), dtype=torch.bool)
            rows.append({
                "position": i + 1,
                "teacher": round(float(hits[:, i, j].float().mean()), 4),
                "chained": round(float(hits[before, i, j].float().mean()), 4) if before.any() else None,
                "reach": round(float(reach[:, i, j].float().mean()), 4),
            })
        table[str(k)] = {"positions": rows, "expected_accepted": round(float(reach[:, :, j].float().sum(1).mean()), 4)}
    return table


def markdown(summary: dict) -> str:
    depth = len(summary["top_k"]["1"]["positions"])
    lines = [
        "## The draft head's top-k against the target's greedy token",
        "",
        f"`python benchmarks/head_topk.py` — {summary['prompts']} Spec-Bench prompts ({summary['per_category']} per category), "
        f"{summary['new_tokens']} greedy tokens each, {summary['starts']} draft starts; {summary['seconds']:.0f} s.",
        "",
        "teacher: the target's token is in the head's top k at position i, the path before it the target's tokens; "
        "chained: the same given positions 1..i−1 were in the top k too (k = 1: a chain's acceptance by position); "
        "reach: positions 1..i all in the top k (a full k-ary tree's acceptance of depth i). E[accepted] of a "
        f"full k-ary tree of depth {depth} = the sum of the reaches.",
        "",
        "| k | " + " | ".join(f"pos {i + 1} teacher / chained / reach" for i in range(depth)) + " | E[accepted] |",
        "|---|" + "---|" * (depth + 1),
    ]
    for k, entry in summary["top_k"].items():
        cells = [f"{r['teacher']:.2f} / {r['chained']:.2f} / {r['reach']:.2f}" for r in entry["positions"]]
        lines.append(f"| {k} | " + " | ".join(cells) + f" | {entry['expected_accepted']:.2f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--per-category", type=int, default=4)
    parser.add_argument("--limit", type=int, default=None)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--out", default=str(ROOT / "results" / "head_topk"))
    args = parser.parse_args()
    started = time.perf_counter()
    target = load_model("smollm2-135m")
    head = draft_head_for(target, MethodOptions())
    prompts = select(load_prompts("spec_bench"), per_category=args.per_category)[: args.limit]
    all_hits = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = encode_prompt(target, prompt.text)
            _, sequence, features = greedy_run(target, ids, args.new_tokens, head.config.feature_layers)
            all_hits.append(hits_for_prompt(head, sequence, features, len(ids), args.depth))
            print(prompt.id, prompt.category, f"top-1 at position 1: {float(all_hits[-1][:, 0, 0].float().mean()):.2f}",
                  flush=True)
    hits = torch.cat(all_hits)
    summary = {"prompts": len(prompts), "per_category": args.per_category, "new_tokens": args.new_tokens,
               "starts": int(hits.shape[0]), "seconds": round(time.perf_counter() - started, 1),
               "prompt_ids": [p.id for p in prompts], "top_k": summarise(hits)}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out / "summary.json", json.dumps(summary, indent=1) + "\n")
    atomic_write_text(out / "summary.md", markdown(summary))
    print(markdown(summary))


if __name__ == "__main__":
    main()
