"""The acceptance walks every verification rule (and CS Drafting's inner review) is built from:
the one walk along a chain, the exact walk (rule 3.1, docs/algorithms.md §Exact speculative
decoding) over a chain or a token tree, and the draft rows they read.

The chain walk: a rule supplies, per drafted position i, the probability of keeping x_i (for the
mixture rules min(1, π_i(x_i)/p_i(x_i))), the distribution to draw from when x_i is not kept (its
residual norm(max(0, π_i − p_i))), and the bonus distribution after a fully kept block. The walk
keeps x_1, x_2, … in order and ends the block at the first token not kept (docs/algorithms.md
§Verification rules). Greedy mode is the same walk over one-hot distributions; a deterministic
replacement may be given as a token id.

The tree walk (docs/algorithms.md §Token trees), notation: p_c is the target's distribution after
node c (c = root for the last committed position); r is the distribution the current step draws
from, starting at p_c; a child's proposal q is the distribution its token was drawn from (one-hot
for a child chosen deterministically: a top-k rank, an n-gram match).

- ``greedy``: from the root move to the child whose token equals argmax p_c; stop when none does
  and emit argmax p_c (the correction, or the bonus at a leaf). A chain is the tree of one path.
- ``coupled``: the target's token after node c at depth d is y = argmax(log p_c + g), g the token
  noise of position n + d (siblings share a position, so they share it); move to the child equal
  to y, else emit y. The emitted tokens are the target's sampled tokens whatever was drafted.
- ``residual`` (multi-draft speculative sampling, SpecInfer-style): at node c try its children in
  node order; child x with proposal q is accepted with probability min(1, r(x)/q(x)); on
  rejection r ← norm(max(0, r − q)) and, for sampled children, the next child's proposal is q with
  x removed (siblings are drawn without replacement). On acceptance move to the child; when every
  child is rejected, or at a leaf, draw the next token from r. Each step emits y with probability
  p_c(y) exactly. Every coin and draw has noise of its own (keyed by position, purpose and
  sibling rank), never the token noise a drafter may have built the tree with. A chain is walked
  by the chain walk (one child per node: the same coins; the bonus drawn with the token noise, as
  plain decoding draws it).

Randomness comes from the block's keyed noise (``sampling.BlockNoise``): the coin of position i
and the replacement drawn there are keyed by i's absolute position, independent of each other and
of the drafts (which use the token noise); the bonus token is drawn with the token noise, like
plain decoding's. So a walk's outcome depends only on the seed and the positions, not on how
many draws earlier blocks made.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from .errors import TierspecError
from .proposal import Proposal, Walk
from .sampling import (ACCEPT, NOT_DRAWN, RESIDUAL, BlockNoise, NoiseError, SamplingConfig, filters, first_maxima,
                       keyed_allowed_tokens, keyed_argmax, keyed_tokens, logits_to_probs, one_hot, one_hot_rows,
                       residual_distribution, row_argmax, sampling_logits, temperature_one_probs)
from .tree import ROOT, TokenTree, TreeError

#: A distribution [V] to draw from, or a token id when the draw is deterministic (greedy).
Draw = torch.Tensor | int

SAMPLING_RULES = ("coupled", "residual")


class VerificationError(TierspecError):
    """A walk the rule cannot take (a sampled walk without the block's noise)."""


# ---- the chain walk -----------------------------------------------------------------------------


def acceptance_walk(
    num_tokens: int,
    accept_probability: torch.Tensor | Callable[[int], float],
    replacement: Callable[[int, bool], Draw],
    bonus: Callable[[], Draw],
    noise: BlockNoise | None,
    keep: Callable[[int, bool], bool] | None = None,
) -> Walk:
    """The walk along a chain of ``num_tokens`` drafts.

    ``accept_probability``: [k] or a function of i (a rule whose later probabilities need a pass
    it only runs when the walk gets there, like VIA-SD's lazy full target). A probability of
    exactly 0 or 1 needs no coin (greedy walks run without noise).
    ``keep(i, passed)``: when given, decides from the coin's verdict ``passed`` whether x_i is
    kept (Judge Decoding ORs a second mask in); by default a token is kept iff it passed.
    ``replacement(i, passed)``: what to draw at the first position not kept.
    """
    for i in range(num_tokens):
        probability = float(accept_probability(i) if callable(accept_probability) else accept_probability[i])
        passed = coin_passes(probability, noise, i)
        if not (passed if keep is None else keep(i, passed)):
            return Walk.chain(i, draw(replacement(i, passed), noise, i, residual=True))
    return Walk.chain(num_tokens, draw(bonus(), noise, num_tokens, residual=False))


def coin_passes(probability: float, noise: BlockNoise | None, i: int) -> bool:
    """Whether the draft at block position i passes a test it passes with ``probability``: its
    keyed coin, so the verdict does not depend on which other positions were tested. A
    probability of exactly 0 or 1 needs no coin (greedy walks run without noise)."""
    return probability >= 1.0 or (probability > 0.0 and _needs(noise).coin(i) < probability)


def coin_verdicts(accept_probability: torch.Tensor, noise: BlockNoise | None) -> torch.Tensor:
    """``coin_passes`` at every position: probabilities [k] → bool [k] (a rule that combines the
    test's verdicts with another mask before deciding, like Judge Decoding)."""
    return torch.tensor([coin_passes(float(p), noise, i) for i, p in enumerate(accept_probability)], dtype=torch.bool)


def draw(what: Draw, noise: BlockNoise | None, i: int, residual: bool) -> int:
    """The token of a draw at block position i: a replacement (``residual``) with noise of its own,
    the bonus with the token noise. Without noise (greedy mode) only a token id or a one-hot
    distribution can be drawn."""
    if isinstance(what, int):
        return what
    if noise is not None:
        return noise.residual(i, what) if residual else noise.token(i, what)
    support = what.nonzero()
    if support.numel() != 1:
        raise VerificationError("a draw from a distribution needs the block's noise (sampling.BlockNoise); got None")
    return int(support)


def _needs(noise: BlockNoise | None) -> BlockNoise:
    if noise is None:
        raise VerificationError("an acceptance coin needs the block's noise (sampling.BlockNoise); got None")
    return noise


def first_rejection(accept: torch.Tensor) -> int:
    """Index of the first False in the bool vector ``accept`` [k] (k when all are True)."""
    rejected = (~accept).nonzero()
    return int(rejected[0]) if rejected.numel() else int(accept.shape[0])


def acceptance_probability(draft_prob: torch.Tensor, target_prob: torch.Tensor) -> torch.Tensor:
    """min(1, q(x)/p(x)) elementwise; p(x) > 0 for any token the drafter drew."""
    return torch.clamp(target_prob / draft_prob, max=1.0)


# ---- the draft rows a walk reads ----------------------------------------------------------------


def draft_rows(proposal: Proposal, vocab_size: int) -> torch.Tensor:
    """p [k, V]: the drafter's sampling distributions, one-hot rows for a drafter without one."""
    if proposal.probs is not None:
        return proposal.draft_probs[:, :vocab_size]
    return one_hot_rows(proposal.tokens, vocab_size)


def draft_row(proposal: Proposal, i: int, vocab_size: int) -> torch.Tensor:
    """p_i [V] (one row of ``draft_rows`` without building the others)."""
    if proposal.probs is not None:
        return proposal.draft_probs[i, :vocab_size]
    return one_hot(int(proposal.tokens[i]), vocab_size)


def draft_prob_of_tokens(proposal: Proposal) -> torch.Tensor:
    """p_i(x_i) [k] (ones for a drafter without a distribution); read in the drafter's own columns."""
    k = len(proposal)
    if proposal.probs is None:
        return torch.ones(k)
    return proposal.draft_probs[torch.arange(k), proposal.tokens]


def draft_confidence(proposal: Proposal) -> torch.Tensor | None:
    """max_v p(v) at temperature 1 [k], or None for a drafter with no distribution."""
    if proposal.logits is None:
        return None
    return temperature_one_probs(proposal.logits).max(-1).values


# ---- the exact walk -----------------------------------------------------------------------------


def check_sampling_rule(sampling_rule: str) -> str:
    if sampling_rule not in SAMPLING_RULES:
        raise TierspecError(f"unknown sampling rule '{sampling_rule}'; choose one of: {', '.join(SAMPLING_RULES)}")
    return sampling_rule


def greedy_walk(draft_tokens: torch.Tensor, target_logits: torch.Tensor) -> Walk:
    """``match_walk`` against argmax q, each row's argmax taken only when the walk reaches it
    (drafts [k], target logits [k+1, V]): a block rejected early reads one row, not k + 1."""
    drafts, argmax = draft_tokens.tolist(), row_argmax(target_logits)
    for i, draft in enumerate(drafts):
        token = argmax(i)
        if token != draft:
            return Walk.chain(i, token)
    return Walk.chain(len(drafts), argmax(len(drafts)))


def match_walk(draft_tokens: torch.Tensor, target_tokens: torch.Tensor) -> Walk:
    """Keep drafts while they equal the target's tokens; then the target's token: drafts [k],
    target tokens [k+1]. Greedy mode (argmax) and the coupled rule (perturbed argmax) are this
    walk along a chain."""
    k = len(draft_tokens)
    accepted = first_rejection(draft_tokens == target_tokens[:k])
    return Walk.chain(accepted, int(target_tokens[accepted]))


def perturbed_target_tokens(target_logits: torch.Tensor, sampling: SamplingConfig, keys: list[int]) -> np.ndarray:
    """The target's sampled tokens y_r = argmax_v(ℓ_r(v) + g_r(v)) [r] (int64) for its logits [r, V]:
    ℓ = ``sampling_logits`` (the temperature, top-k and top-p applied: log q up to a constant per
    row, which no argmax sees, so no softmax is taken), g_r the token noise of ``keys[r]``. Every
    path that decides a target's sampled token takes it here (the plain loop, chains, batches,
    trees), so they agree bit for bit. With top-k or top-p the noise is drawn at the allowed tokens
    only (``sampling.keyed_allowed_tokens``: the same tokens)."""
    if filters(sampling, target_logits.shape[-1]):
        return np.asarray(keyed_allowed_tokens(target_logits.float(), sampling, keys), dtype=np.int64)
    return keyed_argmax(sampling_logits(target_logits, sampling), keys)


def exact_walk(proposal: Proposal, target_logits: torch.Tensor, sampling: SamplingConfig, noise: BlockNoise | None,
               sampling_rule: str = "coupled") -> Walk:
    """Rule 3.1 on target logits [1 + m, V] (rows as ``proposal.Scores``): a chain by the chain
    walk, any other tree by the tree walk."""
    if not proposal.is_chain:
        return tree_walk(proposal, target_logits, sampling, noise, sampling_rule)
    tokens = proposal.tokens
    k = len(tokens)
    if sampling.greedy:
        return greedy_walk(tokens, target_logits)
    if check_sampling_rule(sampling_rule) == "coupled":
        return match_walk(tokens, torch.from_numpy(perturbed_target_tokens(target_logits, sampling,
                                                                           _needs(noise).keys(k + 1))))
    q = logits_to_probs(target_logits, sampling)  # [k+1, V]
    vocab = target_logits.shape[-1]
    accept = acceptance_probability(draft_prob_of_tokens(proposal), q[torch.arange(k), tokens])
    return acceptance_walk(k, accept, lambda i, passed: residual_distribution(q[i], draft_row(proposal, i, vocab)),
                           lambda: q[k], noise)


# ---- many chains at once ------------------------------------------------------------------------


@dataclass(slots=True)
class ChainBatch:
    """Chains of several sequences verified in one step, flat (after vLLM v1's
    ``SpecDecodeMetadata``): ``draft_tokens`` [T] every sequence's drafts one after another (ints),
    ``num_drafts`` [B] how many are each sequence's, ``target_logits`` [T + B, V] each sequence's
    k_i + 1 rows in turn (row j of a sequence after its draft j − 1: ``Scores``' layout), and per
    sequence its ``samplings`` and, sampled, its block's keyed noise (None in greedy mode);
    ``row_maxima`` [T + B]: every row's ``first_maxima`` where the pass found them (then the greedy
    sequences' rows are not read again, and ``target_logits`` may be None if no sequence samples);
    ``row_draws`` [T + B]: every sampled row's keyed draw where the pass made it (``cached_model.RowDraws``;
    ``sampling.NOT_DRAWN`` where it did not: that row is drawn here); a top-k or top-p sequence's are its
    unfiltered rows' draws, kept where the filters surely allow them (``sampling.keyed_allowed_tokens``)."""

    draft_tokens: list[int]
    num_drafts: list[int]
    target_logits: torch.Tensor | None
    samplings: list[SamplingConfig]
    noises: list[BlockNoise | None]
    row_maxima: list[int] | None = None
    row_draws: list[int] | None = None


def chain_batch_walks(batch: ChainBatch) -> list[Walk]:
    """Every sequence's walk along its chain by the target's own tokens (``match_walk``: greedy and
    the coupled rule), all decided in one step: each sequence keeps its drafts up to its first
    mismatch, and its walk is what ``exact_walk`` gives it alone (bit for bit: every row's token is
    a row-wise function of that row).

    Greedy sequences take every row's argmax at once (a few microseconds a row). Sampled sequences
    are walked depth by depth, all of them together: a row's perturbed argmax (``keyed_argmax``,
    about 0.1 ms a row of the default model's vocabulary) is drawn only once the walk reaches it,
    so a draft after a rejection costs its row in the pass but nothing here. The comparisons run
    over Python lists: a batch has tens of drafts, where each numpy operation on them cost more than
    the whole loop (0.15 ms of a cycle of 8 sequences in a dozen of them)."""
    drafts = batch.draft_tokens
    if len(drafts) != sum(batch.num_drafts):
        raise ValueError(f"{len(drafts)} draft tokens for chains of {sum(batch.num_drafts)} drafts")
    first_draft, first_row, at = [], [], 0
    for index, k in enumerate(batch.num_drafts):
        first_draft.append(at - index)
        first_row.append(at)
        at += k + 1
    walks: list[Walk | None] = [None] * len(batch.num_drafts)
    greedy = [i for i, sampling in enumerate(batch.samplings) if sampling.greedy]
    maxima = batch.row_maxima
    if maxima is not None and len(maxima) != at:
        raise ValueError(f"{len(maxima)} rows' maxima for chains of {at} rows")
    if greedy:
        total = at if maxima is not None else batch.target_logits.shape[0]
        rows = None if len(greedy) == len(walks) and at == total else [
            row for i in greedy for row in range(first_row[i], first_row[i] + batch.num_drafts[i] + 1)]
        if maxima is None:
            tokens = first_maxima(batch.target_logits, rows)
        else:
            tokens = maxima if rows is None else [maxima[row] for row in rows]
        taken = 0
        for i in greedy:
            k, accepted = batch.num_drafts[i], 0
            while accepted < k and drafts[first_draft[i] + accepted] == tokens[taken + accepted]:
                accepted += 1  # a NaN row's −1 matches no draft: the walk stops there and refuses it
            if tokens[taken + accepted] < 0:
                raise TierspecError(f"row {first_row[i] + accepted} of the target's scores holds a NaN")
            walks[i] = Walk.chain(accepted, tokens[taken + accepted])
            taken += k + 1
    live = [i for i, sampling in enumerate(batch.samplings) if not sampling.greedy]
    drawn = batch.row_draws
    if drawn is not None and len(drawn) != at:
        raise ValueError(f"{len(drawn)} rows' draws for chains of {at} rows")
    # A pass's draw of a row under top-k or top-p is the unfiltered one: a candidate the filters decide.
    logits = batch.target_logits
    if logits is None:
        if drawn is not None and any(batch.samplings[i].top_k or batch.samplings[i].top_p < 1.0 for i in live):
            raise ValueError("the draws of top-k or top-p rows are checked against their logits: none were given")
        filtered = set()
    else:
        filtered = {i for i in live if filters(batch.samplings[i], logits.shape[-1])}
    depth = 0
    while live:
        tokens = [NOT_DRAWN] * len(live) if drawn is None else [drawn[first_row[i] + depth] for i in live]
        if -1 in tokens:
            raise NoiseError(f"row {first_row[live[tokens.index(-1)]] + depth} of the scores to sample from holds a NaN")
        left = [g for g, token in enumerate(tokens) if token == NOT_DRAWN or live[g] in filtered]
        if left:  # drawn here (or the pass's draw checked), the rows of each sampling setting together
            groups: dict[SamplingConfig, list[int]] = {}
            for g in left:
                groups.setdefault(batch.samplings[live[g]], []).append(g)
            for sampling, group in groups.items():
                keys = [_needs(batch.noises[live[g]]).keys(1, depth)[0] for g in group]
                rows = [first_row[live[g]] + depth for g in group]
                candidates = [tokens[g] for g in group]
                for g, token in zip(group, _perturbed_rows(batch.target_logits, rows, sampling, keys, candidates)):
                    tokens[g] = token
        reached = []
        for i, token in zip(live, tokens):
            if depth < batch.num_drafts[i] and drafts[first_draft[i] + depth] == token:
                reached.append(i)
            else:
                walks[i] = Walk.chain(depth, token)
        live = reached
        depth += 1
    return walks


def _perturbed_rows(logits: torch.Tensor, rows: list[int], sampling: SamplingConfig, keys: list[int],
                    candidates: list[int] | None = None) -> list[int]:
    """``perturbed_target_tokens`` of ``rows`` of ``logits`` [r, V] only, read where they lie: with
    top-k or top-p by ``keyed_allowed_tokens`` (``candidates``: the rows' unfiltered draws where a pass
    made them, else ``NOT_DRAWN``), at temperature 1 without them as they are (the logits are the
    sampling logits); else (another temperature, other float types) gathered first."""
    if logits.dtype == torch.float32 and filters(sampling, logits.shape[-1]):
        return keyed_allowed_tokens(logits, sampling, keys, rows, candidates)
    if sampling.temperature == 1.0 and logits.dtype == torch.float32:
        return keyed_tokens(logits, keys, rows=rows)
    return perturbed_target_tokens(logits.index_select(0, torch.tensor(rows, dtype=torch.long)), sampling, keys).tolist()


# ---- the tree walk ------------------------------------------------------------------------------


def _row(node: int) -> int:
    """The row of a pass's scores [1 + m, V] that gives the distribution after ``node``."""
    return node + 1


def match_tree_walk(tree: TokenTree, next_token: Callable[[int], int]) -> Walk:
    """Walk down while a child's token equals the target's token after the current node:
    ``next_token(node)`` → that token (node = ROOT first). Greedy (argmax) and coupled (perturbed
    argmax) verification of a tree are this walk."""
    path, node = [], ROOT
    while True:
        token = int(next_token(node))
        match = [child for child in tree.children(node) if int(tree.tokens[child]) == token]
        if not match:
            return Walk(path, token)
        node = match[0]  # siblings are distinct: at most one matches
        path.append(node)


@dataclass(frozen=True)
class ChildTrial:
    """One child tried at a node: its acceptance probability given it is reached, and the
    distribution the step draws from if it is rejected (after the children before it)."""

    token: int
    accept: float
    residual_after: torch.Tensor  # [V]


def child_trials(target_probs: torch.Tensor, tokens: list[int], draft_rows: torch.Tensor | None = None) -> list[ChildTrial]:
    """The multi-draft step at one node (module docstring, ``residual``): target_probs p_c [V], the
    children's ``tokens`` in the order tried, and ``draft_rows`` [len(tokens), V], the distribution
    each child was drawn from *before* its earlier siblings were removed (the drafter's q for
    sampled siblings, one-hot for a child chosen deterministically; None: all one-hot). Child j's
    proposal is its row with the tokens of children 0..j−1 zeroed and renormalised. The step's
    output law is Σ_j (Π_{i<j} (1 − a_i)) a_j δ(x_j) + Π_j (1 − a_j) r_m, which equals p_c (tests
    compute it from these trials)."""
    r = target_probs.double()
    trials = []
    for j, token in enumerate(tokens):
        if draft_rows is None:
            proposal = one_hot(token, r.shape[-1]).double()
        else:  # drawn without replacement: the earlier siblings were out of the draw
            proposal = draft_rows[j].double().clone()
            proposal[tokens[:j]] = 0.0
            total = proposal.sum()
            proposal = proposal / total if total > 0 else proposal
        if proposal[token] <= 0:
            raise TreeError(f"child token {token} has draft probability 0 in the distribution it was drawn from")
        accept = float(min(1.0, float(r[token] / proposal[token])))
        r = residual_distribution(r, proposal)
        trials.append(ChildTrial(token, accept, r))
    return trials


def multi_draft_walk(proposal: Proposal, target_probs: torch.Tensor, noise: BlockNoise) -> Walk:
    """The ``residual`` walk over target_probs [1 + m, V] (row 0: after the root, row 1 + i: after
    node i), the children's proposals read from ``proposal.draft_probs`` (None: all one-hot)."""
    tree, rows_of = proposal.tree, proposal.draft_probs
    path, node, depth = [], ROOT, 0
    while True:
        children = tree.children(node)
        rows = None if rows_of is None or not children else rows_of[children]
        trials = child_trials(target_probs[_row(node)], [int(tree.tokens[c]) for c in children], rows)
        position = noise.start + depth  # the token after ``node`` sits here
        accepted = None
        for rank, (child, trial) in enumerate(zip(children, trials)):
            # the first sibling's coin is the chain rule's coin of this position (a chain verifies alike)
            purpose = ACCEPT if rank == 0 else f"{ACCEPT}/{rank}"
            if trial.accept >= 1.0 or (trial.accept > 0.0 and noise.noise.uniform(position, purpose) < trial.accept):
                accepted = child
                break
        if accepted is None:
            r = trials[-1].residual_after if trials else target_probs[_row(node)]
            return Walk(path, noise.noise.argmax(r.float().log(), position, RESIDUAL))
        path.append(accepted)
        node, depth = accepted, depth + 1


def tree_walk(proposal: Proposal, target_logits: torch.Tensor, sampling: SamplingConfig, noise: BlockNoise | None,
              sampling_rule: str = "coupled") -> Walk:
    """Verify ``proposal``'s tree against target logits [1 + m, V] (rows as ``multi_draft_walk``)."""
    tree = proposal.tree
    if target_logits.shape[0] != len(tree) + 1:
        raise TreeError(f"a tree of {len(tree)} nodes needs {len(tree) + 1} rows of target logits, got {target_logits.shape[0]}")
    if sampling.greedy:
        argmax = row_argmax(target_logits)
        return match_tree_walk(tree, lambda node: argmax(_row(node)))
    if noise is None:
        raise VerificationError("sampled verification needs the block's noise (sampling.BlockNoise); got None")
    if check_sampling_rule(sampling_rule) == "coupled":
        def perturbed_argmax(node: int) -> int:
            depth = 0 if node == ROOT else int(tree.depths[node])
            return int(perturbed_target_tokens(target_logits[_row(node)][None], sampling, noise.keys(1, depth))[0])

        return match_tree_walk(tree, perturbed_argmax)
    return multi_draft_walk(proposal, logits_to_probs(target_logits, sampling), noise)
