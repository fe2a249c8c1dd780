"""What every drafter is to the decode loop: it proposes a token tree (a chain of drafts for most)
and, when it has one, the distribution each token was drawn from (``proposal.Proposal``).

Drafters keep only their own state (their own KV cache, a lookup table, a draft head's cache).
What they need from the target comes through the loop, owned by the loop's verifiers: the
target's features of committed positions (``FeatureLog``, read by a draft head) and, for
self-speculative drafting, a ``TargetDraftView`` onto the target's cache.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Callable, ClassVar, Generator

import numpy as np
import torch

from ..heads.draft import HeadOutput, HeadStep, run_head_steps
from ..proposal import DraftRequest, Proposal, Shape
from ..sampling import all_finite, greedy_choice, logits_to_probs, top_probability


class DraftEverything:
    """A ``PolicyView`` that never stops a drafting model early (a drafter drafting for itself,
    outside a method's policy: PEARL's thread until cancelled, tests)."""

    def keep_drafting(self, confidences: list[float], source: str = "") -> bool:
        return True


class FeatureLog:
    """The target's features by position of the committed sequence: the one record of them.

    Row t holds the LM head's input f_t [H] of position t, followed by the outputs of the decoder
    layers a draft head fuses (width H·(1 + layers)), float32. The verifier passes that compute
    features write them (``decode.Verifiers``: no extra pass); a draft head reads the rows of
    committed positions, ``0 .. length − 1``, and keeps no copy. Rows past ``length`` belong to
    a pass whose verdict is not committed yet (or was rolled back): not readable. A row written
    by a slim-verifier pass (VIA-SD) is the slim model's feature until a full pass rewrites it.

    The rows are allocated once for every position a generation can reach (a rollback only
    moves ``length``). A cycle whose drafter wants no features (``Drafter.wants_features``: a
    draft head that will not run soon) commits positions without rows: the readable rows are
    then ``start .. length − 1``, those after the last such commit."""

    def __init__(self, positions: int, width: int):
        self._rows = torch.empty(positions, width, dtype=torch.float32)  # [positions, W], as passes give them
        self.length = 0  # committed positions
        self.start = 0  # the first committed position with a row (every later committed one has one)

    @property
    def width(self) -> int:
        return int(self._rows.shape[1])

    def write(self, start: int, values: torch.Tensor) -> None:
        """Features [n, W] of positions ``start`` .. ``start`` + n − 1 (committed or not yet)."""
        end = start + int(values.shape[0])
        if end > self._rows.shape[0]:
            raise ValueError(f"features of positions up to {end} do not fit the log's {self._rows.shape[0]} "
                             "(the generation's positions were reserved too short)")
        self._rows[start:end] = values

    def rows_at(self, start: int, count: int) -> torch.Tensor | None:
        """The log's rows of positions ``start`` .. ``start`` + count − 1 [count, W] (a view), for a
        pass to write its features into (``passes.PassRequest.hidden_into``): a chain's commit, or a
        prefill chunk's result, then writes nothing (``verifiers.PassRecord.in_place``). Why: that copy, a torch operator after the weights' stream has evicted the
        caches, cost 46–51 µs a cycle on a Zen 4 (a /tmp probe in the default method's cycles). None
        where they do not all fit (padding rows past the reserved positions)."""
        return self._rows[start : start + count] if start + count <= self._rows.shape[0] else None

    def commit(self, length: int, written: bool = True) -> None:
        """Positions ``0 .. length − 1`` are committed; the ones committed now have their rows
        written, or (``written`` False) none: no row before ``length`` is readable then."""
        if not written and length > self.length:
            self.start = length
        self.length = length
        self.start = min(self.start, length)  # a rollback below the gap: nothing after it is unwritten

    def read(self, start: int, end: int) -> torch.Tensor:
        """Features [end − start, W] of committed positions ``start .. end − 1`` (a view: valid
        until the next pass writes)."""
        if not self.start <= start <= end <= self.length:
            raise ValueError(f"features of positions {start}..{end - 1} are not committed rows of the log (it holds "
                             f"positions {self.start} <= p < {self.length})")
        return self._rows[start:end]


class TargetDraftView(ABC):
    """What a self-speculative drafter may do with the target's cache (owned by the loop's
    verifiers): run masked passes on top of the committed full-model KV, then discard them."""

    @abstractmethod
    def forward(self, tokens: torch.Tensor, mask) -> torch.Tensor:
        """Logits [V] after ``tokens`` under ``mask``, appended to the draft's scratch KV."""

    @abstractmethod
    def discard(self) -> None:
        """Drop every position the draft appended (the cache is as the last commit left it)."""

    @property
    @abstractmethod
    def length(self) -> int:
        """Committed positions the target's cache holds (the draft starts after them)."""

    @abstractmethod
    def replay_window(self, start: int, tokens: torch.Tensor, mask) -> torch.Tensor:
        """Logits [n, V] of committed ``tokens`` re-run at positions start.. under ``mask``,
        reading the full-model KV before ``start``; the cache is restored afterwards (SWIFT)."""

    @abstractmethod
    def full_model_cache(self):
        """The target's ``CachedModel`` holding the full model's KV of the first ``length``
        committed positions only (KV a slim pass added beyond them is dropped), for a drafter
        that reads it in place and leaves it as it found it (CLaSP's layer selection)."""


