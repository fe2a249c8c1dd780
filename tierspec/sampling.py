"""Pure functions from logits to the distributions that drafters and verifiers use, and the
keyed noise every sampled token is drawn with.

Every probability a verification rule compares is taken *after* the same transforms (temperature,
top-k, top-p) for drafter and target, and every sampled token is drawn from exactly that
distribution (docs/algorithms.md §Sampling and noise): a rule that tests ``q(x)/p(x)`` against a
``p`` the token was not drawn from is no longer lossless.

Randomness (``Noise``): every random number of a generation is keyed by (seed, position,
purpose), never by how many draws came before, so the tokens cannot depend on how the
drafts, draft lengths or timing of a run went. A token at position t is drawn from π by the
Gumbel-max trick, argmax_v(log π(v) + g_t(v)) with g_t i.i.d. standard Gumbel: an exact
sample of π, and a deterministic function of (π, g_t).
"""

from __future__ import annotations

import hashlib
import itertools
import math
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
import torch

from . import _keyed_noise
from .errors import TierspecError


def _noise_loop() -> int:
    """The loop the noise kernels run (csrc/noise; every loop the same bits): the fastest this CPU
    runs (2 AVX-512, 1 AVX2, 0 plain), capped as the engine is by ``TIERSPEC_ENGINE_ISA`` (``portable``:
    the plain loop, ``avx2``: at most AVX2; the engine refuses an unknown name)."""
    cap = os.environ.get("TIERSPEC_ENGINE_ISA", "").strip().lower()
    return min(_keyed_noise.best_loop(), {"portable": 0, "avx2": 1}.get(cap, 2))


#: The noise kernels' loop (``_noise_loop``).
_NOISE_LOOP = _noise_loop()
#: Whether a top-k or top-p row's draw starts from its unfiltered draw, checked (``keyed_allowed_tokens``):
#: where the check's vector loop runs (AVX2 or AVX-512); its plain loop costs what finding the allowed
#: tokens does, so there (and the decode loop asks the pass for no such draws) the allowed tokens are found.
CHECKS_UNFILTERED_DRAWS = _NOISE_LOOP > 0


class SamplingError(TierspecError):
    """Sampling settings out of range."""


