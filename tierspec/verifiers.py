"""The verifier side of one generation: its committed sequence, the target's cache and the rows of
every pass on it, the commit and the rollback (docs/algorithms.md §The decode loop).

``Verifiers`` is what a ``decode.Sequence`` verifies with. A cycle asks it for the rows of its pass
(``target_request``: the pending committed tokens and every node of the proposal, as a
``passes.PassRequest``), hands the pass's result back (``target_scores``: the rule's ``Scores``,
modifiers and constraint masks applied) and commits the verdict (``commit``). A prompt is
prefilled the same way, in chunks a cycle fits beside other sequences' rows (``prefill_request``,
``prefill_result``), or at once (``prefill``). A tiered rule (VIA-SD) calls ``slim`` and ``target``
itself (``rules.base.VerifierTiers``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from .cached_model import CachedModel, PassResult, RowDraws, SlimVocabulary
from .costs import ForwardCosts
from .drafters.base import FeatureLog, TargetDraftView
from .errors import TierspecError
from .layerskip.masks import RoutingMask
from .modifiers import LogitModifiers, TouchedCounts
from .models import LoadedModel
from .passes import PassRequest
from .proposal import Proposal, Scores
from .seq2seq import runner_for
from .tree import TokenTree, tree_pass

#: Prompt tokens per pass of a prefill that returns its logits (``echo``): 512 rows of the default
#: model's 49,152-token vocabulary are 100 MB of float32.
SCORED_PREFILL_CHUNK = 512


class CommittedTokens:
    """The committed sequence of one generation — the prompt, then every generated token — held
    once: the verifiers extend it at each commit; drafters read ``context``, the run its
    ``generated`` tokens, the text stream its pieces. Allocated for every position the generation
    can reach; ``context`` is a view (committed tokens never change, so a view stays right)."""

    def __init__(self, prompt_ids: torch.Tensor, positions: int):
        # numpy owns the buffer (a short list of ints is written into it cheaply), torch views it
        self._buffer = np.empty(max(positions, len(prompt_ids)), dtype=np.int64)
        self._buffer[: len(prompt_ids)] = prompt_ids.cpu().numpy()
        # The same bytes as Python's buffer protocol sees them: a few ints written or read as a list
        # through it run no numpy scalar conversion (cold after a pass, they cost a cycle microseconds).
        self._words = memoryview(self._buffer)
        self._ids = torch.from_numpy(self._buffer)
        self.length = self.prompt_length = len(prompt_ids)
        self._context: torch.Tensor | None = None  # ``context``'s view while ``length`` stays

    def __len__(self) -> int:
        return self.length

    @property
    def context(self) -> torch.Tensor:
        """The committed sequence [n] int64 (a view, made once per length)."""
        if self._context is None:
            self._context = self._ids[: self.length]
        return self._context

    @property
    def array(self) -> np.ndarray:
        """The committed sequence [n] int64 as a numpy view of the buffer: what drafters read every
        cycle (``Drafter.propose``). A numpy slice costs a tenth of a tensor view, and a tensor
        view made and freed each cycle cost 4 µs a sequence in a batch of 8, 30 after a lone pass
        on a Zen 4 (its caches cold). Read it, never write it."""
        return self._buffer[: self.length]

    @property
    def generated_count(self) -> int:
        return self.length - self.prompt_length

    def pending(self, start: int) -> torch.Tensor:
        """Committed tokens ``start ..`` [n − start] (a view): what a pass from ``start`` runs first."""
        return self._ids[start : self.length]

    def pending_list(self, start: int) -> list[int]:
        """``pending(start)`` as a list of ints (read from the buffer: no tensor made)."""
        return self._words[start : self.length].tolist()

    def generated(self, start: int = 0, end: int | None = None) -> list[int]:
        """Generated tokens ``start .. end`` (Python slice bounds over the generated tokens only)."""
        begin = self.prompt_length
        stop = self.length if end is None else begin + min(end, self.generated_count)
        return self._words[begin + start : stop].tolist() if begin + start < stop else []

    @property
    def generated_view(self) -> GeneratedTokens:
        """The generated tokens as a read-only sequence (slices are read from here, not copied)."""
        return GeneratedTokens(self)

    def extend(self, tokens: list[int]) -> None:
        end = self.length + len(tokens)
        if end > self._buffer.shape[0]:
            raise ValueError(f"{end} committed tokens do not fit the {self._buffer.shape[0]} positions reserved")
        if len(tokens) <= 8:  # a cycle's few tokens one by one: a slice assignment made an array of the list
            words = self._words  # (20-25 µs after a pass, where these take a microsecond)
            for at, token in enumerate(tokens, self.length):
                words[at] = token
        else:
            self._buffer[self.length : end] = tokens
        self.length = end
        self._context = None


class GeneratedTokens:
    """A read-only view of a generation's generated tokens: ``len`` and slices (lists of ids)."""

    def __init__(self, committed: CommittedTokens):
        self._committed = committed

    def __len__(self) -> int:
        return self._committed.generated_count

    def __getitem__(self, index: slice) -> list[int]:
        if not isinstance(index, slice) or index.step not in (None, 1):
            raise TypeError("read generated tokens by contiguous slices")
        start, stop, _ = index.indices(len(self))
        return self._committed.generated(start, stop)


