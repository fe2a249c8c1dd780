"""What 8-bit activations cost the default model's fidelity, scaled per block of 32 (the engine's int8
rows) or per row (one scale for a row's whole input: what would leave the products' float steps one
conversion and one FMA a block, docs/engine.md §AMX and 8-bit rows).

    python benchmarks/activation_scales.py [--per-category 1] [--tokens 384] [--out results/activation_scales.json]

The model is loaded with float32 rows (the file's values, no rounding of the activations) and its layers
run as torch operators (every product a ``QuantLinear.forward`` call; their logits are checked against the
engine's fused pass first). Each product's input is then rounded to 8 bits — x ≈ s·round(x/s), s =
max|x|/127 over each block of 32 or over the row — before the float32 product, for every product of the
layers and the LM head. Per Spec-Bench prompt (its first ``--tokens`` tokens, teacher-forced): the KL of each
rounding's next-token distribution to the unrounded one, and how often their top-1 tokens agree.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from tierspec.cached_model import CachedModel
from tierspec.data import load_prompts, select
from tierspec.models import load_model
from tierspec.prompting import encode_prompt
from tierspec.quant import QuantLinear
from tierspec.util import atomic_write_text

SCALINGS = ("block", "row")


def rounded(x: torch.Tensor, per_row: bool) -> torch.Tensor:
    """``x`` [..., K] rounded to 8 bits as the engine rounds a row's blocks of 32 (or the whole row)."""
    rows = x.reshape(-1, x.shape[-1]).float()
    groups = rows[:, None, :] if per_row else rows.reshape(rows.shape[0], -1, 32)
    scale = groups.abs().amax(-1, keepdim=True) / 127
    scale = torch.where(scale == 0, torch.ones_like(scale), scale)
    return (torch.round(groups / scale).clamp(-127, 127) * scale).reshape(x.shape)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--per-category", type=int, default=1)
    parser.add_argument("--tokens", type=int, default=384)
    parser.add_argument("--out", type=Path, default=Path("results/activation_scales.json"))
    args = parser.parse_args()
    torch.set_grad_enabled(False)
    target = load_model("smollm2-135m", dtype="float32")
    model = target.model
    scaling: dict[str, str | None] = {"now": None}
    original = QuantLinear.forward

    def forward(self, x):
        if scaling["now"] is not None:
            x = rounded(x, scaling["now"] == "row")
        return original(self, x)

    probe = encode_prompt(target, "The quick brown fox jumps over the lazy dog. " * 4)
    fused = CachedModel(model).forward(probe, logits_for=len(probe)).logits.float()
    for layer in model.model.layers:
        layer.fused = None  # the layers as torch operators: every product a QuantLinear.forward call
    QuantLinear.forward = forward
    try:
        plain = CachedModel(model).forward(probe, logits_for=len(probe)).logits.float()
        gap = float((fused - plain).abs().max())
        if gap > 1e-2:
            sys.exit(f"the torch operators' logits part from the engine's by {gap}: not the same model")
        totals = {name: {"kl": 0.0, "agree": 0, "positions": 0} for name in SCALINGS}
        prompts = select(load_prompts("spec_bench"), per_category=args.per_category, seed=5)
        for prompt in prompts:
            ids = encode_prompt(target, prompt.text)[: args.tokens]
            logits = {}
            for name in (None, *SCALINGS):
                scaling["now"] = name
                logits[name] = CachedModel(model).forward(ids, logits_for=len(ids)).logits.float().log_softmax(-1)
            reference = logits[None]
            for name in SCALINGS:
                kl = (reference.exp() * (reference - logits[name])).sum(-1)
                totals[name]["kl"] += float(kl.sum())
                totals[name]["agree"] += int((logits[name].argmax(-1) == reference.argmax(-1)).sum())
                totals[name]["positions"] += len(ids)
            print(f"{prompt.id}: {len(ids)} positions", file=sys.stderr, flush=True)
    finally:
        QuantLinear.forward = original
    rows = [{"scaling": name, "positions": t["positions"], "kl_nats_per_token": round(t["kl"] / t["positions"], 5),
             "top1_agreement": round(t["agree"] / t["positions"], 4)} for name, t in totals.items()]
    lines = [f"`{' '.join(['python benchmarks/activation_scales.py'] + sys.argv[1:])}`: smollm2-135m's float32 rows, "
             f"{len(prompts)} Spec-Bench prompts teacher-forced (the torch operators within {gap:.1e} of the engine's "
             "logits):", "", "| 8-bit activations scaled per | positions | KL to unrounded, nats a token | top-1 agreement |",
             "|---|---|---|---|"]
    lines += [f"| {r['scaling']} | {r['positions']} | {r['kl_nats_per_token']} | {r['top1_agreement']} |" for r in rows]
    print("\n".join(lines))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(args.out, json.dumps({"command": " ".join(sys.argv), "torch_vs_engine_max_diff": gap,
                                            "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