@dataclass(frozen=True)
class SamplingConfig:
    """How tokens are chosen. ``temperature == 0`` means greedy (argmax) decoding."""

    temperature: float = 0.0
    top_k: int = 0  # 0 = no top-k filter
    top_p: float = 1.0  # 1.0 = no nucleus filter

    def __post_init__(self) -> None:
        for name in ("temperature", "top_p"):  # math.isfinite("1") and "0.5" <= 1.0 fail with bare TypeErrors
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise SamplingError(f"{name} must be a number, got {value!r}")
        # ``not x >= 0`` also refuses NaN, which compares false with everything.
        if not math.isfinite(self.temperature) or not self.temperature >= 0:
            raise SamplingError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise SamplingError(f"top_k must be an integer >= 0, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise SamplingError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def logits_to_probs(logits: torch.Tensor, config: SamplingConfig) -> torch.Tensor:
    """Sampling distribution(s) for ``logits`` [..., V] under ``config`` (float32, rows sum to 1).

    In greedy mode this is the one-hot of the argmax, so that a rule written for
    distributions gives the greedy rule when fed greedy "distributions".
    """
    if config.greedy:
        return one_hot_rows(logits.argmax(-1), logits.shape[-1])
    return sampling_logits(logits, config).softmax(-1)


def sampling_logits(logits: torch.Tensor, config: SamplingConfig) -> torch.Tensor:
    """The logits [..., V] (float32) whose softmax ``logits_to_probs`` samples from at a temperature
    above 0: divided by the temperature, −inf outside the top-k and the nucleus."""
    logits = logits.float()
    if config.greedy:
        raise SamplingError("greedy decoding (temperature 0) samples from no distribution; see reported_logprobs")
    allowed = allowed_tokens(logits.reshape(-1, logits.shape[-1]), config) if filters(config, logits.shape[-1]) else None
    if config.temperature != 1.0:  # x / 1 is x, bit for bit: no copy to make
        logits = logits / config.temperature
    if allowed is None:
        return logits
    rows = logits.reshape(-1, logits.shape[-1])
    kept = torch.full_like(rows, float("-inf"))
    for row, ids in enumerate(allowed):
        kept[row, ids] = rows[row, ids]
    return kept.reshape(logits.shape)


def filters(config: SamplingConfig, vocab_size: int) -> bool:
    """Whether ``config``'s top-k or top-p can drop tokens of a ``vocab_size`` vocabulary."""
    return bool(config.top_k and config.top_k < vocab_size) or config.top_p < 1.0


def allowed_tokens(rows: torch.Tensor, config: SamplingConfig) -> list[torch.Tensor]:
    """For each row of ``rows`` [r, V] (float32 logits, before the temperature), the ids (int64,
    ascending) of the tokens that top-k and then top-p keep of the logits at the temperature, none
    whose logit is −inf — every id of a row whose probabilities are NaN (whoever draws from it
    refuses it). Top-k keeps every token not below the k-th largest logit (equal ones included, a
    NaN too). Top-p keeps the nucleus (``nucleus_ids``) of the row, or of the tokens top-k kept:
    their softmax among themselves (in id order), largest logit first (equal ones by id), a token
    dropped once the mass before it reaches top_p.

    With top-k the row is not divided by the temperature: the division keeps the order of any two
    logits or makes them equal, so the k + 1 largest, divided, say whether the k-th has an equal
    (then the whole row is divided and read); only the survivors are divided after that."""
    vocab, temperature = rows.shape[-1], config.temperature
    if not (config.top_k and config.top_k < vocab):
        if config.top_p >= 1.0:
            return [torch.nonzero(row > float("-inf")).flatten() for row in rows]
        return nucleus_ids(rows if temperature == 1.0 else rows / temperature, config.top_p)
    k = config.top_k
    values, ids = torch.topk(rows, k + 1, dim=-1)  # one more: whether an equal logit follows the k-th
    if temperature != 1.0:
        values = values / temperature
    kept = []
    for row, value, top in zip(rows, values, ids):
        if value[k] < value[k - 1] and value[k - 1] > float("-inf"):
            survivors = top[:k].sort().values
        else:  # NaN kept (as a mask of ``row < k-th`` keeps it), −inf not
            scaled = row if temperature == 1.0 else row / temperature
            survivors = torch.nonzero(~(scaled < value[k - 1]) & (scaled != float("-inf"))).flatten()
        if config.top_p < 1.0:
            survivors = _top_k_nucleus(row[survivors] if temperature == 1.0 else row[survivors] / temperature,
                                       survivors, vocab, config.top_p)
        kept.append(survivors)
    return kept


def _top_k_nucleus(logits: torch.Tensor, survivors: torch.Tensor, vocab: int, top_p: float) -> torch.Tensor:
    """The nucleus of the top-k ``survivors`` (ids ascending, ``logits`` theirs at the temperature)
    of a ``vocab``-token row: their softmax among themselves, summed largest logit first (equal
    ones by id: a stable sort of the id order)."""
    probs = logits.softmax(-1)
    if bool(probs.isnan().any()):
        return torch.arange(vocab)
    order = torch.sort(logits, descending=True, stable=True).indices
    mass = probs[order]
    kept = int((~(mass.cumsum(0) - mass >= top_p)).sum())
    return survivors[order[:kept]].sort().values


def keyed_allowed_tokens(rows: torch.Tensor, config: SamplingConfig, keys: list[int],
                         which: list[int] | None = None, candidates: list[int] | None = None) -> list[int]:
    """``keyed_tokens`` of ``sampling_logits(rows, config)`` (``which``: only those rows of ``rows``
    [r, V], in that order), bit for bit.

    First from each row's unfiltered draw (``candidates``: each row's ``keyed_tokens`` of the logits
    at the temperature, as a pass's ``RowDraws`` makes them — a negative one is not drawn; None:
    drawn here): where top-k and top-p surely keep it (``surely_allowed``) it is the filtered row's
    draw too — the whole row's first maximum, allowed, is the first maximum among the allowed
    tokens, whose scores are the same. That settles every row but those whose draw the filters drop
    (at most about the mass they drop) or whose mass lies at the bound, by one pass over the row in C,
    where finding the allowed tokens and drawing among them cost 3–10× more
    (``benchmarks/filtered_draws.py``). Only where ``CHECKS_UNFILTERED_DRAWS``. Every other row: drawn
    from the allowed tokens' noise (``gumbel_values``): the first of the equal maxima of their logit plus noise, in id
    order, is the whole row's first (every other token is −inf there). A row that keeps every
    token (its probabilities NaN) or none (every logit −inf: its first) is drawn whole, and a NaN
    refused as ``keyed_tokens`` refuses it."""
    which = list(range(rows.shape[0])) if which is None else list(which)
    if len(keys) != len(which):
        raise NoiseError(f"{len(which)} rows of scores need {len(which)} keys, got {len(keys)}")
    if candidates is not None and len(candidates) != len(which):
        raise NoiseError(f"{len(which)} rows of scores need {len(which)} candidate draws, got {len(candidates)}")
    vocab = rows.shape[-1]
    drawn = _unfiltered_draws(rows, config, keys, which, candidates) if CHECKS_UNFILTERED_DRAWS else None
    sure = surely_allowed(rows, config, which, drawn) if drawn is not None else [False] * len(which)
    top_k = bool(config.top_k and config.top_k < vocab)
    tokens = []
    for at, (index, key) in enumerate(zip(which, keys)):
        if sure[at]:
            tokens.append(drawn[at])
            continue
        row = rows[index]
        ids = _plain_top_k_allowed(row, config) if top_k else None
        if ids is None:
            ids = allowed_tokens(row[None], config)[0].numpy()
        if len(ids) in (0, vocab):  # every token (NaN probabilities) or none: the whole row
            if bool(row.isnan().any()):
                raise NoiseError(f"row {index} of the scores to sample from holds a NaN")
            tokens += keyed_tokens(row[None] if config.temperature == 1.0 else row[None] / config.temperature, [key])
            continue
        logits = row.numpy()[ids]  # a few numbers: numpy's calls cost less than torch's
        if config.temperature != 1.0:
            logits = logits / np.float32(config.temperature)
        scores = logits + gumbel_values(key, torch.from_numpy(ids), vocab).numpy()
        if bool(np.isnan(scores).any()):
            raise NoiseError(f"row {index} of the scores to sample from holds a NaN")
        tokens.append(int(ids[int(np.argmax(scores))]))  # the first maximum, in id order
    return tokens


def _plain_top_k_allowed(row: torch.Tensor, config: SamplingConfig) -> np.ndarray | None:
    """``allowed_tokens`` of one row [V] under top-k (then top-p), as int64 ids ascending, from its
    k + 1 largest logits alone where they are plain; None elsewhere (the caller asks
    ``allowed_tokens``). Plain: the k-th largest logit at the temperature is finite and above the
    (k + 1)-th — top-k keeps exactly the k largest, whatever order ``topk`` gives equal ones among
    them, their logits at the temperature are the row's own divided (the same operation on the same
    numbers) — and, under top-p, every survivor's mass before it (their softmax among themselves,
    largest logit first, equal ones by id; in float64) lies ``sure_margin(k)`` clear of top_p, beyond
    what the nucleus's float32 sums over k terms can be off (``_top_k_nucleus``): the tokens below it
    are the nucleus. Where a row's unfiltered draw is dropped (``keyed_allowed_tokens``) this spares
    finding the nucleus with a dozen torch operators on k numbers, each cold after a pass."""
    k = config.top_k
    values, ids = torch.topk(row, k + 1)
    if config.temperature != 1.0:
        values = values / config.temperature  # as ``allowed_tokens`` divides them
    values, ids = values.numpy(), ids.numpy()
    if not (values[k] < values[k - 1] and np.isfinite(values[:k]).all()):
        return None  # a tie at the k-th (top-k keeps more than k), or a NaN, ±inf among the k largest
    survivors, logits = ids[:k], values[:k]
    if config.top_p < 1.0:
        order = np.lexsort((survivors, -logits.astype(np.float64)))  # largest first, equal ones by id
        weights = np.exp(logits[order].astype(np.float64) - float(logits.max()))
        before = (np.cumsum(weights) - weights) / weights.sum()
        margin = sure_margin(k)
        kept = before < config.top_p - margin
        if not (kept | (before >= config.top_p + margin)).all():
            return None  # a survivor's mass lies at the bound: the nucleus's own sums decide it
        survivors = survivors[order[kept]]
    return np.sort(survivors)


#: How far below ``top_p`` the mass before a token must lie for ``surely_allowed`` to keep it, beyond
#: what the nucleus's own sums can be off (``sure_margin``). The kernel's masses (float64 sums of float32
#: terms, each within a few float ulps) lie within 5e-8 of a float64 reference on the default model's
#: rows (``tests/pure/test_sampling.py`` holds them to 1e-6).
SURE_MARGIN = 1e-5


def sure_margin(vocab: int) -> float:
    """How far below ``top_p`` ``surely_allowed`` wants the mass before a token on rows of ``vocab``
    logits: ``SURE_MARGIN`` and the most the nucleus's own mass can be off. That one is a float32
    softmax (each probability within a few ulps, its denominator a float32 sum of ``vocab`` terms —
    at worst ``vocab`` roundings of 2⁻²⁴ of a sum of 1, however torch splits it into lanes) summed
    in float64 and rounded once: below ``vocab``·2⁻²⁴ + 2⁻²¹ (2.9e-3 for the default model's 49,152
    tokens; a review measured float32-against-float64 masses there within 1.1e-6). Nearer the bound
    the nucleus itself decides."""
    return SURE_MARGIN + vocab * 2.0**-24 + 2.0**-21


def _unfiltered_draws(rows: torch.Tensor, config: SamplingConfig, keys: list[int], which: list[int],
                      candidates: list[int] | None) -> list[int] | None:
    """Each row's ``keyed_tokens`` of its logits at the temperature, top-k and top-p not applied:
    ``candidates`` where drawn (≥ 0), the others drawn here; None where a row cannot be drawn whole
    (a NaN: the filtered draw refuses it with its own message)."""
    missing = [at for at, token in enumerate(candidates) if token < 0] if candidates is not None \
        else list(range(len(which)))
    drawn = list(candidates) if candidates is not None else [0] * len(which)
    if not missing:
        return drawn
    picked = [which[at] for at in missing]
    table = rows.float()
    try:
        if config.temperature == 1.0:
            tokens = keyed_tokens(table, [keys[at] for at in missing], rows=picked)
        else:
            tokens = keyed_tokens(table[torch.tensor(picked, dtype=torch.long)] / config.temperature,
                                  [keys[at] for at in missing])
    except NoiseError:
        return None
    for at, token in zip(missing, tokens):
        drawn[at] = token
    return drawn


def surely_allowed(rows: torch.Tensor, config: SamplingConfig, which: list[int], tokens: list[int]) -> list[bool]:
    """For each row ``which[i]`` of ``rows`` [r, V] (float32 logits before the temperature), whether
    top-k and top-p surely keep ``tokens[i]`` (``allowed_tokens``' rule, without finding the row's
    allowed tokens): at the temperature fewer than ``top_k`` tokens have a larger logit, and the mass
    before the token — of the tokens with a larger logit, or an equal one and a smaller id, in the
    row's softmax or, with top-k, in the softmax of the tokens top-k keeps — lies ``sure_margin``
    below ``top_p`` (csrc/noise/keyed_noise.c: ``mass_before``, one pass over the row). False for a
    negative token, a row holding a NaN or +inf, an excluded token (−inf) or one some logit lies 87
    above (its e^ would not hold), and where the mass lies within the margin (the caller then finds
    the allowed tokens)."""
    if not which:
        return []
    table = _float_rows(rows)
    vocab = table.shape[1]
    top_k = config.top_k if config.top_k and config.top_k < vocab else 0
    try:
        masses = _keyed_noise.mass_before(table.data_ptr(), table.shape[0], vocab, table.stride(0), which, tokens,
                                          config.temperature, top_k, config.top_p < 1.0, _NOISE_LOOP)
    except IndexError:
        raise NoiseError(f"rows {list(which)} are not all among the scores' {table.shape[0]}") from None
    bound = config.top_p - sure_margin(vocab) if config.top_p < 1.0 else 1.0  # top-k alone: 0 where kept, NaN where not
    return [mass < bound for mass in masses]  # a NaN is below nothing


#: The likeliest tokens a row's nucleus is first looked for among (``nucleus_ids``).
NUCLEUS_CANDIDATES = 64
#: A wider nucleus is looked for among the tokens of the logit bins, ``NUCLEUS_BIN_WIDTH`` nats
#: each below the row's largest, that hold ``top_p`` and ``NUCLEUS_MARGIN`` more of its mass (the
#: margin spares a second look where the sums' rounding differs; the last bin gathers what lies
#: further down).
NUCLEUS_BIN_WIDTH = 0.05
NUCLEUS_BINS = 800
NUCLEUS_MARGIN = 1e-3


def nucleus_ids(rows: torch.Tensor, top_p: float) -> list[torch.Tensor]:
    """Each row's nucleus in ``rows`` [r, V] (float32 logits), as its finite-logit token ids
    (int64, ascending): in the order of the logits, largest first (equal ones by token id), a token
    is dropped when the probability mass before it (the row's softmax, summed in that order) already
    reaches ``top_p``; the likeliest token always stays. Every id of a row whose probabilities are
    NaN (whoever draws from it refuses it).

    Found without sorting the vocabulary. The mass before a token only grows along the order, so
    the nucleus is its first tokens, and any first tokens of it (the candidates) whose last one is
    dropped hold the whole nucleus: the sums over them are the sums over the whole sorted row
    (a running sum; equal logits have equal probabilities, so which of them a selection picked
    changes no sum). The candidates are first the row's ``NUCLEUS_CANDIDATES`` largest
    (``torch.topk``), then every token above a bound read from the mass by logit bins
    (``NUCLEUS_BIN_WIDTH``), then the whole row. At top-p 0.95 the default model's nucleus held
    52 tokens at the median, over 512 in one row of six and up to 5,294 (MT-Bench, temperature 1);
    a sort of its 49,152 logits took 3.1 ms on the Intel Xeon, the top 64 0.1 ms, the binned look at
    a 5,000-token nucleus about 0.5 (its parts timed apart; sampling at top-p 0.95 ran 130 tokens a
    second, 318 without)."""
    vocab = rows.shape[-1]
    probs = rows.softmax(-1)
    count = min(NUCLEUS_CANDIDATES, vocab)
    values, ids = torch.topk(rows, count, dim=-1)  # largest first, every row at once
    mass = probs.gather(-1, ids)
    mass_before = mass.cumsum(-1) - mass
    kept = (~(mass_before >= top_p)).sum(-1)  # a prefix of the candidates; NaN mass keeps everything
    nan = mass_before[:, -1].isnan()
    closed = (kept < count) | (values[:, -1] == float("-inf"))
    nuclei = []
    for row in range(rows.shape[0]):
        if nan[row]:
            nuclei.append(torch.arange(vocab))
        elif closed[row] or count == vocab:
            nuclei.append(_top_ids(rows[row], values[row], ids[row], int(kept[row])))
        else:
            nuclei.append(_binned_ids(rows[row], probs[row], float(values[row, 0]), top_p))
    return nuclei


def _top_ids(row: torch.Tensor, values: torch.Tensor, ids: torch.Tensor, kept: int) -> torch.Tensor:
    """The first ``kept`` tokens of ``row`` [V] in the nucleus order, from its largest ``values``
    (in order) and their ``ids``: finite ones, ascending."""
    bound = values[kept - 1]
    above, equal = int((values > bound).sum()), int((values == bound).sum())
    if above + equal == kept and (values[-1] != bound or len(values) == len(row)):
        chosen = ids[:kept]  # every token equal to the bound is a candidate and kept
    else:  # equal logits at the bound: the first of them by id, as many as the nucleus holds
        tied = torch.nonzero(row == bound).flatten()
        chosen = torch.cat([ids[values > bound], tied[: kept - above]])
    chosen = chosen[row[chosen] > float("-inf")]
    return chosen.sort().values


def _binned_ids(row: torch.Tensor, probs: torch.Tensor, top: float, top_p: float) -> torch.Tensor:
    """A wide nucleus of ``row`` [V] (finite ids, ascending; ``top`` its largest logit): the
    candidates are the tokens of the top logit bins holding ``top_p`` + ``NUCLEUS_MARGIN`` of the
    mass (the whole row if they are not enough), in id order, sorted stably (equal logits by id)."""
    bins = ((top - row) / NUCLEUS_BIN_WIDTH).clamp_(max=NUCLEUS_BINS - 1).to(torch.int64)
    reach = torch.bincount(bins, weights=probs, minlength=NUCLEUS_BINS).cumsum(0)
    enough = int(torch.searchsorted(reach, top_p + NUCLEUS_MARGIN))
    bound = top - (enough + 1) * NUCLEUS_BIN_WIDTH if enough < NUCLEUS_BINS - 1 else float("-inf")
    while True:
        candidates = torch.nonzero(row > bound).flatten() if bound > float("-inf") else torch.arange(len(row))
        values, order = torch.sort(row[candidates], descending=True, stable=True)
        mass = probs[candidates[order]]
        kept = int((~(mass.cumsum(0) - mass >= top_p)).sum())
        if kept < len(candidates) or bound == float("-inf"):
            break
        bound = float("-inf")  # the bins' sums fell short of the running sum's: the whole row
    chosen = candidates[order[:kept]]
    chosen = chosen[row[chosen] > float("-inf")]
    return chosen.sort().values


def reported_logprobs(logits: torch.Tensor, config: SamplingConfig) -> torch.Tensor:
    """The log-probabilities [..., V] that ``logprobs`` report for ``logits`` [..., V]: those of the
    distribution tokens are sampled from (after temperature, top-k and top-p, as OpenAI reports
    them; −inf outside top-k / top-p). Greedy decoding (temperature 0) samples from none (its law
    is the one-hot of the argmax, which says nothing), so it reports the model's own distribution,
    the softmax at temperature 1 (what a scorer such as lm-eval's loglikelihood asks for)."""
    if config.greedy:
        return logits.float().log_softmax(-1)
    return sampling_logits(logits, config).log_softmax(-1)


def _numpy_view(values: torch.Tensor) -> np.ndarray | None:
    """``values`` as a numpy view where numpy can read it (a float32 or float64 CPU tensor outside
    autograd), else None: the reductions below read such rows through numpy."""
    if values.device.type == "cpu" and values.dtype in (torch.float32, torch.float64) and not values.requires_grad:
        return values.numpy()
    return None


def argmax_token(row: torch.Tensor) -> int:
    """The index of the largest of ``row`` [V] (the first of equal maxima, as ``torch.argmax``).
    A float CPU row is read through numpy, whose argmax is vectorised where torch's CPU argmax
    is a scalar loop (the greedy loop takes one per verified row and per draft: 34 against 4 µs for
    49,152 logits, warm, in issue 30's measurement, docs/history.md)."""
    array = _numpy_view(row)
    return int(row.argmax()) if array is None else int(array.argmax())


def all_finite(values: torch.Tensor) -> bool:
    """Whether no entry is NaN or ±inf: a float CPU tensor's smallest and largest entries (numpy's
    min and max carry a NaN through; no boolean copy is made), else ``torch.isfinite``."""
    array = _numpy_view(values)
    if array is None:
        return bool(torch.isfinite(values).all())
    return bool(np.isfinite(array.min()) and np.isfinite(array.max()))


def greedy_choice(row: torch.Tensor) -> tuple[int, float] | None:
    """A greedy draft step's token and confidence from its logits ``row`` [V]: ``argmax_token``
    and ``top_probability`` of the same row in one read, None where the row is not all finite
    (``all_finite``). Why one: after the target's pass every call on the row is cold, and a float32
    CPU row takes one call of the noise extension (``_keyed_noise.top_choice``, on a vector loop:
    ``_reads_directly``) where numpy takes five
    (argmax, min, a difference, exp, sum) and two arrays (the maximum both need is the argmax's entry:
    the argmax lands on a NaN or +inf if there is one; the min on −inf)."""
    if _reads_directly(row):
        return _keyed_noise.top_choice(row.data_ptr(), row.shape[0], _NOISE_LOOP)
    array = _numpy_view(row)
    if array is None:
        return (argmax_token(row), top_probability(row)) if all_finite(row) else None
    if not array.size:
        raise SamplingError("an empty row has no largest entry")
    index = int(array.argmax())
    largest = array[index]
    if not (np.isfinite(largest) and np.isfinite(array.min())):
        return None
    return index, float(1.0 / np.exp(array - largest).sum())


def top_probability(row: torch.Tensor) -> float:
    """The largest probability of softmax(``row``) at temperature 1 (a drafter's confidence in its
    token), for a row [V] of finite logits: 1 / Σ exp(x − max x), by the noise extension on a
    float32 CPU row (``greedy_choice``'s sum, the same float), else through numpy or torch. Why not
    ``row.softmax(-1).max()``: two torch operators a draft step, each cold after the target's pass on
    a CPU whose caches the pass empties."""
    if _reads_directly(row):
        choice = _keyed_noise.top_choice(row.data_ptr(), row.shape[0], _NOISE_LOOP)
        if choice is not None:
            return choice[1]
    array = _numpy_view(row)
    if array is None:
        return float(row.float().softmax(-1).max())
    return float(1.0 / np.exp(array - array.max()).sum())


def _reads_directly(row: torch.Tensor) -> bool:
    """Whether the noise extension reads ``row`` where it lies: a non-empty float32 CPU row [V] whose
    entries lie one after another, on a vector loop (AVX2 or AVX-512: the plain loop, the reference,
    sums one entry at a time — warm on a Zen 3, 8,192 logits 95 µs against numpy's 55 and the AVX2
    loop's 11; results/zen3/stop75/top_choice_loops.log)."""
    return (_NOISE_LOOP > 0 and row.dtype == torch.float32 and row.device.type == "cpu" and row.dim() == 1
            and row.shape[0] > 0 and row.stride(0) == 1)


def row_argmax(logits: torch.Tensor):
    """``i → `` the first maximum of ``logits[i]`` for rows [r, V], each taken when asked (a walk
    that stops early reads fewer rows; ``first_maxima``); a row the walk reads that holds a NaN is
    refused, as ``walks.chain_batch_walks`` refuses it. The table is prepared once, not per row."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32:
        table = _float_rows(logits)

        def first(i: int) -> int:
            return _kernel_rows(table, [i], None, SamplingError)[0]
    else:
        def first(i: int) -> int:
            return _first_maxima_by_torch(logits, [i])[0]

    def at(i: int) -> int:
        token = first(i)
        if token < 0:
            raise SamplingError(f"row {i} of the target's scores holds a NaN")
        return token

    return at


def temperature_one_probs(logits: torch.Tensor) -> torch.Tensor:
    """Plain softmax, used for confidence and deferral bits, which are taken at T = 1
    (docs/algorithms.md §Verification rules)."""
    return logits.float().softmax(-1)


def gumbel_argmax(probs: torch.Tensor, gumbel: torch.Tensor) -> torch.Tensor:
    """argmax_v(log probs(v) + gumbel(v)) over the last dimension: probs [..., V], gumbel [..., V]
    → token ids [...]. With standard Gumbel noise the result is an exact draw from ``probs``
    (tokens of probability 0 are never chosen); with the same noise, two distributions choose
    the same token whenever their perturbed maxima agree (the coupling the lossless rule uses)."""
    return (probs.log() + gumbel.to(probs.device)).argmax(-1)


# What a keyed draw is for; a different purpose at the same position is independent noise.
TOKEN = "token"  # g_t [V]: the target's token at t (coupled rule, bonus draws); every drafter drafts with it
ACCEPT = "accept"  # one uniform: the acceptance coin of the draft at t (residual-style rules)
RESIDUAL = "residual"  # g'_t [V]: the replacement drawn after the draft at t was not kept


class SeedError(TierspecError):
    """A seed that is not an integer."""


SEED_MODULUS = 2**64  # as torch.manual_seed reads a seed


def seed_of(seed: int | torch.Generator | None) -> int:
    """The seed of a generation in [0, 2⁶⁴): any integer, taken modulo 2⁶⁴ as
    ``torch.manual_seed`` takes it; a ``torch.Generator`` stands for the seed it was seeded with
    (``initial_seed``), so ``torch.Generator().manual_seed(s)`` and ``s`` give the same text;
    None draws a fresh seed from torch's default generator (so ``torch.manual_seed`` still fixes
    an unseeded run)."""
    if seed is None:
        return int(torch.randint(0, 2**62, (1,)))
    if isinstance(seed, torch.Generator):
        return int(seed.initial_seed())
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise SeedError(f"the seed must be an integer, got {seed!r}")
    return seed % SEED_MODULUS


#: Rows from which ``keyed_argmax`` shares its rows among threads (``share_rows_among``), by the noise
#: loop (plain, AVX2, AVX-512). AVX2, measured right after a pass of as many rows of the default model
#: (2-core Zen 3, the logits where the pass left them; medians of 20, three runs): 8 / 12 / 16 rows took
#: 884 / 1,271 / 1,562, 791 / 1,099 / 1,418 and 808 / 1,244 / 1,505 µs on one thread, 728 / 949 /
#: 1,059, 786 / 791 / 962 and 667 / 1,116 / 1,207 on two; split in halves, 4 rows took 444 µs either
#: way and 2 rows 287 on one, 375 on two (handing rows to a thread that wakes costs more than a row).
#: The AVX-512 loop scans a row 2.9× faster (Zen 4, rows of a 12-row pass: 22.6 against 66.0 µs,
#: benchmarks/noise_rows.py), so the rows that pay for the hand-over are about 2.9× as many: 24. Measured there
#: (benchmarks/batch_cycle.py, batches of 8 at temperature 1, 12.2 rows a pass, alternating): deciding took
#: 0.485 and 0.524 ms a cycle shared from 8 rows, 0.35 and 0.35 on one thread.
PARALLEL_ROWS_BY_LOOP = (8, 8, 24)
PARALLEL_ROWS = PARALLEL_ROWS_BY_LOOP[_NOISE_LOOP]
#: Token keys made at once (``Noise.token_keys``): a cycle commits one to a few positions.
TOKEN_KEYS_AHEAD = 16
_row_threads = 1
_row_pool: tuple[ThreadPoolExecutor, int] | None = None  # the workers and how many


def share_rows_among(threads: int) -> int:
    """``keyed_argmax`` splits ``PARALLEL_ROWS`` rows or more among up to ``threads`` threads (the
    calling one and ``threads`` − 1 kept workers; each row is computed whole by one thread, so the
    tokens are the same). Returns the previous count. ``engine.torch_ops_on_one_thread`` sets it
    to the engine's threads while a generation runs."""
    global _row_threads
    previous, _row_threads = _row_threads, max(1, int(threads))
    return previous


