"""Token trees (docs/algorithms.md §Token trees): several drafted continuations checked in one target pass.

A tree of m nodes hangs below the *root*, the last committed position (the pending token whose
target distribution the pass also gives). Node i carries a token ``tokens[i]``, a parent
``parents[i]`` (−1 = the root, else an earlier node: parents[i] < i, so every prefix of the node
list is a tree and a node's ancestors come before it) and a depth (1 for the root's children). A
chain of k drafts is the tree whose node i has parent i − 1.

Siblings carry distinct tokens: building a tree from several continuations merges their common
prefixes (a trie), so no token is verified twice at one position.

In a tree pass node i sits at position n − 1 + depth_i (n = committed length) and attends to the
committed context, its ancestors and itself (``sees``); its logits then equal those of a chain pass
of its path, bitwise in every dtype (``tierspec.llama.tree_attention_plan`` says how).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

import torch

from .errors import TierspecError

ROOT = -1  # the parent of depth-1 nodes: the last committed position

class TreeError(TierspecError):
    """A token tree that breaks the rules above (a parent after its child, repeated siblings)."""


class TokenTree:
    """tokens [m] int64 and parents [m] int64 (see the module docstring); ``depths`` [m] derived.
    The structure only: what a drafter knew about each node travels beside it
    (``proposal.Proposal``). Immutable once made (nothing may write into its tensors); compared by
    identity. ``is_chain``: node i's parent is i − 1 for every i."""

    __slots__ = ("_tokens", "_parents", "_depths", "is_chain", "_length", "_list")

    def __init__(self, tokens: torch.Tensor | Sequence[int], parents: torch.Tensor | Sequence[int]):
        tokens = torch.as_tensor(tokens, dtype=torch.long).reshape(-1)
        parents = torch.as_tensor(parents, dtype=torch.long).reshape(-1)
        if tokens.shape != parents.shape:
            raise TreeError(f"a tree needs one parent per token: {len(tokens)} tokens, {len(parents)} parents")
        depths = torch.empty_like(parents)
        seen: set[tuple[int, int]] = set()
        for i, (token, parent) in enumerate(zip(tokens.tolist(), parents.tolist())):
            if not ROOT <= parent < i:
                raise TreeError(f"node {i} has parent {parent}: a parent must be the root (−1) or an earlier node")
            if (parent, token) in seen:
                raise TreeError(f"node {i} repeats token {token} among the children of {parent}: merge siblings (a trie)")
            seen.add((parent, token))
            depths[i] = 1 if parent == ROOT else depths[parent] + 1
        self._tokens, self._parents, self._depths = tokens, parents, depths
        self._length = len(parents)
        self._list = None
        self.is_chain = bool(torch.equal(parents, torch.arange(-1, len(parents) - 1)))

    def __repr__(self) -> str:
        return f"TokenTree(tokens={self.tokens.tolist()}, parents={self.parents.tolist()})"

    @property
    def tokens(self) -> torch.Tensor:
        """[m] int64: node i's token (a chain drafted as a list makes it only when read: the loop
        reads the list, ``token_list``)."""
        if self._tokens is None:
            self._tokens = torch.tensor(self._list, dtype=torch.long)
        return self._tokens

    @property
    def parents(self) -> torch.Tensor:
        """[m] int64: node i's parent (ROOT, or an earlier node)."""
        if self._parents is None:  # a chain made by ``chain``: its structure is made only if read
            self._parents = torch.arange(-1, len(self) - 1)
        return self._parents

    @property
    def depths(self) -> torch.Tensor:
        """[m] int64: node i's depth (1 below the root)."""
        if self._depths is None:
            self._depths = torch.arange(1, len(self) + 1)
        return self._depths

    def __len__(self) -> int:
        return self._length  # kept: the loop asks a tree's length several times a cycle

    @property
    def token_list(self) -> list[int]:
        """[m] node i's token, as Python ints: the drafter's own list where it drafted one, else made
        once. The loop reads a chain's drafts as a list right after a pass, where a tensor's
        ``tolist`` and a concatenation of several sequences' tensors ran cold (20-40 µs each)."""
        if self._list is None:
            self._list = self.tokens.tolist()
        return self._list

    @property
    def depth(self) -> int:
        """The longest path (0 for an empty tree)."""
        if self.is_chain:
            return len(self)
        return int(self.depths.max()) if len(self) else 0

    def prefix(self, count: int) -> "TokenTree":
        """The first ``count`` nodes: a tree, since every node's parent comes before it."""
        if count >= len(self):
            return self
        if self.is_chain:
            return TokenTree.chain(self._list[:count] if self._list is not None else self._tokens[:count])
        return TokenTree(self.tokens[:count], self.parents[:count])

    # -- construction --------------------------------------------------------------------------
    @staticmethod
    def empty() -> "TokenTree":
        return TokenTree(torch.empty(0, dtype=torch.long), torch.empty(0, dtype=torch.long))

    @staticmethod
    def chain(tokens: Sequence[int] | torch.Tensor) -> "TokenTree":
        """k drafts one after another: node i's parent is node i − 1. A chain breaks none of the
        rules above by construction, so it is built without the node-by-node checks, and its
        parents and depths only when read (the decode loop makes one per cycle and reads neither)."""
        tree = object.__new__(TokenTree)
        tree._list = None
        if isinstance(tokens, list):  # a drafter's list of ints: kept as ``token_list`` (a copy), the tensor made if read
            tree._list = [int(token) for token in tokens]
            tree._tokens = None
            tree._length = len(tree._list)
        else:
            if not (isinstance(tokens, torch.Tensor) and tokens.dtype == torch.long and tokens.dim() == 1):
                tokens = torch.as_tensor(tokens, dtype=torch.long).reshape(-1)
            tree._tokens = tokens
            tree._length = int(tokens.shape[0])
        tree._parents = tree._depths = None
        tree.is_chain = True
        return tree

    @staticmethod
    def from_paths(paths: Iterable[Sequence[int]]) -> "TokenTree":
        """The trie of several continuations of the committed text: common prefixes merged, nodes
        in order of first appearance (each path's nodes in depth order)."""
        tokens: list[int] = []
        parents: list[int] = []
        index: dict[tuple[int, int], int] = {}
        for path in paths:
            parent = ROOT
            for token in (int(t) for t in path):
                node = index.get((parent, token))
                if node is None:
                    node = index[(parent, token)] = len(tokens)
                    tokens.append(token)
                    parents.append(parent)
                parent = node
        return TokenTree(torch.tensor(tokens, dtype=torch.long), torch.tensor(parents, dtype=torch.long))

    def merged(self, other: "TokenTree") -> "TokenTree":
        """This tree and ``other`` as one trie (this one's nodes first, in their order)."""
        return TokenTree.from_paths([*self.paths(), *other.paths()])

    # -- reading ---------------------------------------------------------------------------------
    def children(self, node: int = ROOT) -> list[int]:
        """The children of ``node`` (ROOT: the depth-1 nodes), in node order."""
        if self.is_chain:
            return [node + 1] if node + 1 < len(self) else []
        return (self.parents == node).nonzero().flatten().tolist()

    def path_to(self, node: int) -> list[int]:
        """The nodes from depth 1 down to ``node`` (empty for ROOT)."""
        path = []
        while node != ROOT:
            path.append(node)
            node = int(self.parents[node])
        return path[::-1]

    def row_paths(self) -> list[list[int]]:
        """The tokens before each row of a pass over the tree (``tree_pass``: row 0 after the root, row
        1 + i after node i): [] for row 0, node i's path's tokens (its ancestors', then its own) for row
        1 + i — a chain's drafts before the row."""
        tokens = self.token_list
        if self.is_chain:
            return [tokens[:i] for i in range(len(tokens) + 1)]
        paths: list[list[int]] = [[]]
        for token, parent in zip(tokens, self.parents.tolist()):
            paths.append(paths[parent + 1] + [token])  # a parent precedes its children
        return paths

    def leaves(self) -> list[int]:
        has_child = torch.zeros(len(self), dtype=torch.bool)
        has_child[self.parents[self.parents >= 0]] = True
        return (~has_child).nonzero().flatten().tolist()

    def paths(self) -> list[list[int]]:
        """The token sequence of every root-to-leaf path."""
        return [self.tokens[self.path_to(leaf)].tolist() for leaf in self.leaves()]

    def sees(self) -> torch.Tensor:
        """[m, m] bool: node i attends to node j iff j is i or one of its ancestors."""
        m = len(self)
        sees = torch.eye(m, dtype=torch.bool)
        for i, parent in enumerate(self.parents.tolist()):
            if parent != ROOT:
                sees[i] |= sees[parent]
        return sees