class Drafter:
    """Base class: proposes a token tree continuing the committed ``context`` — a chain of at most
    ``request.budget`` drafts for a chain drafter (``proposes`` = ``Shape.CHAIN``), a tree no deeper
    than that for a tree drafter. ``context`` is the committed tokens [n], an int64 numpy array: a
    view of the generation's buffer (``verifiers.CommittedTokens.array``), valid for the call, read
    and never written; a drafter that runs a model on it takes ``torch.as_tensor(context)`` (the same
    memory). A numpy view, not a tensor: the cycle hands one to every sequence, and a tensor view
    made and freed each time cost 4 µs a sequence in a batch of 8, 30 µs after a lone pass on a
    Zen 4 (caches cold), where the n-gram lookup and the draft head need a slice or two.

    A drafter that samples draws draft token i with the block's token noise (``noise.token(i,
    probs)``, or ``Noise.argmax`` of its log-probabilities), the noise the target's own token at
    that position is drawn with: the drafts are then a function of the seed, and under the coupled
    rule a draft is kept whenever drafter and target choose the same token.

    The loop calls ``start`` once per generation with the prompt, the generation's
    ``FeatureLog`` (when ``needs_target_features``: read it in ``propose``, it grows as tokens
    are committed) and, for drafters with ``uses_target_cache``, a ``TargetDraftView``; then per
    cycle ``propose`` and, after the verdict is committed, ``commit`` with the new committed
    length (the drafter rolls its own state back to it, docs/algorithms.md §The decode loop).
    A drafter never holds the method's policy: it reads it through ``request.policy``.
    """

    proposes: ClassVar[Shape] = Shape.CHAIN
    #: the drafter drafts in head steps (``drafting``), which a cycle runs for every such sequence at once
    drafts_in_head_steps: ClassVar[bool] = False
    #: its drafts come with the distribution each was drawn from (and its confidence): what a lossy
    #: rule's gates read (cascade's deferral, VIA-SD's δ1, BiLD's fallback); n-gram lookup has none
    has_distribution: ClassVar[bool] = True
    needs_target_features = False
    feature_layers: tuple[int, ...] = ()  # decoder layers whose outputs the drafter reads beside f
    uses_target_cache = False

    @property
    def feature_history(self) -> int | None:
        """With ``needs_target_features``: how many of the prompt's last positions' features the
        drafter can read (None: all of them). The prefill logs those rows only (``Verifiers``):
        a long prompt's rows are 2,304 floats a position on the default model, written once and
        never read."""
        return None

    def start(self, prompt_ids: torch.Tensor, features: FeatureLog | None = None,
              target_view: TargetDraftView | None = None) -> None:
        pass

    def set_source(self, source_ids: torch.Tensor | None) -> None:
        """The loop calls this before ``start``: an encoder–decoder generation's source tokens [S]
        (the encoder's input, while ``prompt_ids`` and the context are decoder tokens), None for
        a decoder-only target. Drafters that read the source (an encoder–decoder drafter model,
        prompt lookup) keep it; the others have nothing to do with it."""

    def propose(self, context: np.ndarray, request: DraftRequest) -> Proposal:
        raise NotImplementedError

    def wants_features(self) -> bool:
        """Whether this cycle's verifier pass should record the target's features (asked after
        ``propose``; by default, whether it ``needs_target_features`` at all). A drafter whose
        features are not wanted for a while says no: the pass then skips copying them out and the
        log has no rows for those positions (``FeatureLog.start``)."""
        return self.needs_target_features

    def drafting(self, context: np.ndarray, request: DraftRequest) -> Generator[HeadStep, HeadOutput, Proposal]:
        """``propose`` as the draft head's steps (``drafts_in_head_steps`` drafters): yields each
        ``heads.draft.HeadStep``, is sent its ``HeadOutput``, returns the proposal."""
        raise NotImplementedError(f"{type(self).__name__} does not draft in head steps")

    def commit(self, committed_length: int) -> None:
        pass

    def draft_step_weights(self) -> dict[str, int]:
        """Bytes of weights one draft step reads, per source the drafter proposes as (a cost-aware policy
        costs a step against a target pass by them); none for a drafter whose steps are free
        (n-gram lookup)."""
        return {}


