"""Planted peers for the worker-process tests (``tierspec.bench.peer_process``): built in the
worker by ``PeerSpec.factory``, each with a peer's interface (``check``, ``run``, ``close``)."""

from __future__ import annotations

import os
import signal
import time

from tierspec.bench.outcome import Outcome


class EchoPeer:
    """Answers every prompt with its first tokens and says which process ran it."""

    @staticmethod
    def check(name, params, target_spec, device) -> None:
        pass

    def __init__(self, name, params, target_spec, vocab_size, eos, temperature, top_k, top_p, threads):
        self.name, self.threads = name, threads

    def run(self, prompt_ids, max_new_tokens, seed) -> Outcome:
        started = time.perf_counter()
        time.sleep(0.01)
        tokens = list(prompt_ids[:max_new_tokens])
        return Outcome(tokens, time.perf_counter() - started, None,
                       {"engine": "echo", "pid": os.getpid(), "seed": seed, "threads": self.threads})

    def close(self) -> None:
        pass


class IllegalInstructionPeer(EchoPeer):
    """Dies as a llama.cpp built for another CPU does: SIGILL on its first generation."""

    def run(self, prompt_ids, max_new_tokens, seed) -> Outcome:
        os.kill(os.getpid(), signal.SIGILL)
        time.sleep(10)
        raise AssertionError("survived its own SIGILL")


class SegfaultAtLoadPeer(EchoPeer):
    """Dies with SIGSEGV while it loads its model."""

    def __init__(self, *args):
        os.kill(os.getpid(), signal.SIGSEGV)
        time.sleep(10)


class RaisingPeer(EchoPeer):
    """Raises (a library's exception, not a crash) on prompts longer than 5 tokens."""

    def run(self, prompt_ids, max_new_tokens, seed) -> Outcome:
        if len(prompt_ids) > 5:
            raise RuntimeError("llama_decode returned -1\nmore lines")
        return super().run(prompt_ids, max_new_tokens, seed)


class BadSettingPeer(EchoPeer):
    def __init__(self, *args):
        from tierspec.errors import TierspecError

        raise TierspecError("ov-greedy: a setting to fix")