def _forget_row_pool() -> None:  # a forked child has none of its parent's threads
    global _row_pool
    _row_pool = None


os.register_at_fork(after_in_child=_forget_row_pool)


def _row_workers(count: int) -> ThreadPoolExecutor:
    """Kept workers, ``count`` at least (made once; more only if a larger count is asked for)."""
    global _row_pool
    if _row_pool is None or _row_pool[1] < count:
        _row_pool = (ThreadPoolExecutor(max_workers=count, thread_name_prefix="tierspec-noise"), count)
    return _row_pool[0]


def _rows_shared(rows_from, count: int, helpers: int) -> None:
    """``rows_from(r, r + 1)`` for every row r < ``count``, claimed one at a time by the calling
    thread and ``helpers`` workers: a worker the OS has not scheduled yet delays nothing (the caller
    takes its rows and waits only for rows a worker is computing)."""
    next_row = itertools.count().__next__  # one call is one step of C code: no two threads get a row twice
    finished, errors = [0], []
    lock = threading.Condition()

    def claim() -> None:
        while (row := next_row()) < count:
            try:
                rows_from(row, row + 1)
            except BaseException as error:  # handed to the caller, which would otherwise wait for the row
                errors.append(error)
            with lock:
                finished[0] += 1
                lock.notify_all()

    workers = _row_workers(helpers)
    for _ in range(helpers):
        workers.submit(claim)
    claim()
    with lock:
        lock.wait_for(lambda: finished[0] == count)
    if errors:
        raise errors[0]


