"""Stateful sampling modifiers (a grammar, a regex, a JSON schema) under speculation
(docs/algorithms.md §Constrained decoding; docs/DESIGN.md §12).

A ``Constraint`` is the compiled thing (immutable, shared by every generation that uses it); each
generation ``start``s its own ``ConstraintState``, which a token sequence moves through. At a verified
position the target's distribution is masked to the tokens the state reached by the tokens before
that position allows (−∞ logits elsewhere), exactly the distribution constrained plain decoding
samples from there; so every lossless rule stays exact with respect to constrained ``ar``.

Per cycle the loop, through the functions here:

1. walks the state along the proposal (each chain draft, each tree path): the mask after the root
   and after every node is read on the way (``allowed``), a draft the state forbids is cut with
   everything below it, and the state is rolled back to the committed tokens afterwards;
2. where the state allows exactly one continuation (``forced``), appends those tokens to a chain
   as free drafts: they cost no draft step and are accepted with probability 1 (the masked target
   puts all its mass on them), which ``Proposal.forced`` tells the policies and the batch;
3. after the verdict, advances the state by the committed tokens (``advance`` must take them all:
   they were drawn from masked rows) and ends the generation when it is ``finished``.

The masks of every row of every sequence of a pass are filled into one buffer (``MaskBuffer``),
one row per call of ``allowed``, so a grammar library's batched mask fill can serve a whole pass.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Protocol, Sequence

import torch

from .errors import TierspecError
from .proposal import Proposal
from .tree import ROOT, TokenTree


class ConstraintError(TierspecError):
    """A constraint state that broke its contract (it refused a token its own mask allowed)."""


class ConstraintDeadEnd(TierspecError):
    """A generation whose constraint allows no token after its text so far (a grammar whose only way
    on is a special token's text, which the model writes only as that token): the generation ends
    with this error, the others of its batch go on (``decode.cycle``)."""


class ConstraintState(Protocol):
    """One generation's position in a constraint (a grammar's matcher state), moved by tokens.

    ``allowed(out_mask)``: write into ``out_mask`` (bool [V], every entry) which tokens may come
    next. ``advance(tokens)``: take ``tokens`` in order, stopping at the first one the state
    forbids; returns how many it took. ``rollback(count)``: undo the last ``count`` tokens taken
    (at least as many as one cycle's drafts and commits). ``forced()``: the tokens that must come
    next whatever the model says (the only continuation, possibly several tokens; empty when more
    than one token is allowed). ``finished()``: the constraint is complete and nothing more may
    be generated. ``accepting()``: the text so far satisfies the constraint (its end may come now:
    a text the token budget cuts here is whole).

    A state class may also give ``chain_masks(states, chains, out)`` (a static method): fill
    ``out[i]`` (bool [1 + len(chains[i]), V]) with ``states[i]``'s masks along ``chains[i]`` (each
    chain one the state takes), all together; the states are left where they were."""

    def allowed(self, out_mask: torch.Tensor) -> None:
        ...

    def advance(self, tokens: Sequence[int]) -> int:
        ...

    def rollback(self, count: int) -> None:
        ...

    def forced(self) -> list[int]:
        ...

    def finished(self) -> bool:
        ...

    def accepting(self) -> bool:
        ...


class Constraint(Protocol):
    """A compiled constraint: each generation starts its own state from it."""

    def start(self) -> ConstraintState:
        ...


class MaskBuffer:
    """The constraint masks of a cycle's pass: one bool row [V] per verified row of every
    constrained sequence, in one buffer. ``take(count)`` reserves the next ``count`` rows."""

    def __init__(self, rows: int, vocab_size: int):
        self.rows = torch.ones(max(rows, 0), vocab_size, dtype=torch.bool)
        self._used = 0

    def take(self, count: int) -> torch.Tensor:
        if self._used + count > self.rows.shape[0]:
            raise ValueError(f"the mask buffer holds {self.rows.shape[0]} rows; {self._used + count} were asked for")
        view = self.rows[self._used : self._used + count]
        self._used += count
        return view


@dataclass(frozen=True)
class ConstrainedProposal:
    """A proposal cut and extended under a constraint, and the masks [1 + m, V] of its rows
    (row 0 after the committed tokens, row 1 + i after node i)."""

    proposal: Proposal
    masks: torch.Tensor


def constrain(state: ConstraintState, proposal: Proposal, room: int, buffer: MaskBuffer) -> ConstrainedProposal:
    """``proposal`` under ``state`` (at the committed tokens; left there afterwards): every node
    the state forbids cut with its subtree, and for a chain the state's forced tokens appended
    as free drafts, at most ``room`` nodes in all (the rows and the token budget the cycle has
    left). The masks are written into rows of ``buffer``."""
    return constrain_all([state], [proposal], [room], buffer)[0]


def constrain_all(states: Sequence[ConstraintState], proposals: Sequence[Proposal], rooms: Sequence[int],
                  buffer: MaskBuffer) -> list[ConstrainedProposal]:
    """Every ``proposals[i]`` under ``states[i]`` (``constrain``), the masks of all the chains'
    rows filled together where the states' class can (``chain_masks``: a grammar library's
    parallel mask fill over every position of every sequence), else row by row."""
    results: list[ConstrainedProposal | None] = [None] * len(states)
    chains: dict[type, list[int]] = {}
    cuts: dict[int, tuple[Proposal, list[int]]] = {}
    for i, (state, proposal, room) in enumerate(zip(states, proposals, rooms)):
        if not proposal.is_chain:
            results[i] = _constrain_tree(state, proposal, buffer)
            continue
        cuts[i] = _chain_tokens(state, proposal, room)
        chains.setdefault(type(state), []).append(i)
    for kind, members in chains.items():
        together = getattr(kind, "chain_masks", None)
        tokens = [cuts[i][0].token_list + cuts[i][1] for i in members]
        views = [buffer.take(1 + len(chain)) for chain in tokens]
        if together is not None:
            together([states[i] for i in members], tokens, views)
        else:
            for i, chain, masks in zip(members, tokens, views):
                _masks_along(states[i], chain, masks)
        for i, chain, masks in zip(members, tokens, views):
            cut, forced = cuts[i]
            for row, token in enumerate(chain):
                if not masks[row, token]:
                    raise ConstraintError(f"the constraint took token {token} its own mask forbids")
            results[i] = ConstrainedProposal(with_forced(cut, forced), masks)
    return results


def _chain_tokens(state: ConstraintState, proposal: Proposal, room: int) -> tuple[Proposal, list[int]]:
    """A chain's drafts up to the first the state refuses (at most ``room``), and the forced
    tokens after them (all within ``room``); the state is left where it was."""
    drafts = proposal.token_list[:room]
    kept = state.advance(drafts) if drafts else 0  # advance stops before the first refused token
    forced: list[int] = []
    while kept + len(forced) < room:
        more = state.forced()[: room - kept - len(forced)]
        if not more:
            break
        taken = state.advance(more)
        forced += more[:taken]
        if taken < len(more):
            state.rollback(kept + len(forced))
            raise ConstraintError(f"the constraint forced token {more[taken]} and then refused it")
    state.rollback(kept + len(forced))
    return proposal.prefix(kept), forced


def _masks_along(state: ConstraintState, chain: list[int], masks: torch.Tensor) -> None:
    """Row j of ``masks`` [1 + k, V]: what ``state`` allows after ``chain[:j]``, one token at a
    time (the state is left where it was)."""
    state.allowed(masks[0])
    for j, token in enumerate(chain):
        if state.advance([token]) != 1:
            state.rollback(j)
            raise ConstraintError(f"the constraint refused token {token} it took before")
        state.allowed(masks[1 + j])
    state.rollback(len(chain))


def _constrain_tree(state: ConstraintState, proposal: Proposal, buffer: MaskBuffer) -> ConstrainedProposal:
    """A tree: each node's mask is the state along its path; a forbidden node goes with its
    subtree (no forced tokens: a tree's paths branch, the forced ones would join one of them)."""
    tree = proposal.tree
    m = len(tree)
    masks = buffer.take(1 + m)
    state.allowed(masks[0])
    keep = [False] * m
    path: list[int] = []  # the kept nodes the state has advanced through, depth 1 first
    tokens = tree.token_list
    for node, parent in enumerate(tree.parents.tolist()):  # a parent comes before its children
        if parent != ROOT and not keep[parent]:
            continue  # below a cut node
        # move the state from the current path to the parent's: back to their common part, then down
        target = [] if parent == ROOT else tree.path_to(parent)
        common = 0
        while common < min(len(path), len(target)) and path[common] == target[common]:
            common += 1
        state.rollback(len(path) - common)
        del path[common:]
        for ancestor in target[common:]:
            if state.advance([tokens[ancestor]]) != 1:
                raise ConstraintError(f"the constraint refused token {tokens[ancestor]} it took before")
            path.append(ancestor)
        row = 0 if parent == ROOT else 1 + parent
        if masks[row, tokens[node]] and state.advance([tokens[node]]) == 1:
            keep[node] = True
            path.append(node)
            state.allowed(masks[1 + node])
    state.rollback(len(path))
    if all(keep):
        return ConstrainedProposal(proposal, masks)
    kept = [i for i in range(m) if keep[i]]
    order = torch.tensor([0] + [1 + i for i in kept], dtype=torch.long)
    return ConstrainedProposal(select_nodes(proposal, kept), masks[order])


def select_nodes(proposal: Proposal, nodes: list[int]) -> Proposal:
    """The proposal of the given ``nodes`` (increasing, closed under parents), re-indexed in order."""
    index = {old: new for new, old in enumerate(nodes)}
    tree = proposal.tree
    parents = [ROOT if int(tree.parents[i]) == ROOT else index[int(tree.parents[i])] for i in nodes]
    picked = torch.tensor(nodes, dtype=torch.long)

    def rows(x):
        return None if x is None else x[picked]

    def items(x):
        return None if x is None else [x[i] for i in nodes]

    return replace(proposal, tree=TokenTree(tree.tokens[picked], torch.tensor(parents, dtype=torch.long)),
                   probs=rows(proposal.probs), _logits=rows(proposal.logits), confidence=items(proposal.confidence),
                   match_sizes=items(proposal.match_sizes), keys=items(proposal.keys), priors=items(proposal.priors),
                   forced=0, _wide=None)


def with_forced(proposal: Proposal, forced: list[int]) -> Proposal:
    """A chain ``proposal`` followed by ``forced`` tokens, each drafted with certainty: its row of
    draft probabilities the one-hot of its token (over the target's vocabulary: a reduced draft
    vocabulary need not hold it), its confidence 1. ``Proposal.forced`` counts them."""
    if not forced:
        return proposal
    extra = torch.tensor(forced, dtype=torch.long)
    f = len(forced)
    probs = logits = None
    if proposal.probs is not None or proposal.logits is not None:
        width = proposal.vocab_size if proposal.vocabulary is not None else int(
            (proposal.probs if proposal.probs is not None else proposal.logits).shape[-1])
        if proposal.probs is not None:
            probs = torch.cat([proposal.draft_probs[:, :width],
                               torch.nn.functional.one_hot(extra, width).to(proposal.probs.dtype)])
        if proposal.logits is not None:
            certain = torch.full((f, width), float("-inf"), dtype=proposal.logits.dtype)
            certain[torch.arange(f), extra] = 0.0
            logits = torch.cat([proposal.draft_logits[:, :width], certain])
    confidence = None if proposal.confidence is None else proposal.confidence + [1.0] * f
    match_sizes = None if proposal.match_sizes is None else proposal.match_sizes + [0] * f
    chain = Proposal.chain(torch.cat([proposal.tokens, extra]), probs, logits, confidence, match_sizes,
                           proposal.drafter_calls, proposal.source)
    return replace(chain, forced=f)