@dataclass(slots=True)
class PassRecord:
    """What the cycle's last verifier pass leaves for the commit to settle. The pass wrote cache
    positions from ``start``: first ``pending`` committed tokens, then the proposal's ``nodes`` in
    node order; a chain's nodes sit at their own positions already, a tree's accepted path is
    moved there at the commit (``CachedModel.compact``).

    hidden: [pending + m, W] the rows' features, when the feature log records them
    scored:  [1 + m, V] the full target's logits of the proposal (modifiers applied), which the
             committed tokens' log-probabilities are read from; None after a slim pass
    in_place: the pass wrote ``hidden`` in the feature log at ``start`` itself (a chain's
             ``PassRequest.hidden_into``): the commit has nothing to copy (``hidden`` may then hold
             the padding rows too)
    """

    start: int
    pending: int
    nodes: int
    chain: bool
    hidden: torch.Tensor | None = None
    scored: torch.Tensor | None = None
    in_place: bool = False


@dataclass(slots=True)
class TargetPass:
    """A full-target pass before it runs (``Verifiers.target_request``): its ``request`` (the
    ``pending`` committed tokens, the proposal's nodes and ``pad`` padding rows, written from cache
    position ``start``, the last 1 + m + pad rows scored), the ``proposal`` it verifies, whether the
    rule reads the rows' hidden states, and the constraint's ``masks`` [1 + m, V] of the rows
    (None: unconstrained)."""

    request: PassRequest
    proposal: Proposal
    start: int
    pending: int
    pad: int
    with_hidden: bool
    masks: torch.Tensor | None = None
    recording: bool = False  # the pass copies the feature log's rows out


@dataclass(frozen=True)
class PrefillChunk:
    """One chunk of a prompt's prefill: its ``request`` and the first prompt position it writes."""

    request: PassRequest
    start: int


