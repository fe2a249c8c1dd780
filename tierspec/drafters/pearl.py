"""PEARL (Liu et al. 2024, "Parallel Speculative Decoding with Adaptive Draft Length"): the drafter
drafts while the target verifies (docs/algorithms.md §PEARL).

In the one decode loop a cycle is: propose → the rule's target pass → commit. This drafter
starts drafting the *next* block in a background thread as it hands over a block, so its steps
run during the target's pass, and it keeps those drafts when the commit agrees with them:

- pre-verify: with nothing drafted ahead (the first cycle, or after a rejection) it drafts one
  token and hands it over at once; the target checks it while the thread drafts ``gamma`` + 1
  more after it. If it is rejected, the thread is stopped and its drafts dropped.
- post-verify: with drafts ahead that the committed text agrees with (the whole block kept and
  the target's bonus token equal to the first draft ahead, which stands at the bonus token's
  position), the block is the other ``gamma``, handed over without drafting, and the thread
  drafts ``gamma`` + 1 more after them.

The draft length adapts by itself: one token after a rejection, ``gamma`` per cycle while
blocks are kept. Every draft is drawn from the drafter's distribution given the committed text
and the drafts before it, with the token noise of its position (a private ``Noise`` of the same
seed: the same draws without sharing the loop's noise store across threads), so the rules stay
exact and a seed still fixes the text (the drafts do not depend on timing: ``gamma`` is fixed).

Threads: while both run, the target's pass and the drafter each use ``threads`` intra-op
threads (one core each on a two-core machine; the count is per thread, and the loop's own is put
back when the drafter is joined). torch releases the GIL inside its kernels, so the passes
overlap except for their Python. ``threads`` = 0 drafts the same tokens ahead in the loop's
thread before the target's pass (no overlap: the measure of what the overlap buys).
"""

from __future__ import annotations

import threading
import time

import numpy as np
import torch

from ..errors import TierspecError
from ..proposal import DraftRequest
from ..sampling import Noise
from .base import Drafter, Proposal


def joined(first: Proposal, second: Proposal) -> Proposal:
    """``first``'s drafts followed by ``second``'s (chains of one drafter, same fields present)."""
    if not len(first):
        return second

    def cat(a, b):
        return None if a is None or b is None else torch.cat([a, b])

    confidence = None if first.confidence is None or second.confidence is None else first.confidence + second.confidence
    return Proposal.chain(torch.cat([first.tokens, second.tokens]), cat(first.probs, second.probs),
                          cat(first.logits, second.logits), confidence, None,
                          first.drafter_calls + second.drafter_calls, first.source or second.source,
                          first.vocabulary, first.vocab_size)


def suffix(proposal: Proposal, start: int) -> Proposal:
    """Drafts ``start`` .. of the chain ``proposal`` (no drafter calls: they were counted when made)."""

    def cut(x):
        return None if x is None else x[start:]

    return Proposal.chain(proposal.tokens[start:], cut(proposal.probs), cut(proposal.logits), cut(proposal.confidence),
                          None, 0, proposal.source, proposal.vocabulary, proposal.vocab_size)


class _UntilCancelled:
    """The background thread's ``PolicyView``: draft on until the loop cancels the thread."""

    def __init__(self, cancel: threading.Event):
        self.cancel = cancel

    def keep_drafting(self, confidences: list[float], source: str = "") -> bool:
        return not self.cancel.is_set()


