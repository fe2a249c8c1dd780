"""What a slim-verifier pass costs, per routing mask, as a fraction of a full pass.

For every mask in ``masks/`` (and the compute-weighted ones given with ``--masks``), times a
cached pass of the default model over 1 and 3 new tokens at a 300-token context, with the full
LM head and with the draft head's vocabulary only (``--slim-vocabulary draft-head``), against
the full pass, all interleaved (each repeat runs every variant once, in a rotated order) so that
the machine's load hits all alike; medians. Also prints the share of the pass's weights each
mask bypasses (attention and MLP sub-layers; the LM head is never bypassed, only narrowed).

    python benchmarks/slim_costs.py [--repeats 40]

Writes results/slim_costs.json and results/slim_costs.md (masks/README.md and docs/history.md quote it).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from tierspec import load_model
from tierspec.cached_model import CachedModel, SlimVocabulary
from tierspec.costs import few_row_threads
from tierspec.heads.shipped import shipped_head
from tierspec.layerskip.masks import RoutingMask
from tierspec.util import atomic_write_text

ROOT = Path(__file__).resolve().parents[1]


def weight_shares(model: torch.nn.Module, mask: RoutingMask | None, vocab_rows: int | None) -> float:
    """Share of the pass's matrix weights (decoder sub-layers + LM head rows scored) that the
    mask and the vocabulary leave out, counted from the model's shapes (its config): on the pass
    engine the layers hold no torch parameters (the weights are the engine's blocks), so counting
    parameters read 0 for every mask."""
    config = model.config
    hidden, layers = config.hidden_size, config.num_hidden_layers
    head_dim = getattr(config, "head_dim", None) or hidden // config.num_attention_heads
    queries, keys = config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim
    attention = hidden * queries + 2 * hidden * keys + queries * hidden  # q, k, v, o
    mlp = 3 * hidden * config.intermediate_size  # gate, up, down
    head = config.vocab_size * hidden
    full = layers * (attention + mlp) + head
    skipped = 0
    if mask is not None:
        skipped += len(mask.skip_attention) * attention + len(mask.skip_mlp) * mlp
    if vocab_rows is not None:
        skipped += head - vocab_rows * hidden
    return skipped / full


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=40)
    parser.add_argument("--masks", nargs="*", default=None, help="mask files (default: every masks/*.json)")
    parser.add_argument("--out", type=Path, default=ROOT / "results" / "slim_costs.json")
    args = parser.parse_args()
    torch.set_num_threads(2)
    target = load_model("smollm2-135m")
    few_row_threads(target)  # the threads a generation's few-row products run on, as the decode loop settles them
    head = shipped_head(target)
    vocabulary = SlimVocabulary(target.model, head.draft_ids)
    paths = [Path(p) for p in args.masks] if args.masks else sorted((ROOT / "masks").glob("*.json"))
    masks = {"none": None, **{p.stem: RoutingMask.load(p, target.identity) for p in paths}}
    variants = [(name, vocab) for name in masks for vocab in ("full", "draft-head")]
    torch.manual_seed(0)
    context = torch.randint(0, target.vocab_size, (300,))
    runner = CachedModel(target.model)
    samples: dict[tuple, list[float]] = {(name, vocab, n): [] for name, vocab in variants for n in (1, 3)}
    with torch.inference_mode():
        runner.forward(context, logits_for=1)
        for repeat in range(args.repeats + 2):
            order = variants[repeat % len(variants):] + variants[: repeat % len(variants)]
            for name, vocab in order:
                for n in (1, 3):
                    started = time.perf_counter()
                    runner.forward(context[:n], logits_for=n, mask=masks[name],
                                   vocabulary=vocabulary if vocab == "draft-head" else None)
                    seconds = time.perf_counter() - started
                    runner.rollback(300)
                    if repeat >= 2:  # the first two rounds warm every shape
                        samples[(name, vocab, n)].append(seconds)
    full = {n: statistics.median(samples[("none", "full", n)]) for n in (1, 3)}
    rows = []
    for name, vocab in variants:
        mask = masks[name]
        rows.append({
            "mask": name, "vocabulary": vocab,
            "units_bypassed": 0 if mask is None else len(mask.bypassed_units()),
            "unit_ratio": 0.0 if mask is None else round(mask.ratio, 3),
            "weights_skipped": round(weight_shares(target.model, mask, len(head.draft_ids) if vocab == "draft-head" else None), 3),
            **{f"ms_{n}_tokens": round(1000 * statistics.median(samples[(name, vocab, n)]), 2) for n in (1, 3)},
            **{f"fraction_{n}_tokens": round(statistics.median(samples[(name, vocab, n)]) / full[n], 3) for n in (1, 3)},
        })
    lines = ["## What a slim-verifier pass costs", "",
             f"`python benchmarks/slim_costs.py --repeats {args.repeats}` — cached passes of the default model at a "
             "300-token context, medians of interleaved repeats; fraction = the slim pass's time ÷ a full pass over the "
             "same number of tokens. Draft-head vocabulary: the LM head scores the draft head's "
             f"{len(head.draft_ids)} tokens instead of {target.vocab_size}.", "",
             "| mask | vocabulary | units bypassed (ratio) | weights skipped | 1 token ms | fraction | 3 tokens ms | fraction |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['mask']} | {r['vocabulary']} | {r['units_bypassed']} ({r['unit_ratio']}) | "
                     f"{r['weights_skipped']:.3f} | {r['ms_1_tokens']} | {r['fraction_1_tokens']:.3f} | "
                     f"{r['ms_3_tokens']} | {r['fraction_3_tokens']:.3f} |")
    atomic_write_text(args.out, json.dumps({"repeats": args.repeats, "rows": rows}, indent=2))
    atomic_write_text(args.out.with_suffix(".md"), "\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