class Verifiers:
    """The verifier tiers of one generation and everything they own: the target's cache and
    passes, the padding of each pass, the committed sequence, rollback, and the feature log. The
    loop runs ``target_request`` / ``target_scores`` around the cycle's one pass for a rule that is
    a function of its scores; a ``TieredRule`` (VIA-SD) calls ``slim`` and ``target`` itself
    (``rules.base.VerifierTiers``).

    The committed sequence is ``committed`` (``context`` its tokens); only the prefill and
    ``commit`` change it. The full target runs on ``runner`` (a CachedModel); a rule with a slim
    verifier (VIA-SD) gets it as the same model and cache under ``slim_mask`` (no second model in
    memory).

    Cache bookkeeping: every layer holds full-model KV for the first ``full_length`` positions;
    the kept layers of the slim mask may hold slim KV beyond that, up to ``runner.length``, for
    committed tokens that only the slim verifier has processed (the full target lags,
    docs/algorithms.md §VIA-SD). A full pass, and every drafter's use of the cache, first drops
    that slim KV (``_full_model_kv_only``, the one rollback guard) and re-processes those tokens.

    With ``record_features`` every pass's LM-head inputs f_t reach ``features`` (a
    ``FeatureLog``, the one copy a draft head reads; no extra pass) for the positions it commits.
    """

    def __init__(self, target: LoadedModel, positions: int, slim_mask: RoutingMask | None = None,
                 pass_costs: ForwardCosts | None = None, record_features: bool = False,
                 feature_layers: tuple[int, ...] = (), slim_vocabulary: SlimVocabulary | None = None,
                 source: torch.Tensor | None = None, modifiers: LogitModifiers = LogitModifiers(),
                 feature_history: int | None = None):
        """``positions``: every position this generation's passes can reach (the prompt, the
        token budget and a last pass's draft and padding); the KV buffer, the committed sequence
        and the feature log are allocated for them once. ``pass_costs`` (a ``costs.ForwardCosts``,
        the policy's): pad a solo pass to the cheapest measured size at least as long (extra rows
        repeat the last token; their outputs are dropped and their KV rolled back with the rest
        of the uncommitted block). ``slim_vocabulary`` (a ``cached_model.SlimVocabulary``): the
        slim tier scores only those tokens. ``source`` [S]: an encoder–decoder target's encoder
        input (``seq2seq``); the cache is then its decoder's. ``modifiers``: applied to every row
        of every pass the rules read (target and slim), each row with the counts of the
        generated text before it. ``feature_history`` (with ``record_features``): the prefill logs the
        features of the prompt's last that many positions only, all that the drafter reads of them
        (``Drafter.feature_history``; None: every position's)."""
        self.runner = runner_for(target.model, source)
        self.runner.reserve(positions)  # a longer pass than foreseen still grows the KV buffer
        self.positions = positions
        self.slim_mask = slim_mask
        self.slim_vocabulary = slim_vocabulary
        self.pass_costs = pass_costs
        self._pads: dict[int, int] = {}  # rows added to an n-token pass, by n
        self.feature_layers = tuple(feature_layers)  # decoder layers recorded beside f (a fused draft head)
        self.hidden_size = int(target.identity.hidden_size)
        self.features = FeatureLog(positions, self.hidden_size * (1 + len(self.feature_layers))) if record_features else None
        self.feature_history = feature_history
        self._features_from = 0  # the first prompt position whose features the prefill logs
        self.committed = CommittedTokens(torch.empty(0, dtype=torch.long), positions)
        self.full_length = 0
        self.target_calls = 0
        self.slim_calls = 0
        self.pass_seconds = 0.0  # time in verifier passes: where a cycle's time goes
        self._pass: PassRecord | None = None  # the cycle's last verifier pass, until its commit
        self.modifiers = modifiers if modifiers.active else None
        self._touched: TouchedCounts | None = None  # the modifiers' counts, made at the first modified pass
        self._prefilled = 0  # prompt tokens (of all but the last) the prefill has run
        self._prompt_rows: list[torch.Tensor] | None = None  # a scored prefill's rows so far

    @property
    def context(self) -> torch.Tensor:
        """The committed sequence [n] (read-only: ``commit`` extends it)."""
        return self.committed.context

    @property
    def target_lag(self) -> int:
        """Committed tokens (before the pending last one) the full target has not processed."""
        return len(self.committed) - 1 - self.full_length

    @property
    def hidden_layers(self) -> tuple[int, ...] | None:
        """What a pass records beside its logits: None, or the feature log's layers (with the
        final hidden states)."""
        return self.feature_layers if self.features is not None else None

    # -- passes ------------------------------------------------------------------------------
    def _forward(self, tokens: torch.Tensor, logits_for: int, with_hidden: bool = False, record_features: bool = True,
                 **kwargs) -> PassResult:
        """A pass on the target's cache, with the hidden states the feature log needs (and
        those asked for; ``record_features`` False: none for the log)."""
        recording = self.features is not None and record_features
        started = time.perf_counter()
        result = self.runner.forward(tokens, logits_for=logits_for, with_hidden=with_hidden or recording,
                                     hidden_layers=self.feature_layers if recording else (), **kwargs)
        self.pass_seconds += time.perf_counter() - started
        return result

    def _full_model_kv_only(self) -> None:
        """Drop the slim KV past ``full_length`` (the one rollback guard: a full pass recomputes
        those positions, a drafter reads full-model KV only)."""
        if self.runner.length > self.full_length:
            self.runner.rollback(self.full_length)

    def _modified(self, logits: torch.Tensor, paths: list[list[int]]) -> torch.Tensor:
        """``logits`` [r, V] under the modifiers, row i with the counts of the generated text and
        ``paths[i]`` (``modifiers.TouchedCounts``: written where they lie — a pass's rows are this
        generation's own, read by nothing else; the pass and this run under the same
        ``torch.inference_mode``, as the decode loop runs them)."""
        if self.modifiers is None:
            return logits
        if self._touched is None:
            self._touched = TouchedCounts(self.modifiers, logits.shape[-1], self.committed.generated())
        return self._touched.modify(logits, paths)

    def node_rows(self, logits: torch.Tensor, tree: TokenTree, masks: torch.Tensor | None = None) -> torch.Tensor:
        """A pass's rows [1 + m, V] by node under the modifiers (row 1 + i with the counts of the
        generated text and node i's path) and the constraint's ``masks`` [1 + m, V] (−inf where a
        row's state forbids a token)."""
        if self.modifiers is None and masks is None:
            return logits
        rows = self._modified(logits, tree.row_paths()) if self.modifiers is not None else logits
        if masks is not None:
            rows = rows.masked_fill(~masks, float("-inf"))
        return rows

    # -- the prompt ----------------------------------------------------------------------------
    def begin_prefill(self, prompt_ids: torch.Tensor, score: bool = False) -> None:
        """Commit the prompt; its passes follow (``prefill_request`` until ``prefilling`` is
        False). The target processes all but its last token, which is fed with the first draft (so
        every verification pass is "pending committed tokens + draft"). ``score``: keep the logits
        of the prompt's rows (``prompt_rows``), what ``echo`` reports."""
        self.committed = CommittedTokens(prompt_ids, self.positions)
        self._prefilled = 0
        self._prompt_rows = [] if score else None
        history = self.feature_history
        self._features_from = 0 if self.features is None or history is None else max(len(prompt_ids) - 1 - history, 0)
        if not self.prefilling:
            self._finish_prefill()

    @property
    def prefilling(self) -> bool:
        """Whether prompt tokens (all but the last) remain to be run."""
        return self._prefilled < len(self.committed) - 1

    @property
    def prefill_left(self) -> int:
        return max(len(self.committed) - 1 - self._prefilled, 0)

    def prefill_request(self, rows: int | None = None) -> PrefillChunk:
        """The next chunk of the prompt: at most ``rows`` tokens (None: the rest; a scored
        prefill's chunks are at most ``SCORED_PREFILL_CHUNK``)."""
        left = self.prefill_left
        if left < 1:
            raise ValueError("the prompt is prefilled already")
        count = left if rows is None else max(1, min(rows, left))
        scored = self._prompt_rows is not None
        if scored:
            count = min(count, SCORED_PREFILL_CHUNK)
        chunk = self.committed.context[self._prefilled : self._prefilled + count]
        logged = self._prefilled + count > self._features_from  # a chunk before the logged positions: no features
        # The pass may write the chunk's features into the log's rows of its positions (those before the
        # logged ones are written too, never read: ``_finish_prefill``), so that its result copies none.
        into = self.features.rows_at(self._prefilled, count) if logged and self.features is not None else None
        request = PassRequest(self.runner, chunk, count if scored else 1, hidden_layers=self.hidden_layers if logged else None,
                              hidden_into=into)
        return PrefillChunk(request, self._prefilled)

    def prefill_result(self, chunk: PrefillChunk, result: PassResult) -> None:
        """Take a chunk's pass result in: its features logged, its scored rows kept."""
        count = chunk.request.rows
        skip = self._features_from - chunk.start  # rows before the logged positions
        in_place = result.hidden is not None and result.hidden is chunk.request.hidden_into
        if self.features is not None and skip < count and not in_place:
            self.features.write(chunk.start + max(skip, 0), result.hidden[max(skip, 0) :])
        if self._prompt_rows is not None:
            self._prompt_rows.append(self._modified(result.logits, [[] for _ in range(count)]))  # nothing generated
        self._prefilled += count
        if not self.prefilling:
            self._finish_prefill()

    def _finish_prefill(self) -> None:
        self.full_length = self.runner.length
        if self.features is not None:
            self.features.commit(self._features_from, written=False)  # the prompt's positions no drafter reads
            self.features.commit(self.full_length)

    def prompt_rows(self) -> torch.Tensor | None:
        """A scored prefill's logits [n−1, V] (modifiers applied), row j before prompt token j+1
        (None when the prefill was not scored)."""
        if self._prompt_rows is None:
            return None
        rows = torch.cat(self._prompt_rows) if self._prompt_rows else torch.empty(0, 0)
        self._prompt_rows = None
        return rows

    def run_prefill(self) -> None:
        """The rest of the prefill in this generation's own passes (one pass; chunks of
        ``SCORED_PREFILL_CHUNK`` tokens when scored, so the rows' memory stays bounded)."""
        while self.prefilling:
            chunk = self.prefill_request()
            request = chunk.request
            self.prefill_result(chunk, self._forward(request.tokens, logits_for=request.logits_for,
                                                     record_features=request.hidden_layers is not None))

    def prefill(self, prompt_ids: torch.Tensor, score: bool = False) -> torch.Tensor | None:
        """``begin_prefill`` and ``run_prefill``; returns ``prompt_rows``."""
        self.begin_prefill(prompt_ids, score)
        self.run_prefill()
        return self.prompt_rows()

    # -- the verification pass -------------------------------------------------------------------
    def target_request(self, proposal: Proposal, with_hidden: bool = False, pad: bool = True,
                       masks: torch.Tensor | None = None, record_features: bool = True,
                       draws: RowDraws | None = None) -> TargetPass:
        """The full-target pass over the pending committed tokens and every node of ``proposal``,
        before it runs. A chain runs as a plain causal pass (the drafts at their own positions);
        any other tree as a tree pass (``tree.tree_pass``: node i at position n − 1 + depth_i,
        attending to its ancestors; its logits equal a chain pass of its path). ``pad``: padded to
        the cheapest measured size (a batch pays by its total rows: it does not pad). ``masks``
        [1 + m, V]: the constraint's allowed tokens after the root and each node.
        ``record_features``: False where the drafter wants no features this cycle
        (``Drafter.wants_features``): the pass copies none out and their log has no rows for the
        positions it commits. ``draws``: the keyed draws the pass may make of the rows (``RowDraws``; not
        where modifiers or masks change the logits after the pass: then the rule draws from those)."""
        self._full_model_kv_only()  # slim-only KV is recomputed in this pass
        if self.modifiers is not None or masks is not None:
            draws = None
        start = self.full_length
        tree = proposal.tree
        rows, m = self.committed.length - start, len(tree)
        extra = self._pad_count(rows + m) if pad else 0
        recording = self.features is not None and record_features
        hidden = self.feature_layers if recording else (() if with_hidden else None)
        if tree.is_chain:  # as ints: the batched pass joins every sequence's rows in one tensor
            # A chain's accepted rows are its first: recorded features are written in the log in place.
            into = self.features.rows_at(start, rows + m + extra) if recording else None
            request = PassRequest(self.runner, _chain_rows(self.committed.pending_list(start), tree.token_list, extra),
                                  m + 1 + extra, None, None, hidden, draws, into)
        else:
            layout = tree_pass(self.committed.pending(start), tree, extra)
            request = PassRequest(self.runner, layout.tokens, m + 1 + extra, layout.offsets, layout.attends, hidden,
                                  draws)
        return TargetPass(request, proposal, start, rows, extra, with_hidden, masks, recording)

    def target_scores(self, target_pass: TargetPass, result: PassResult) -> Scores:
        """The rule's ``Scores`` from the ``PassResult`` of ``target_pass``'s pass (run solo or in a
        batch); records the pass for ``commit``."""
        tree = target_pass.proposal.tree
        rows, m = target_pass.pending, len(tree)
        self.target_calls += 1
        self.full_length = self.runner.length
        logits = self.node_rows(result.logits[: m + 1] if target_pass.pad else result.logits, tree, target_pass.masks)
        in_place = target_pass.recording and result.hidden is target_pass.request.hidden_into
        # (rows the pass wrote in the log are not sliced again: a tensor view is a cold operator after a pass)
        recorded = (result.hidden if in_place else result.hidden[: rows + m]) if target_pass.recording else None
        self._pass = PassRecord(target_pass.start, rows, m, tree.is_chain, recorded, logits, in_place)
        hidden = result.hidden[rows - 1 : rows + m, : self.hidden_size] if target_pass.with_hidden else None
        # The pass's rows' first maxima and draws hold for the rule's rows if nothing changed them
        maxima, draws = result.first_maxima, result.keyed_draws if target_pass.request.draws is not None else None
        if self.modifiers is not None or target_pass.masks is not None:
            maxima = draws = None
        elif target_pass.pad:
            maxima = None if maxima is None else maxima[: m + 1]
            draws = None if draws is None else draws[: m + 1]
        return Scores(logits, hidden, maxima, draws)

    def target(self, proposal: Proposal, with_hidden: bool = False) -> Scores:
        """One full-target pass of this generation's own over the pending committed tokens and
        every node of ``proposal`` (``target_request``): its ``Scores`` (logits [1 + m, V], row 0
        after the last committed token, row 1 + i after node i; ``with_hidden``: the final hidden
        states [1 + m, H] of the same rows)."""
        target_pass = self.target_request(proposal, with_hidden)
        request = target_pass.request
        started = time.perf_counter()
        result = self.runner.forward(request.token_tensor, logits_for=request.logits_for,
                                     with_hidden=request.hidden_layers is not None,
                                     hidden_layers=request.hidden_layers or (), offsets=request.offsets,
                                     attends=request.attends)
        self.pass_seconds += time.perf_counter() - started
        return self.target_scores(target_pass, result)

    def slim(self, proposal: Proposal) -> Scores:
        """The slim verifier's rows [k + 1, V] for a chain ``proposal`` (the target under
        ``slim_mask``, on top of whatever the cache holds), laid out as ``target``'s."""
        if self.slim_mask is None:
            raise ValueError("this generation has no slim verifier (no routing mask was given)")
        if not proposal.is_chain:
            raise ValueError("the slim verifier scores chains only (VIA-SD verifies one chain of drafts)")
        start = self.runner.length
        pending = self.committed.pending_list(start)
        rows, k = len(pending), len(proposal)
        pad = self._pad_count(rows + k)
        tokens = torch.tensor(_chain_rows(pending, proposal.token_list, pad), dtype=torch.long)
        result = self._forward(tokens, logits_for=k + 1 + pad, mask=self.slim_mask, vocabulary=self.slim_vocabulary)
        self.slim_calls += 1
        # the slim model's features, until a full pass rewrites them
        self._pass = PassRecord(start, rows, k, True, result.hidden[: rows + k] if self.features is not None else None)
        return Scores(self.node_rows(result.logits[: k + 1], proposal.tree))

    def scored_rows(self, new_tokens: list[int], path: list[int]) -> torch.Tensor:
        """The target's logits rows [len(new_tokens), V] that scored ``new_tokens`` (to be committed
        next, along the accepted ``path``), from this cycle's full pass: the logprobs come from the
        rows the rule verified against, with no pass of their own."""
        scored = None if self._pass is None else self._pass.scored
        if scored is None:
            raise TierspecError("log-probabilities need the target's scores of every emitted token; "
                                "this cycle committed tokens no target pass scored")
        return scored[torch.tensor([0] + [1 + node for node in path[: len(new_tokens) - 1]], dtype=torch.long)]

    def _pad_count(self, n: int) -> int:
        """Rows to add to an n-token pass (a one-token pass is never padded)."""
        if self.pass_costs is None or n < 2:
            return 0
        pad = self._pads.get(n)
        if pad is None:
            pad = self._pads[n] = self.pass_costs.padded_size(n) - n
        return pad

    # -- commit and rollback --------------------------------------------------------------------
    def commit(self, new_tokens: list[int], path: list[int]) -> int:
        """Append a cycle's ``new_tokens`` to the committed sequence, keep the KV and features of
        the accepted ``path`` (the proposal's nodes, depth 1 first) as the positions after the
        committed tokens, and roll every cache back to the committed tokens it has processed;
        returns the new committed length.

        Invariant afterwards: full_length ≤ runner.length ≤ committed − 1, every layer holds KV
        for exactly the positions the model has processed, and the feature log's committed
        rows are those positions' features."""
        record, self._pass = self._pass, None
        if record is None:
            raise ValueError("no verifier pass awaits a verdict: each cycle's pass is committed once")
        if len(path) > record.nodes or (path and max(path) >= record.nodes) or len(new_tokens) > len(path) + 1:
            raise ValueError(f"a verdict on {record.nodes} nodes commits a path of them and one token more; "
                             f"got path {path} and {len(new_tokens)} tokens")
        self._keep_path(record, path)
        committed = self.committed
        committed.extend(new_tokens)
        if self._touched is not None:
            self._touched.add(new_tokens)
        keep = committed.length - 1  # the last committed token is fed with the next draft
        self.runner.rollback(min(self.runner.length, keep))
        self.full_length = min(self.full_length, keep)
        if self.features is not None:
            self.features.commit(self.runner.length, written=record.hidden is not None)
        return committed.length

    def _keep_path(self, record: PassRecord, path: list[int]) -> None:
        """The accepted path's KV and features at the positions after the committed tokens: a
        chain's are there already; a tree's are moved there and the other nodes dropped."""
        committed = record.start + record.pending  # where depth 1 goes
        if not record.chain:
            self.runner.compact(committed, committed + torch.tensor(path, dtype=torch.long))
            self.full_length = min(self.full_length, self.runner.length)
        if record.hidden is None or record.in_place:
            return
        if record.chain:
            self.features.write(record.start, record.hidden[: record.pending + len(path)])
            return
        self.features.write(record.start, record.hidden[: record.pending])
        if path:
            self.features.write(committed, record.hidden[record.pending + torch.tensor(path, dtype=torch.long)])

    def draft_view(self) -> TargetDraftView:
        return _DraftView(self)


