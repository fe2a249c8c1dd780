"""Forward-pass cost per number of new tokens, measured once per model and machine.

On a CPU the cost of a target pass is not linear in the number of tokens it scores: measured
on the default model (2 cores, 300 cached tokens) a pass over 1 / 2 / 3 / 4 / 8 new tokens
took about 57 / 92 / 116 / 88 / 80 ms with ``nn.Linear``'s kernels (2–3 rows slower than
4–8), and 35 / 35 / 45 / 45 / 67 ms with tierspec's few-row linears (``kernels``). Two
things follow:

* a verification of n tokens can be *padded* to the cheapest size n' ≥ n (the extra rows are
  copies of the last token, their outputs are ignored and their KV rolled back), and
* a draft-length policy must use this table, not a straight line.

The table is cached as JSON under ``$TIERSPEC_CACHE`` keyed by the model's identity, the
thread count, the CPU and the linear kernels in use, and reused by later runs.
"""

from __future__ import annotations

import hashlib
import json
import math
import platform
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from .models import CachedModel, LoadedModel, cache_root
from .util import atomic_write_text


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


@dataclass
class ForwardCosts:
    """seconds[n] = median time of a cached forward over n new tokens (n = 1 .. max)."""

    seconds: dict[int, float]

    @property
    def max_tokens(self) -> int:
        return max(self.seconds)

    def padded_size(self, n: int) -> int:
        """The cheapest measured size n' ≥ n (n itself beyond the table)."""
        if n > self.max_tokens:
            return n
        return min((m for m in self.seconds if m >= n), key=lambda m: (self.seconds[m], m))

    def cost(self, n: int) -> float:
        """Seconds for a pass over n tokens, padded to the cheapest size (linear beyond the table)."""
        if n <= self.max_tokens:
            return self.seconds[self.padded_size(n)]
        top = self.max_tokens
        slope = (self.seconds[top] - self.seconds[1]) / max(top - 1, 1)
        return self.seconds[top] + max(slope, 0.0) * (n - top)


def measure_forward_costs(model: torch.nn.Module, max_tokens: int = 16, context: int = 256, repeats: int = 5) -> ForwardCosts:
    runner = CachedModel(model)
    vocab = runner.vocab_size
    seconds = {}
    with torch.inference_mode():
        runner.forward(torch.arange(context) % vocab, logits_for=1)
        for n in list(range(1, max_tokens + 1)):
            tokens = (torch.arange(n) * 7 + 11) % vocab
            samples = []
            for i in range(repeats + 1):
                started = time.perf_counter()
                runner.forward(tokens, logits_for=n)
                elapsed = time.perf_counter() - started
                runner.rollback(context)
                if i:  # the first call of a size warms its kernels
                    samples.append(elapsed)
            seconds[n] = statistics.median(samples)
    return ForwardCosts(seconds)


def _linear_kind(model: torch.nn.Module) -> str:
    """Which linear kernels the model runs (the table depends on them: see ``kernels``)."""
    from .kernels import FewRowLinear

    return "few-row-v2" if any(isinstance(m, FewRowLinear) for m in model.modules()) else "linear"


def _read_table(path: Path, max_tokens: int) -> ForwardCosts | None:
    """The table in ``path`` if it has the expected shape (1..max_tokens → positive seconds)."""
    try:
        data = json.loads(path.read_text())
        seconds = {int(n): float(v) for n, v in data["seconds"].items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    if sorted(seconds) != list(range(1, max_tokens + 1)):
        return None
    if not all(math.isfinite(v) and 0 < v < 60 for v in seconds.values()):
        return None
    return ForwardCosts(seconds)


def spot_check(model: torch.nn.Module, repeats: int = 3, context: int = 64) -> float:
    """Median seconds of a cached 1-token pass now (a fraction of a second to measure)."""
    return measure_forward_costs(model, max_tokens=1, context=context, repeats=repeats).seconds[1]


def forward_costs(target: LoadedModel, max_tokens: int = 16, refresh: bool = False) -> ForwardCosts:
    """The cached table for this model on this machine, measured (a few seconds) when missing,
    damaged, or off: a spot check of a 1-token pass that differs from the table by more than 2×
    either way (the table was measured on a busy machine, or the machine changed) re-measures it."""
    import sys

    key = json.dumps({"model": target.identity.to_dict(), "threads": torch.get_num_threads(), "cpu": _cpu_name(),
                      "torch": torch.__version__, "max_tokens": max_tokens, "linear": _linear_kind(target.model)},
                     sort_keys=True)
    path = cache_root() / f"forward-costs-{hashlib.sha256(key.encode()).hexdigest()[:16]}.json"
    reason = "measuring it once"
    if path.exists() and not refresh:
        table = _read_table(path, max_tokens)
        if table is None:
            reason = f"the cached table {path.name} is damaged; measuring it again"
        else:
            now = spot_check(target.model)
            if 0.5 <= table.seconds[1] / now <= 2.0:
                return table
            reason = (f"the cached table says a 1-token pass takes {table.seconds[1] * 1000:.0f} ms, it now takes "
                      f"{now * 1000:.0f} ms; measuring it again")
    print(f"tierspec: forward cost of {target.identity.name} for 1..{max_tokens} tokens: {reason} "
          f"(cached in {path.parent})", file=sys.stderr)
    costs = measure_forward_costs(target.model, max_tokens)
    atomic_write_text(path, json.dumps({"key": json.loads(key), "seconds": costs.seconds}, indent=2))
    return costs
