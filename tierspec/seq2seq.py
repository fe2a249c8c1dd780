"""Encoder–decoder models (transformers' T5-style ``AutoModelForSeq2SeqLM``) in the one decode
loop (docs/algorithms.md §Encoder-decoder models).

The prompt is the *source*: the encoder runs on it once per generation. The loop then decodes
the decoder's sequence, which starts with the model's decoder-start token, exactly as it decodes
a decoder-only model's sequence; every drafter and rule sees only decoder tokens.

    encode(source)                       # once: encoder states [1, S, H]
    context = [decoder_start]            # the committed decoder sequence
    while not done: draft, verify, commit, roll back  # the same loop, the same rules

Caches (``Seq2SeqCachedModel``): the decoder's self-attention KV is position-indexed and rolls
back exactly as ``cached_model.CachedModel``'s does (the same invariant, the same code); the
cross-attention KV is a function of the source alone, computed by the first pass that runs each
layer's cross-attention and kept until the next source.

Routing masks cover the decoder's units only (docs/algorithms.md §Encoder-decoder models says
why): a bypassed decoder block skips its self-attention, cross-attention and feed-forward; a
bypassed ``attn`` sub-layer is the block's self-attention (it writes no KV, as in a decoder-only
model); the cross-attention is kept in sub-layer masks; ``mlp`` is the feed-forward.
"""

from __future__ import annotations

import torch

from .cached_model import CachedModel, HiddenCapture, PassResult, SlimVocabulary, _growing_layer_class
from .errors import TierspecError
from .layerskip.masks import RoutingMask, apply_decoder_mask, decoder_blocks, model_lock
from .models import output_vocabulary_size


class Seq2SeqError(TierspecError):
    """Something an encoder–decoder model cannot do here; the message says what can."""


def is_encoder_decoder(model: torch.nn.Module) -> bool:
    return bool(getattr(getattr(model, "config", None), "is_encoder_decoder", False))


def decoder_layer_count(model: torch.nn.Module) -> int:
    return len(decoder_blocks(model))


def decoder_start(model: torch.nn.Module) -> torch.Tensor:
    """The decoder's first token [1] (T5: the pad token), from the generation config or the config."""
    for source in (getattr(model, "generation_config", None), model.config):
        value = getattr(source, "decoder_start_token_id", None)
        if isinstance(value, int):
            return torch.tensor([value])
    raise Seq2SeqError(f"{type(model).__name__} names no decoder_start_token_id in its config or generation config; "
                       "set it in config.json")


# -- the cached decoder ----------------------------------------------------------------------