class PearlDrafter(Drafter):
    """Wraps a drafter with its own state (``ModelDrafter``: its own model and KV cache, never the
    target's, since both run at once) and drafts ``gamma`` tokens ahead during each verification."""

    def __init__(self, inner: Drafter, gamma: int, threads: int | None = 1):
        if inner.uses_target_cache or inner.needs_target_features:
            raise TierspecError("PEARL drafts while the target runs: its drafter needs a model and cache of its own, "
                                f"not the target's ({type(inner).__name__})")
        if isinstance(gamma, bool) or not isinstance(gamma, int) or gamma < 1:
            raise TierspecError(f"PEARL's gamma must be an integer >= 1, got {gamma!r}")
        if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 0):
            raise TierspecError(f"PEARL's threads per side must be an integer >= 0 (0: no overlap; None: leave the "
                                f"counts as they are), got {threads!r}")
        self.inner, self.gamma, self.threads = inner, gamma, threads
        self._thread: threading.Thread | None = None
        self._reset()

    def _reset(self) -> None:
        self.sequence: torch.Tensor | None = None  # committed + drafted tokens the inner drafter follows
        self.drafts: Proposal | None = None  # the drafts at sequence[drafts_start:]
        self.drafts_start = 0
        self._cancel = threading.Event()
        self._result: Proposal | None = None
        self._error: BaseException | None = None
        self._loop_threads: int | None = None
        self._uncounted_calls = 0
        # what the overlap did (for reports): blocks handed over from drafts made ahead, blocks of
        # drafts ahead dropped (the text parted from them), seconds the loop waited for the thread
        self.kept_ahead = 0
        self.dropped_ahead = 0
        self.wait_seconds = 0.0

    # -- the background thread --------------------------------------------------------------
    def _run_ahead(self, sequence: torch.Tensor, sampling, noise: Noise | None) -> None:
        def draft() -> None:
            try:
                if self.threads:
                    torch.set_num_threads(self.threads)
                block = None if noise is None else noise.block(len(sequence))
                with torch.inference_mode():
                    request = DraftRequest(self.gamma + 1, sampling, block, _UntilCancelled(self._cancel))
                    self._result = self.inner.propose(sequence.numpy(), request)
            except BaseException as error:  # re-raised in the loop's thread by _join
                self._error = error

        self._cancel.clear()
        self._result = self._error = None
        if self.threads == 0:  # the same drafts, made before the target's pass instead of during it
            self._thread = threading.Thread(target=draft, name="pearl-drafter", daemon=True)
            self._thread.run()
            return
        if self.threads is not None:
            self._loop_threads = torch.get_num_threads()
            torch.set_num_threads(self.threads)
        self._thread = threading.Thread(target=draft, name="pearl-drafter", daemon=True)
        self._thread.start()

    def _join(self) -> None:
        """Wait for the thread, then append its drafts to the drafted sequence."""
        if self._thread is None:
            return
        began = time.perf_counter()
        if self._thread.ident is not None:
            self._thread.join()
        self.wait_seconds += time.perf_counter() - began
        self._thread = None
        if self._loop_threads is not None:
            torch.set_num_threads(self._loop_threads)
            self._loop_threads = None
        if self._error is not None:
            error, self._error = self._error, None
            raise error
        ahead, self._result = self._result, None
        if ahead is not None and self.sequence is not None:
            self._uncounted_calls += ahead.drafter_calls
            self.sequence = torch.cat([self.sequence, ahead.tokens])
            self.drafts = joined(self.drafts, suffix(ahead, 0))

    # -- the loop's calls -------------------------------------------------------------------
    def start(self, prompt_ids, features=None, target_view=None) -> None:
        self._cancel.set()
        self._join_quietly()
        self._reset()
        self.inner.start(prompt_ids, features, target_view)

    def _join_quietly(self) -> None:
        try:
            self._join()
        except Exception:  # an abandoned generation's drafter error: nobody waits for it any more
            pass

    def _agreed(self, context: torch.Tensor) -> Proposal | None:
        """The drafts after ``context`` when the committed text agrees with everything drafted up
        to its end (None when it parted from them: a draft was rejected, or the target's bonus
        token differs from the first draft ahead)."""
        length = len(context)
        if (self.sequence is None or not self.drafts_start <= length <= len(self.sequence)
                or not torch.equal(self.sequence[:length], context)):
            return None
        return suffix(self.drafts, length - self.drafts_start)

    def propose(self, context: np.ndarray, request: DraftRequest) -> Proposal:
        num_tokens, sampling, noise = request.budget, request.sampling, request.noise
        self._join()
        context = torch.as_tensor(context)  # its text and the thread's join drafts as tensors
        length = len(context)
        ahead = self._agreed(context)
        if ahead is None:  # back to the committed text
            if self.drafts is not None and len(self.drafts):
                self.dropped_ahead += 1
            self.inner.commit(length)
            self.sequence, ahead = context, Proposal.empty()
        self.drafts, self.drafts_start = ahead, length
        if num_tokens <= 0:
            return Proposal.empty(self._take_calls())
        if len(ahead):  # post-verify: the drafts made during the last pass
            self.kept_ahead += 1
            proposal = ahead.prefix(num_tokens)
        else:  # pre-verify: one token now, checked by the target while the thread drafts on
            proposal = self.inner.propose(self.sequence.numpy(), DraftRequest(1, sampling, noise, request.policy))
            self.sequence, self.drafts = torch.cat([self.sequence, proposal.tokens]), suffix(proposal, 0)
        # Draft ahead only if tokens remain after this block (the budget is the tokens left − 1).
        if len(proposal) and len(proposal) < num_tokens:
            private = None if noise is None else Noise(noise.noise.seed, noise.noise.vocab_size)
            self._run_ahead(self.sequence, sampling, private)
        proposal.drafter_calls += self._take_calls()
        return proposal

    def _take_calls(self) -> int:
        calls, self._uncounted_calls = self._uncounted_calls, 0
        return calls

    def commit(self, committed_length: int) -> None:
        """Stop the thread early when the commit already shows its drafts are lost (a draft of the
        block was rejected, so fewer than block + bonus tokens were committed), then wait for it:
        the next proposal needs its drafts."""
        if self._thread is not None and committed_length <= len(self.sequence):
            self._cancel.set()
        self._join()

    def draft_step_weights(self) -> dict[str, int]:
        return self.inner.draft_step_weights()