@dataclass(frozen=True)
class TreePass:
    """The inputs of one target pass over pending committed tokens and a tree below the last of
    them: ``tokens`` [n], position ``offsets`` [n] from the first pending token's position, and
    ``attends`` [n, n] (``CachedModel.forward``). Rows: the ``pending`` committed tokens (a chain),
    the tree's ``nodes`` in node order, then ``padding`` rows (copies of the last real row: its
    token, position and what it sees, so the attention computes them once; outputs dropped).
    Node i's output is row pending + i, and it is written at cache slot start + pending + i."""

    tokens: torch.Tensor
    offsets: torch.Tensor
    attends: torch.Tensor
    pending: int
    nodes: int

    @property
    def padding(self) -> int:
        return int(self.tokens.shape[0]) - self.pending - self.nodes


def tree_pass(pending: torch.Tensor, tree: TokenTree, padding: int = 0) -> TreePass:
    """A ``TreePass`` for ``pending`` [P ≥ 1] committed tokens the target has not run (the last is
    the root) and ``tree``; node i at offset P − 1 + depth_i (position n − 1 + depth_i)."""
    pending = torch.as_tensor(pending, dtype=torch.long).reshape(-1)
    P, m = len(pending), len(tree)
    if P < 1:
        raise TreeError("a tree pass needs the last committed token (the root) among its pending tokens")
    n = P + m + padding
    last_token = tree.tokens[-1:] if m else pending[-1:]
    last_offset = (P - 1 + tree.depths[-1:]) if m else torch.tensor([P - 1])
    tokens = torch.cat([pending, tree.tokens, last_token.expand(padding)])
    offsets = torch.cat([torch.arange(P), P - 1 + tree.depths, last_offset.expand(padding)])
    attends = torch.zeros(n, n, dtype=torch.bool)
    attends[:P, :P] = torch.ones(P, P, dtype=torch.bool).tril()
    attends[P:, :P] = True
    attends[P : P + m, P : P + m] = tree.sees()
    attends[P + m :] = attends[P + m - 1]
    return TreePass(tokens, offsets, attends, P, m)
