"""The judge head: a linear classifier on features the verification pass already computes.

Features (``kind``):
  hidden          the target's final hidden state at the drafted token's position (the paper)
  hidden+logprob  that, plus log q(x) and the entropy of q at the position that predicted x
                  (both read off the logits the same pass produced)

Saved as safetensors (weight, bias, feature mean/std) plus JSON metadata: model identity,
hidden size, feature kind, threshold, training-data hash and validation metrics. Loading onto
another model is refused.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..errors import TierspecError
from ..identity import ModelIdentity
from ..util import atomic_write, atomic_write_text

FEATURE_KINDS = ("hidden", "hidden+logprob")
HEAD_FORMAT = "tierspec-judge-head"


class JudgeHeadError(TierspecError):
    pass


def judge_features(hidden: torch.Tensor, prev_logits: torch.Tensor, tokens: torch.Tensor, kind: str) -> torch.Tensor:
    """Features [n, F] for tokens [n] with hidden states at their positions [n, H] and the
    logits [n, V] of the positions that predicted them."""
    if kind == "hidden":
        return hidden.float()
    if kind == "hidden+logprob":
        logprobs = prev_logits.float().log_softmax(-1)
        token_logprob = logprobs[torch.arange(len(tokens)), tokens].unsqueeze(-1)
        entropy = -(logprobs.exp() * logprobs).sum(-1, keepdim=True)
        return torch.cat([hidden.float(), token_logprob, entropy], dim=-1)
    raise JudgeHeadError(f"unknown feature kind '{kind}'; choose one of: {', '.join(FEATURE_KINDS)}")


@dataclass
class JudgeHead:
    weight: torch.Tensor  # [F], applied to standardised features
    bias: float
    mean: torch.Tensor  # [F]
    std: torch.Tensor  # [F]
    kind: str
    threshold: float
    model: ModelIdentity | None = None
    metadata: dict = field(default_factory=dict)

    def probability(self, features: torch.Tensor) -> torch.Tensor:
        """sigmoid(head logit) [n]: the judge's belief that each token is acceptable."""
        return torch.sigmoid(((features - self.mean) / self.std) @ self.weight + self.bias)

    def save(self, path: str | Path) -> None:
        from safetensors.torch import save_file

        path = Path(path)
        tensors = {"weight": self.weight.contiguous(), "bias": torch.tensor([self.bias]), "mean": self.mean.contiguous(),
                   "std": self.std.contiguous()}
        atomic_write(path, lambda staging: save_file(tensors, str(staging)))
        meta = {"format": HEAD_FORMAT, "kind": self.kind, "threshold": self.threshold,
                "model": self.model.to_dict() if self.model else None, "hidden_size": self.model.hidden_size if self.model else None,
                **self.metadata}
        atomic_write_text(path.with_suffix(".json"), json.dumps(meta, indent=2))

    @classmethod
    def load(cls, path: str | Path, model: ModelIdentity | None = None) -> "JudgeHead":
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        path = Path(path)
        meta_path = path.with_suffix(".json")
        if not path.exists():
            raise JudgeHeadError(f"judge head {path} does not exist (train one with `tierspec judge train`)")
        try:
            tensors = load_file(str(path))
            meta = json.loads(meta_path.read_text())
        except (SafetensorError, OSError, json.JSONDecodeError, ValueError) as error:
            raise JudgeHeadError(f"cannot read judge head {path} (+ {meta_path.name}): {error}") from None
        if meta.get("format") != HEAD_FORMAT or not {"weight", "bias", "mean", "std"} <= set(tensors):
            raise JudgeHeadError(f"{path} is not a tierspec judge head")
        identity = ModelIdentity(**meta["model"]) if meta.get("model") else None
        head = cls(tensors["weight"], float(tensors["bias"][0]), tensors["mean"], tensors["std"], meta["kind"],
                   float(meta["threshold"]), identity,
                   {k: v for k, v in meta.items() if k not in ("format", "kind", "threshold", "model", "hidden_size")})
        if model is not None and identity is not None and not identity.matches(model):
            raise JudgeHeadError(
                f"this judge head was trained on '{identity.name}' (hidden {identity.hidden_size}), not on "
                f"'{model.name}' (hidden {model.hidden_size})"
            )
        return head