#: A row's draw that a pass did not make (``cached_model.RowDraws``: no key, or a row holding +inf or only
#: −inf, which ``keyed_tokens`` draws after the pass).
NOT_DRAWN = -2


class NoiseError(SamplingError):
    """Scores a perturbed argmax cannot choose from (a NaN), or keys that do not match them."""


def keyed_argmax(scores: torch.Tensor, keys: list[int], rows: list[int] | None = None) -> np.ndarray:
    """``keyed_tokens`` as an array [r] (int64)."""
    return np.asarray(keyed_tokens(scores, keys, rows), dtype=np.int64)


def keyed_tokens(scores: torch.Tensor, keys: list[int], rows: list[int] | None = None) -> list[int]:
    """argmax_v(scores[r, v] + g_r(v)) for every row of ``scores`` [r, V] (log-probabilities or
    logits, float32; −inf: excluded), g_r the Gumbel noise of ``keys[r]`` (``Noise.key``): the first
    of equal maxima (a row that excludes every token: its first; a NaN is refused), as argmax over
    the whole ``Noise.gumbel`` vector gives it (bit for bit), without
    drawing every token's noise (csrc/noise/keyed_noise.c: a bound read from the counter's bits passes
    over the tokens that cannot win). ``rows``: only these rows of ``scores``, in this order, one key
    each (read where they lie: nothing is gathered). Returns the tokens, one per row.

    Unless they are shared among threads (``PARALLEL_ROWS`` rows or more, ``share_rows_among``), the
    rows go to the kernel in one call that reads the keys and rows as Python ints and returns ints:
    no numpy on the way, whose calls each cost 10–50 µs right after a pass has swept the caches (the
    decode loop's one to a few rows a cycle)."""
    table = _float_rows(scores)
    count = table.shape[0] if rows is None else len(rows)
    if len(keys) != count:
        raise NoiseError(f"{count} rows of scores need {count} keys, got {len(keys)}")
    if not count:
        return []
    if count >= PARALLEL_ROWS and _row_threads > 1:
        tokens = _keyed_rows_shared(table, keys, rows)
    else:
        tokens = _kernel_rows(table, rows, keys, NoiseError)
    if -1 in tokens:
        bad = tokens.index(-1)
        raise NoiseError(f"row {bad if rows is None else rows[bad]} of the scores to sample from holds a NaN")
    return tokens


