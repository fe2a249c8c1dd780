"""An independent causal LM as drafter (classic speculative decoding, Leviathan et al. 2023).

With the target itself as drafter it always agrees with the target: slow (every token costs a
full forward), but it lets ``--method sd`` work with no second model.
"""

from __future__ import annotations

import numpy as np
import torch

from ..cached_model import CachedModel
from ..errors import TierspecError
from ..proposal import DraftRequest
from ..seq2seq import Seq2SeqCachedModel, Seq2SeqError, is_encoder_decoder
from .base import Drafter, Proposal, draft_autoregressively, streamed_weights


class DrafterMismatchError(TierspecError):
    """The drafter cannot propose tokens in the target's vocabulary."""


def check_vocabularies(target, drafter) -> None:
    """Refuse a drafter whose token ids mean something else than the target's.

    ``target``/``drafter`` are LoadedModel. With tokenizers the vocabularies must map the same
    strings to the same ids; without (token-id models in tests) the vocabulary sizes must agree.
    """
    t_tok, d_tok = target.tokenizer, drafter.tokenizer
    if t_tok is not None and d_tok is not None:
        t_vocab, d_vocab = t_tok.get_vocab(), d_tok.get_vocab()
        if t_vocab != d_vocab:
            differing = len(set(t_vocab.items()) ^ set(d_vocab.items()))
            raise DrafterMismatchError(
                f"drafter '{drafter.identity.name}' has a different tokenizer from target "
                f"'{target.identity.name}' ({len(d_vocab)} vs {len(t_vocab)} tokens, {differing} entries differ); "
                "speculative decoding needs a drafter with the same vocabulary"
            )
        return
    if target.vocab_size != drafter.vocab_size:
        raise DrafterMismatchError(
            f"drafter vocabulary size {drafter.vocab_size} differs from the target's {target.vocab_size}; "
            "speculative decoding needs a drafter with the same vocabulary"
        )


class ModelDrafter(Drafter):
    """Drafts autoregressively with its own KV cache, rolled back to the committed prefix."""

    def __init__(self, model: torch.nn.Module, vocab_size: int | None = None):
        self.runner = CachedModel(model)
        # Logits wider than the target's vocabulary (padded embeddings) are cut to it.
        self.vocab_size = vocab_size or self.runner.vocab_size

    def start(self, prompt_ids, features=None, target_view=None) -> None:
        self.runner.reset()
        self._prefill_calls = 0
        if len(prompt_ids) > 1:
            self.runner.forward(prompt_ids[:-1], logits_for=1)
            self._prefill_calls = 1

    def propose(self, context: np.ndarray, request: DraftRequest) -> Proposal:
        calls, self._prefill_calls = self._prefill_calls, 0
        if request.budget <= 0:
            return Proposal.empty(calls)
        pending = torch.as_tensor(context[self.runner.length :])  # committed tokens this drafter has not seen

        def next_logits(tokens: torch.Tensor) -> torch.Tensor:
            return self.runner.forward(tokens, logits_for=1).logits[-1, : self.vocab_size]

        proposal = draft_autoregressively(next_logits, pending, request)
        proposal.drafter_calls += calls
        return proposal

    def commit(self, committed_length: int) -> None:
        self.runner.rollback(min(self.runner.length, committed_length - 1))

    def draft_step_weights(self) -> dict[str, int]:
        return {"model": streamed_weights(self.runner.model)}


# -- encoder–decoder drafters (``seq2seq``) ---------------------------------------------------


class Seq2SeqModelDrafter(ModelDrafter):
    """A small encoder–decoder model of the target's family drafting the decoder sequence: its
    own encoder runs once on the source (``set_source``), its decoder caches roll back as any
    drafter model's (``ModelDrafter``'s loop over them is unchanged)."""

    def __init__(self, model: torch.nn.Module, vocab_size: int | None = None):
        super().__init__(model, vocab_size)
        self.runner = Seq2SeqCachedModel(model)

    def set_source(self, source_ids: torch.Tensor | None) -> None:
        if source_ids is None:
            raise Seq2SeqError("an encoder–decoder drafter drafts for an encoder–decoder target only")
        self.runner.encode(source_ids)


def check_same_family(target, drafter) -> None:
    """Refuse a drafter model of the other kind (encoder–decoder vs decoder-only): a drafter
    reads the same context as the target, and the two kinds do not."""
    if is_encoder_decoder(target.model) != is_encoder_decoder(drafter.model):
        kinds = {True: "an encoder–decoder", False: "a decoder-only"}
        raise DrafterMismatchError(
            f"drafter '{drafter.identity.name}' is {kinds[is_encoder_decoder(drafter.model)]} model and target "
            f"'{target.identity.name}' is {kinds[is_encoder_decoder(target.model)]} one; use a drafter of the "
            "target's kind (for T5: a smaller T5 with the same vocabulary)")