def _chain_rows(pending: list[int], drafts: list[int], pad: int) -> list[int]:
    """The tokens of a chain pass, as ints: the pending committed tokens, the drafts, and ``pad``
    copies of the last (padding rows: their outputs are dropped, their KV rolled back)."""
    tokens = pending + drafts
    return tokens + tokens[-1:] * pad if pad else tokens


class _DraftView(TargetDraftView):
    """A self-drafter's access to the target cache: masked passes on top of full-model KV."""

    def __init__(self, verifiers: Verifiers):
        self.verifiers = verifiers
        self._drafting = False  # masked positions appended since the last discard

    @property
    def length(self) -> int:
        return self.verifiers.full_length

    def forward(self, tokens: torch.Tensor, mask) -> torch.Tensor:
        if not self._drafting:
            self.verifiers._full_model_kv_only()  # draft on full-model KV only
            self._drafting = True
        return self.verifiers.runner.forward(tokens, logits_for=1, mask=mask).logits[-1]

    def discard(self) -> None:
        self._drafting = False
        verifiers = self.verifiers
        verifiers.runner.rollback(min(verifiers.runner.length, verifiers.full_length))

    def full_model_cache(self) -> CachedModel:
        self.verifiers._full_model_kv_only()
        return self.verifiers.runner

    def replay_window(self, start: int, tokens: torch.Tensor, mask) -> torch.Tensor:
        self.verifiers._full_model_kv_only()
        return self.verifiers.runner.replay(start, tokens, mask)