def first_maxima(scores: torch.Tensor, rows: list[int] | None = None) -> list[int]:
    """The index of the first maximum of every row of ``scores`` [r, V] (``rows``: only these
    rows, in this order, read where they lie), as ``argmax`` gives it; −1 for a row holding a NaN
    (the caller refuses it where it reads that row: a greedy walk takes every row's maximum at once
    and reads them only up to its first rejection). Float32 CPU rows go to the kernel as
    ``keyed_tokens``' do (no numpy after the pass); others are reduced by torch where they lie,
    in their own precision (a float64 model's near ties are not rounded away; an accelerator's
    rows send back only their tokens)."""
    if scores.device.type != "cpu" or scores.dtype != torch.float32:
        return _first_maxima_by_torch(scores, rows)
    return _kernel_rows(_float_rows(scores), rows, None, SamplingError)


def _kernel_rows(table: torch.Tensor, rows: list[int] | None, keys: list[int] | None, error: type) -> list[int]:
    """``_keyed_noise.argmax_rows`` over ``table`` (``_float_rows``): each chosen row's perturbed argmax
    under its key, or its first maximum without keys; −1 for a NaN row; a row outside the table
    raises ``error``."""
    try:
        return _keyed_noise.argmax_rows(table.data_ptr(), table.shape[0], table.shape[1], table.stride(0), rows, keys,
                                        _NOISE_LOOP)
    except IndexError:
        raise error(f"rows {list(rows)} are not all among the scores' {table.shape[0]}") from None