def propose_all(drafters: list[Drafter], contexts: list[np.ndarray], requests: list[DraftRequest]) -> list[Proposal]:
    """Every drafter's proposal for its sequence (in order), the draft head's steps of all the
    drafters that draft in head steps run together, depth by depth (``heads.draft.run_head_steps``:
    one engine pass for all of them); the others propose alone. Each proposal is the one its
    drafter's ``propose`` gives."""
    proposals: list[Proposal | None] = [None] * len(drafters)
    waiting: dict[int, tuple[Generator, HeadStep]] = {}
    for i, (drafter, context, request) in enumerate(zip(drafters, contexts, requests)):
        if not drafter.drafts_in_head_steps:
            proposals[i] = drafter.propose(context, request)
            continue
        steps = drafter.drafting(context, request)
        try:
            waiting[i] = (steps, next(steps))
        except StopIteration as done:
            proposals[i] = done.value
    while waiting:
        asked = list(waiting.items())
        for (i, (steps, _)), output in zip(asked, run_head_steps([step for _, (_, step) in asked])):
            try:
                waiting[i] = (steps, steps.send(output))
            except StopIteration as done:
                proposals[i] = done.value
                del waiting[i]
    return proposals


def streamed_weights(model: torch.nn.Module) -> int:
    """Bytes of weights a decoding pass of ``model`` reads: every parameter once (tied ones once),
    every packed linear's weight (``kernels.PackedLinear`` keeps it outside the parameters) and
    every GGUF-quantised weight in the file's bytes (``quant.QuantWeight``, once however many
    modules share it), less an input embedding that is not also the LM head (a lookup reads one
    row of it). Bytes, not elements: a bfloat16 layer streams half what a float32 one does."""
    from ..kernels import PackedLinear
    from ..quant import QuantEmbedding

    total = sum(p.numel() * p.element_size() for p in model.parameters())
    total += sum(m.out_features * m.in_features * m.packed.element_size()
                 for m in model.modules() if isinstance(m, PackedLinear))
    quantised = {id(m.qweight): m.qweight for m in model.modules() if hasattr(m, "qweight")}
    total += sum(weight.nbytes for weight in quantised.values())
    embedding, head = model.get_input_embeddings(), model.get_output_embeddings()
    if isinstance(embedding, QuantEmbedding):
        if embedding.qweight is not getattr(head, "qweight", None):
            total -= embedding.qweight.nbytes
    elif isinstance(head, PackedLinear) or head is None or embedding.weight.data_ptr() != head.weight.data_ptr():
        total -= embedding.weight.numel() * embedding.weight.element_size()
    return total


class NoDrafter(Drafter):
    """Proposes nothing: with any rule the loop then emits one target token per cycle,
    i.e. plain autoregressive decoding."""

    has_distribution = False

    def propose(self, context, request) -> Proposal:
        return Proposal.empty()


#: What a drafter that drafts in steps (``Drafter.drafting``) yields to whoever drives it, and what
#: it is sent back: the tokens to feed next (the pending committed tokens, then each draft) and the
#: drafting model's logits [V] after the last of them.
DraftSteps = Generator[torch.Tensor, torch.Tensor, Proposal]


class DraftFeeds:
    """The one-token tensors a drafter feeds its drafts back through (``drafting_autoregressively``),
    made once per drafter, each a view of one int64 buffer the drafts are written into: a block
    that made its buffer and sliced a view per draft ran two torch operators and one a draft, each
    cold after the target's pass. A drafter's own: its views are read by its head step before its
    next draft is written (a batch's sequences each have theirs)."""

    def __init__(self, size: int = 1):
        self._allocate(size)

    def _allocate(self, size: int) -> None:
        self.values = np.zeros(max(size, 1), dtype=np.int64)
        self._ids = torch.from_numpy(self.values)
        self._views: list[torch.Tensor] = []  # made as first asked for

    def reserve(self, size: int) -> None:
        """Room for a block of ``size`` drafts: a larger buffer (its views made anew) where this one
        holds fewer. Between two blocks: no view of the earlier block is read after it."""
        if size > len(self.values):
            self._allocate(size)

    def view(self, index: int) -> torch.Tensor:
        """[1] int64: ``values[index]`` as a tensor (the same view each time)."""
        views = self._views
        while len(views) <= index:
            views.append(self._ids[len(views) : len(views) + 1])
        return views[index]