class Seq2SeqCachedModel(CachedModel):
    """An encoder–decoder model's decoder with its own caches, run against one encoded source.

    ``cache`` is the decoder's self-attention cache: every method ``CachedModel`` has that reads
    or trims it (``rollback``, ``replay``, ``reserve``, ``layer_lengths``) works unchanged, with
    the same invariant: after every commit it holds KV for exactly the committed decoder tokens
    this model has processed. ``cross_cache`` holds each decoder layer's cross-attention KV,
    computed once per source and never rolled back. ``length`` counts decoder positions.
    """

    def __init__(self, model: torch.nn.Module, source_ids: torch.Tensor | None = None):
        if not is_encoder_decoder(model):
            raise Seq2SeqError(f"{type(model).__name__} is not an encoder–decoder model")
        self.encoder_states: torch.Tensor | None = None  # [1, S, H]
        self.source: torch.Tensor | None = None  # [S] int64
        self.cross_cache = None
        super().__init__(model)
        if source_ids is not None:
            self.encode(source_ids)

    def _new_cache(self):
        from transformers import DynamicCache

        cache = DynamicCache()
        cache.layers = [_growing_layer_class()() for _ in range(decoder_layer_count(self.model))]
        return cache

    def encode(self, source_ids: torch.Tensor) -> None:
        """Run the encoder on ``source_ids`` [S] (the one encoder pass of a generation) and start
        an empty decoder against it (new self- and cross-attention caches)."""
        from transformers import DynamicCache

        source_ids = torch.as_tensor(source_ids, dtype=torch.long).reshape(-1)
        if source_ids.numel() == 0:
            raise Seq2SeqError("the source is empty: give at least one token")
        with model_lock(self.model), torch.inference_mode():
            states = self.model.get_encoder()(input_ids=source_ids.unsqueeze(0).to(self.device)).last_hidden_state
        self.encoder_states = states
        self.source = source_ids.cpu()
        self.cross_cache = DynamicCache()
        self.reset()

    def reset(self) -> None:
        """An empty decoder against the same source (the cross-attention KV stays: it depends on
        the source only)."""
        self.cache = self._new_cache()
        self.length = 0

    def forward(self, token_ids: torch.Tensor, logits_for: int | None = None, mask=None, with_hidden: bool = False,
                hidden_layers: tuple[int, ...] = (), vocabulary: SlimVocabulary | None = None,
                offsets: torch.Tensor | None = None, attends: torch.Tensor | None = None):
        """Run decoder tokens ``token_ids`` [n] at positions ``length ..`` against the encoded
        source; logits [m, V] (float32, CPU) of the last m = ``logits_for`` (None: all n).

        As ``CachedModel.forward``: ``mask`` bypasses decoder units; ``with_hidden`` also returns
        the LM head's input [n, H] (after T5's output scaling where the config asks for it), with
        ``hidden_layers``' block outputs concatenated after it. Token trees and slim vocabularies
        are decoder-only features and are refused."""
        from transformers import EncoderDecoderCache

        if attends is not None or offsets is not None:
            raise Seq2SeqError("token-tree passes run on tierspec's own Llama forward only, not on encoder–decoder models")
        if vocabulary is not None:
            raise Seq2SeqError("a slim vocabulary needs a draft head, which encoder–decoder models do not have here")
        if self.encoder_states is None:
            raise Seq2SeqError("no source is encoded: call encode(source_ids) before decoding")
        n = int(token_ids.shape[0])
        keep = n if logits_for is None else logits_for
        aux: dict[int, torch.Tensor] = {}
        with model_lock(self.model):
            with apply_decoder_mask(self.model, mask):
                # hooks under the mask: a bypassed block's stand-in records what it passes on
                with HiddenCapture(self.model, hidden_layers) as capture:
                    # A fresh wrapper per pass: it marks the layers whose cross-attention KV is
                    # already in cross_cache, so those are read, never recomputed.
                    cache = EncoderDecoderCache(self.cache, self.cross_cache)
                    states = self.model.get_decoder()(input_ids=token_ids.unsqueeze(0).to(self.device),
                                                      encoder_hidden_states=self.encoder_states, cache=cache,
                                                      use_cache=True).last_hidden_state[0]
                    if hidden_layers:
                        _, aux = capture.take()
            if getattr(self.model.config, "scale_decoder_outputs", False):  # T5 v1.0 scales the tied LM head's input
                states = states * (self.model.config.d_model ** -0.5)
            logits = self.model.get_output_embeddings()(states[n - keep:]).float().cpu()
        self.length += n
        if not with_hidden:
            return PassResult(logits)
        hidden = torch.cat([states.float().cpu()] + [aux[i][0].float() for i in hidden_layers], dim=-1)
        return PassResult(logits, hidden)


def runner_for(model: torch.nn.Module, source_ids: torch.Tensor | None = None) -> CachedModel:
    """The cached model the loop runs ``model`` with: a ``Seq2SeqCachedModel`` on ``source_ids``
    for an encoder–decoder model, else a ``CachedModel``."""
    if is_encoder_decoder(model):
        return Seq2SeqCachedModel(model, source_ids)
    if source_ids is not None:
        raise Seq2SeqError(f"{type(model).__name__} is a decoder-only model: it takes no source")
    return CachedModel(model)


def measuring_runner(model: torch.nn.Module, source_tokens: int = 256) -> CachedModel:
    """A cached model for timing passes (``costs``): encoder–decoder models decode against a
    source of ``source_tokens`` tokens (cross-attention cost grows with the source)."""
    if not is_encoder_decoder(model):
        return CachedModel(model)
    return Seq2SeqCachedModel(model, torch.arange(source_tokens) % output_vocabulary_size(model))


# -- DIMR calibration ------------------------------------------------------------------------


def decoder_logits(model: torch.nn.Module, source_ids: torch.Tensor, decoder_ids: list[int]) -> torch.Tensor:
    """Logits [n + 1, V] after the decoder start token and each of ``decoder_ids`` [n] against
    ``source_ids`` (teacher-forced, one pass: a bench record's target NLL)."""
    tokens = torch.cat([decoder_start(model), torch.tensor(decoder_ids, dtype=torch.long)])
    with torch.inference_mode():
        return Seq2SeqCachedModel(model, source_ids).forward(tokens).logits


def window_logits(model: torch.nn.Module, sources: list[torch.Tensor], sequences: torch.Tensor, window: int,
                  mask: RoutingMask | None) -> torch.Tensor:
    """Logits [B·τ, V] of teacher-forced decoder ``sequences`` [B, W] against their ``sources``,
    predicting each row's last ``window`` tokens, with ``mask`` on the decoder (one cache-free
    pass per row: the sources differ in length)."""
    rows = []
    with torch.inference_mode():
        for source, sequence in zip(sources, sequences):
            runner = Seq2SeqCachedModel(model, source)
            logits = runner.forward(sequence, logits_for=window + 1, mask=mask).logits
            rows.append(logits[:-1])
    return torch.cat(rows)