def _first_maxima_by_torch(scores: torch.Tensor, rows: list[int] | None = None) -> list[int]:
    """``first_maxima`` by torch's operators, where the rows lie and in their dtype."""
    table = scores.reshape(-1, scores.shape[-1])
    if rows is not None:
        if any(not 0 <= r < table.shape[0] for r in rows):
            raise SamplingError(f"rows {list(rows)} are not all among the scores' {table.shape[0]}")
        table = table[torch.tensor(rows, dtype=torch.long, device=table.device)]
    return torch.where(table.isnan().any(-1), -1, table.argmax(-1)).tolist()


def _float_rows(scores: torch.Tensor) -> torch.Tensor:
    """``scores`` as a 2-D float32 CPU table whose rows the kernel reads (its last dimension
    contiguous; copied only where it is not)."""
    table = scores.reshape(-1, scores.shape[-1]) if scores.dim() != 2 else scores
    if table.dtype != torch.float32 or table.device.type != "cpu" or table.stride(-1) != 1 or table.requires_grad:
        table = table.detach().to("cpu", torch.float32).contiguous()
    return table


def _keyed_rows_shared(table: torch.Tensor, keys: list[int], rows: list[int] | None) -> list[int]:
    """``keyed_tokens`` of many rows, claimed one at a time by the caller and the row workers
    (each row whole on one thread: the same tokens)."""
    picked = None if rows is None else [int(r) for r in rows]
    if picked is not None and any(not 0 <= r < table.shape[0] for r in picked):
        raise NoiseError(f"rows {picked} are not all among the scores' {table.shape[0]}")
    count = table.shape[0] if picked is None else len(picked)
    tokens = np.empty(count, dtype=np.int64)
    key_array = np.asarray(keys, dtype=np.uint64)
    vocab, stride, size = int(table.shape[1]), int(table.stride(0)), table.element_size()
    base = table.data_ptr()

    def rows_from(first: int, end: int) -> None:  # rows first .. end − 1 (the kernel lets go of the GIL)
        if picked is None:
            _keyed_noise.gumbel_argmax(base + first * stride * size, end - first, vocab, stride,
                                       key_array.ctypes.data + first * 8, tokens.ctypes.data + first * 8, _NOISE_LOOP)
            return
        for at in range(first, end):
            _keyed_noise.gumbel_argmax(base + picked[at] * stride * size, 1, vocab, stride,
                                       key_array.ctypes.data + at * 8, tokens.ctypes.data + at * 8, _NOISE_LOOP)

    _rows_shared(rows_from, count, min(_row_threads, count) - 1)
    return tokens.tolist()