def drafting_autoregressively(
    pending: torch.Tensor,
    request: DraftRequest,
    source: str = "model",
    vocabulary: torch.Tensor | None = None,
    vocab_size: int = 0,
    feeds: DraftFeeds | None = None,
) -> DraftSteps:
    """Draft up to ``request.budget`` tokens one at a time, as steps: each step yields the tokens
    to feed the drafting model (``pending`` [n] first, then each draft as it is drawn) and is sent
    the logits [V] after the last of them; the generator returns the ``Proposal``. After each token
    the policy (``request.policy``) decides whether to draft another; it may still cut the block
    afterwards. Logits that are not all finite (a drafting model whose forward pass overflowed)
    give no distribution to draw from: the draft ends before them, and the target decides.

    ``vocabulary`` [K] (target ids; a draft head's reduced vocabulary): the logits score only
    these tokens, a sampled draft reads their entries of the position's token noise, and the
    proposal's rows stay over the K tokens (``Proposal.draft_probs`` widens them to
    ``vocab_size``, with probability 0 elsewhere, only if a rule reads them). ``feeds``: the
    drafter's ``DraftFeeds`` (None: made for this block)."""
    sampling, noise, policy = request.sampling, request.noise, request.policy
    tokens, probs, logits_rows, confidences = [], [], [], []
    if feeds is None:
        feeds = DraftFeeds(request.budget)
    else:
        feeds.reserve(request.budget)
    fed = feeds.values  # each draft is fed back as a one-token view of this buffer
    # a greedy draft's id read through numpy: indexing the tensor is a torch operator a step, cold after a pass
    ids = None
    if vocabulary is not None and sampling.greedy:
        ids = vocabulary.numpy() if vocabulary.device.type == "cpu" else vocabulary.cpu().numpy()
    calls = 0
    for _ in range(request.budget):
        logits = yield pending
        calls += 1
        if sampling.greedy:  # the distribution is the one-hot of the argmax (left implicit below)
            choice = greedy_choice(logits)
            if choice is None:
                break
            index, confidence = choice
            token = index if ids is None else int(ids[index])
        elif not all_finite(logits):
            break
        else:
            step_probs = logits_to_probs(logits, sampling)
            probs.append(step_probs)
            if vocabulary is None:
                token = noise.token(len(tokens), step_probs)
            else:  # the K tokens' log-probabilities at their ids, −inf elsewhere, with the position's noise
                scores = torch.full((noise.noise.vocab_size,), float("-inf"))
                scores[vocabulary] = step_probs.log()
                token = noise.noise.argmax(scores, noise.start + len(tokens))
            confidence = top_probability(logits)
        tokens.append(token)
        logits_rows.append(logits)
        confidences.append(confidence)
        fed[len(tokens) - 1] = token
        pending = feeds.view(len(tokens) - 1)
        if not policy.keep_drafting(confidences, source):
            break
    if not tokens:
        return Proposal.empty(calls, source)
    # Greedy: each token's distribution is its one-hot, which is what every rule reads for rows
    # left out (``walks.draft_rows``), so none are made.
    rows = None if sampling.greedy else torch.stack(probs)
    return Proposal.chain(tokens, rows, logits_rows, confidences,
                          drafter_calls=calls, source=source, vocabulary=vocabulary, vocab_size=vocab_size)


def run_steps(steps: Generator, step: Callable):
    """Drive a generator of steps alone: each value it yields is answered with ``step(value)``;
    returns what the generator returns."""
    try:
        asked = next(steps)
        while True:
            asked = steps.send(step(asked))
    except StopIteration as done:
        return done.value


def draft_autoregressively(next_logits, pending: torch.Tensor, request: DraftRequest, source: str = "model",
                           vocabulary: torch.Tensor | None = None, vocab_size: int = 0) -> Proposal:
    """``drafting_autoregressively`` with ``next_logits(tokens)`` answering each step: it feeds
    ``tokens`` [n] to the drafting model and returns the logits [V] after the last of them."""
    return run_steps(drafting_autoregressively(pending, request, source, vocabulary, vocab_size), next_logits)
