"""The pass backend: how a cycle's verifier passes run, one interface for a batch of one and many.

A cycle of the decode loop gathers one ``PassRequest`` per sequence (its new rows on its own cache)
and hands them to the model's ``PassBackend`` at once:

* ``EnginePasses`` (a model on the pass engine): every request's rows in **one** pass — the
  products over all rows at once, each sequence's attention over its own cache
  (``cached_model.batched_pass``), a lone request too; where a module carries a forward hook, which only a
  module call runs, each request as its cache's own pass.
* ``SequentialPasses`` (transformers models, encoder–decoder models, tierspec's torch forward): each
  request as its cache's own pass, one after another. VIA-SD's tiered rule drives passes of its own
  through its verifiers, which run the same way.

Either gives each request exactly (bitwise) the ``PassResult`` its cache's own ``forward`` gives:
the engine's products are row-independent and nothing of one sequence reaches another's rows,
which is what lets a generation's text not depend on what shares its pass (docs/algorithms.md
§Batched generation).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

import torch

from .cached_model import BatchItem, CachedModel, PassResult, RowDraws, batched_pass, runs_as_one_stack


@dataclass(slots=True)
class PassRequest:
    """One sequence's part of a cycle's pass: ``tokens`` [n] run on ``runner``'s cache from its
    length (int64, or a list of ints: a chain's, joined from the committed tokens' and the drafter's
    lists, as the engine's batched pass takes them), the last ``logits_for`` rows scored; a token
    tree's position ``offsets`` [n] and ``attends`` [n, n] (None for a chain); ``hidden_layers``: None
    for no hidden states, else the final hidden states [n, H] followed by those decoder layers'
    outputs (``CachedModel.forward(with_hidden=True, hidden_layers=...)``); ``draws``: the keyed draws
    the pass may make of the scored rows (``cached_model.RowDraws``; a backend that cannot returns none);
    ``hidden_into``: where the pass may write those hidden states ([n, width] float32 contiguous: a
    chain's or a prefill chunk's rows of the generation's feature log, ``FeatureLog.rows_at``), so that its commit copies
    nothing (a backend that cannot returns its own, and the commit copies them)."""

    runner: CachedModel
    tokens: torch.Tensor | list[int]
    logits_for: int
    offsets: torch.Tensor | None = None
    attends: torch.Tensor | None = None
    hidden_layers: tuple[int, ...] | None = None
    draws: RowDraws | None = None
    hidden_into: torch.Tensor | None = None

    @property
    def rows(self) -> int:
        return len(self.tokens) if isinstance(self.tokens, list) else int(self.tokens.shape[0])

    @property
    def token_tensor(self) -> torch.Tensor:
        """``tokens`` as an int64 tensor [n] (what a solo pass takes)."""
        return torch.tensor(self.tokens, dtype=torch.long) if isinstance(self.tokens, list) else self.tokens


class PassBackend(Protocol):
    """Runs a cycle's requests (each on its own cache) and returns their results in order.
    ``shares_passes``: whether several requests share one pass's products (then a pass's cost
    is paid once by them all, and a batch sizes drafts by the rows it adds)."""

    shares_passes: bool

    def run(self, requests: Sequence[PassRequest]) -> list[PassResult]:
        ...


def _solo(request: PassRequest) -> PassResult:
    """``request`` as its cache's own pass."""
    return request.runner.forward(request.token_tensor, logits_for=request.logits_for,
                                  with_hidden=request.hidden_layers is not None,
                                  hidden_layers=request.hidden_layers or (), offsets=request.offsets,
                                  attends=request.attends)


class SequentialPasses:
    """Each request as its cache's own pass, one after another."""

    shares_passes = False

    def run(self, requests: Sequence[PassRequest]) -> list[PassResult]:
        return [_solo(request) for request in requests]


class EnginePasses:
    """Every request of a cycle in one pass on the engine (``cached_model.batched_pass``), a lone
    request too: the same result as its cache's own pass with less Python around the engine's call
    (a one-row pass of the default model 0.52–0.55 → 0.44 ms outside the engine's calls on a Zen 4,
    ``benchmarks/pass_python.py``, docs/history.md). Where a module of the model carries a forward hook, which only a
    module call runs (``cached_model.runs_as_one_stack``), every request runs as its cache's own pass, one after
    another: the same results, and the hooks see every pass (the batch's draft lengths still cost its rows as
    shared)."""

    shares_passes = True

    def __init__(self, model: torch.nn.Module):
        self.model = model

    def run(self, requests: Sequence[PassRequest]) -> list[PassResult]:
        if not runs_as_one_stack(self.model):  # a hook only a module call runs: each request's own pass
            return [_solo(request) for request in requests]
        wanted = [r.hidden_layers for r in requests if r.hidden_layers is not None]
        captured = tuple(sorted({layer for layers in wanted for layer in layers})) if wanted else None
        # A request's hidden states land in its ``hidden_into`` where they are the batch's very blocks.
        items = [BatchItem(r.runner, r.tokens, r.logits_for, r.offsets, r.attends, r.draws,
                           r.hidden_into if r.hidden_layers == captured else None) for r in requests]
        results = batched_pass(self.model, items, captured)
        hidden_size = int(self.model.config.hidden_size)
        return [_own_hidden(result, captured, request.hidden_layers, hidden_size)
                for result, request in zip(results, requests)]


def _own_hidden(result: PassResult, captured: tuple[int, ...] | None, wanted: tuple[int, ...] | None,
                hidden_size: int) -> PassResult:
    """A batched pass's result with the hidden-state blocks one request asked for (the final
    states, then its layers in its own order), as its solo pass returns them."""
    if wanted is None:
        return PassResult(result.logits, None, result.first_maxima, result.keyed_draws)
    if result.hidden is None or tuple(wanted) == captured:
        return result
    blocks = [result.hidden[:, :hidden_size]]
    for layer in wanted:
        at = 1 + captured.index(layer)
        blocks.append(result.hidden[:, at * hidden_size : (at + 1) * hidden_size])
    return PassResult(result.logits, torch.cat(blocks, dim=-1), result.first_maxima, result.keyed_draws)


def pass_backend(model: torch.nn.Module) -> PassBackend:
    """The backend ``model``'s cycles run their passes on."""
    from .engine import runs_on_engine

    return EnginePasses(model) if runs_on_engine(model) else SequentialPasses()