@dataclass
class Noise:
    """The randomness of one generation, every draw keyed by (seed, position, purpose).

    ``position`` is the absolute index of a token in the sequence (the prompt's tokens are
    0 .. n−1). Each key (``key``: a hash of the three) names its own stream, so a draw does not
    depend on the draws made before it: a drafter and the rule see the same g_t for position t, a
    position drafted again after a rejection sees it again, and nothing about the run's timing
    reaches the tokens. A key's noise is a counter-based stream (csrc/noise/keyed_noise.c: any
    token's value on its own, the same bits on every CPU); a token is drawn from it by
    ``keyed_argmax`` without making the whole vector, and the vector itself (``gumbel``) is made
    where a caller needs it, the token noise of the positions still ahead kept until
    ``forget_before`` passes them.
    """

    seed: int | torch.Generator | None  # anything ``seed_of`` takes; an int in [0, 2⁶⁴) once made
    vocab_size: int
    _kept: dict[int, torch.Tensor] = field(default_factory=dict, repr=False)
    # (p, the token keys of positions p, p + 1, ...) made ahead (``token_keys``): one tuple, replaced whole
    _token_keys: tuple[int, list[int]] = field(default=(0, []), init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.seed = seed_of(self.seed)

    def key(self, position: int, purpose: str = TOKEN) -> int:
        """The 64-bit key of the draws for ``position`` and ``purpose`` (token keys: ``token_keys``)."""
        if purpose == TOKEN:
            start, keys = self._token_keys
            if 0 <= position - start < len(keys):
                return keys[position - start]
            return self.token_keys(position, 1)[0]
        return self._hash(position, purpose)

    def token_keys(self, position: int, count: int) -> list[int]:
        """The token keys of positions ``position`` .. ``position + count − 1``. Made
        ``TOKEN_KEYS_AHEAD`` positions at a time (or ``count``, if more) and kept until a position
        outside them is asked: the loop asks one or a few a cycle, each sequence of a batch right
        after a pass, when the hash's code and data are out of the caches; a run of them costs little
        more than the first, and a slice of a list kept by position is the least a cycle reads (kept
        by position in a dict, a block's keys cost a batch of 8 at t=1 5.7 µs a sequence a cycle,
        1.6 of them the hash, instrumented on a Zen 4; its drafting read 11–18 µs a cycle less by
        the slice, ``results/zen4/noise_keys``)."""
        if count < 0:
            raise ValueError(f"a count of keys must be >= 0, got {count}")
        start, keys = self._token_keys
        at = position - start
        if at < 0 or at + count > len(keys):
            keys = [self._hash(p, TOKEN) for p in range(position, position + max(count, TOKEN_KEYS_AHEAD))]
            self._token_keys, at = (position, keys), 0
        return keys[at : at + count]

    def _hash(self, position: int, purpose: str) -> int:
        # blake2b, not hash(): Python salts string hashes per process.
        digest = hashlib.blake2b(f"{self.seed}/{position}/{purpose}".encode(), digest_size=8).digest()
        return int.from_bytes(digest, "little")

    def gumbel(self, position: int, purpose: str = TOKEN) -> torch.Tensor:
        """Standard Gumbel noise [V] (float32, CPU) for ``position`` and ``purpose``: values in
        [−3.6, 36.7] (uniforms of 53 bits: no token is cut off below the top)."""
        if purpose == TOKEN and position in self._kept:
            return self._kept[position]
        noise = gumbel_rows([self.key(position, purpose)], self.vocab_size)[0]
        if purpose == TOKEN:
            self._kept[position] = noise
        return noise

    def gumbel_at(self, position: int, ids: torch.Tensor, purpose: str = TOKEN) -> torch.Tensor:
        """``gumbel(position, purpose)[ids]`` for token ids [K] (int64), bit for bit, without the whole
        vector where it is not kept: a drafter with a reduced vocabulary reads its tokens' noise only
        (``gumbel_values``)."""
        if purpose == TOKEN and position in self._kept:
            return self._kept[position][ids]
        return gumbel_values(self.key(position, purpose), ids, self.vocab_size)

    def argmax(self, scores: torch.Tensor, position: int, purpose: str = TOKEN) -> int:
        """argmax_v(scores[v] + g(v)) for ``scores`` [V] with this position's noise (``keyed_tokens``)."""
        return keyed_tokens(scores[None], [self.key(position, purpose)])[0]

    def uniform(self, position: int, purpose: str = ACCEPT) -> float:
        """One U(0, 1) draw for ``position`` and ``purpose``: 53 bits, never 0 or 1."""
        return ((_keyed_noise.mix64(self.key(position, purpose)) >> 11) + 0.5) * 2.0**-53

    def forget_before(self, position: int) -> None:
        """Drop kept noise of positions < ``position`` (committed: never drawn for again). The
        token keys made ahead are a few ints, replaced as the positions move on (``token_keys``)."""
        if self._kept:
            for kept in [p for p in self._kept if p < position]:
                del self._kept[kept]

    def block(self, start: int) -> "BlockNoise":
        return BlockNoise(self, start)


def gumbel_rows(keys: list[int], vocab_size: int) -> torch.Tensor:
    """[len(keys), V] float32: row r the whole Gumbel noise vector of ``keys[r]``."""
    out = torch.empty(len(keys), vocab_size, dtype=torch.float32)
    if keys:
        key_array = np.asarray(keys, dtype=np.uint64)
        _keyed_noise.fill_gumbel(key_array.ctypes.data, len(keys), vocab_size, out.data_ptr(), _NOISE_LOOP)
    return out


def gumbel_values(key: int, ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[K] float32: the Gumbel noise of ``key`` at token ids [K] — ``gumbel_rows([key], vocab_size)[0][ids]``
    bit for bit (csrc/noise: each token's counter, the fill's operations), at a K-th of the vocabulary's
    cost. An id outside 0 .. vocab_size − 1 is refused."""
    ids = ids.reshape(-1).to("cpu", torch.int64).contiguous()
    out = torch.empty(ids.shape[0], dtype=torch.float32)
    try:
        _keyed_noise.gather_gumbel(key, ids.data_ptr(), ids.shape[0], vocab_size, out.data_ptr(), _NOISE_LOOP)
    except IndexError as error:
        raise NoiseError(str(error)) from None
    return out


@dataclass(slots=True)
class BlockNoise:
    """The noise of one draft–verify block whose token i sits at position ``start`` + i (draft
    token i for i < k; the correction or bonus token after them). Drafters and rules index by i."""

    noise: Noise
    start: int

    def gumbel(self, i: int) -> torch.Tensor:
        """g [V], the token noise of block position i."""
        return self.noise.gumbel(self.start + i)

    def gumbel_at(self, i: int, ids: torch.Tensor) -> torch.Tensor:
        """g[ids] [K], block position i's token noise at token ids [K] (``Noise.gumbel_at``)."""
        return self.noise.gumbel_at(self.start + i, ids)

    def gumbels(self, count: int) -> torch.Tensor:
        """[count, V]: the token noise of block positions 0 .. count − 1."""
        if count == 0:
            return torch.empty(0, self.noise.vocab_size)
        if count == 1:
            return self.gumbel(0)[None]  # a view: the one row as it is
        return torch.stack([self.gumbel(i) for i in range(count)])

    def keys(self, count: int, first: int = 0) -> list[int]:
        """The token-noise keys of block positions first .. first + count − 1 (``keyed_argmax``)."""
        return self.noise.token_keys(self.start + first, count)

    def token(self, i: int, probs: torch.Tensor) -> int:
        """A draw from ``probs`` [V] at block position i with its token noise (a drafter's draft,
        the target's bonus token): argmax(log probs + g)."""
        return self.noise.argmax(probs.log(), self.start + i)

    def residual(self, i: int, probs: torch.Tensor) -> int:
        """A draw from ``probs`` [V] with noise of its own: the replacement after the draft at i was
        not kept, which must not depend on the draft (drawn with the token noise)."""
        return self.noise.argmax(probs.log(), self.start + i, RESIDUAL)

    def coin(self, i: int) -> float:
        """The acceptance coin U(0, 1) of the draft at block position i."""
        return self.noise.uniform(self.start + i, ACCEPT)

    def shifted(self, offset: int) -> "BlockNoise":
        """The same noise for a block that starts ``offset`` positions later (a drafter that runs
        an inner speculative walk of its own)."""
        return BlockNoise(self.noise, self.start + offset)


def residual_distribution(target: torch.Tensor, draft: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """norm(max(0, target − scale·draft)) [V]; falls back to ``target`` when that is all zero.

    ``scale = 1`` is the residual of exact speculative decoding (docs/algorithms.md §Exact
    speculative decoding); ``scale = β`` is the lossy residual (§Lossy speculative decoding). The
    fallback happens when target ≤ scale·draft everywhere (e.g. target == draft), where the
    residual is never needed with probability > 0 in the exact rule; drawing from the target
    keeps the lossy rule well defined.
    """
    residual = (target - scale * draft).clamp_min(0.0)
    total = residual.sum()
    if total <= 0:
        return target
    return residual / total


def one_hot(token: int, vocab_size: int) -> torch.Tensor:
    """The distribution of a drafter that has none (n-gram lookup): all mass on its token."""
    probs = torch.zeros(vocab_size)
    probs[token] = 1.0
    return probs


def one_hot_rows(tokens: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[k, V] float32: ``one_hot`` of each token of ``tokens`` [k]."""
    return torch.nn.functional.one_hot(tokens.long(), vocab_size).float()
