"""Judge data from the draft head's own mismatches with the target.

Planted GSM8K errors teach the judge what an arithmetic slip looks like; the tokens it must
rule on in practice are the draft head's disagreements with the target. This builder finds
them and labels each one.

A mismatch at position i: the target's greedy token is t_i, the head's first draft there (from
the target's own features, as in decoding) is d ≠ t_i. It is **harmless** when the target,
continuing greedily from the draft token, comes back to the text it would have written anyway
within ``window`` tokens: some ``match`` consecutive tokens of its continuation after d equal
``match`` consecutive tokens of its own continuation after t_i (``rejoins``). The draft was then
a different way into the same text ("It's" for "It is", a comma the target writes one token
later); accepting it changes a few tokens, not what the answer says. Otherwise it is harmful:
the target, given d, goes somewhere else.

Written in the judge JSONL format (``training.judge_data``): the response is the target's text up to i,
then d and the target's continuation from d; a harmful mismatch sets ``mistake_offset`` to the
draft token's first character, a harmless one leaves it null (all its tokens are positive).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

import torch

from ..cached_model import CachedModel
from ..errors import TierspecError
from ..models import LoadedModel
from ..util import atomic_write_text
from .judge_data import JudgeExample


def rejoins(original: list[int], alternative: list[int], window: int = 8, match: int = 3) -> bool:
    """Whether ``alternative`` (the target's continuation after the draft token) reaches, within
    its first ``window`` tokens, ``match`` consecutive tokens that ``original`` (its continuation
    after its own token) also has within its first ``window`` + ``match`` tokens."""
    if match < 1 or window < 1:
        raise TierspecError("window and match must be >= 1")
    grams = {tuple(original[m:m + match]) for m in range(0, max(len(original) - match + 1, 0)) if m < window + match}
    return any(tuple(alternative[j:j + match]) in grams for j in range(0, min(window, len(alternative) - match + 1)))


@dataclass(frozen=True)
class MismatchConfig:
    answer_tokens: int = 96  # the target's greedy answer per prompt
    window: int = 8  # tokens the target continues after the draft token
    match: int = 3  # consecutive tokens that count as rejoining
    per_prompt: int = 4  # mismatches kept per prompt at most (spread over the answer)
    val_fraction: float = 0.3
    seed: int = 0


def _greedy(target: LoadedModel, context: torch.Tensor, steps: int, eos: set[int]) -> list[int]:
    """The target's greedy continuation of ``context`` (plain decoding through the decode loop)."""
    from ..decode import DecodeConfig, decode
    from ..methods import build_method

    config = DecodeConfig(max_new_tokens=steps, eos_token_ids=tuple(eos))
    return [token for step in decode(target, build_method("ar", target), context, config) for token in step.new_tokens]


def find_mismatches(target: LoadedModel, head, prompt_ids: torch.Tensor, config: MismatchConfig,
                    eos: set[int]) -> tuple[list[int], list[tuple[int, int]]]:
    """The target's greedy answer and the (position, draft token) pairs where the head's first
    draft, from the target's features, differs from the answer's token."""
    from ..heads.draft import HeadRunner

    answer = _greedy(target, prompt_ids, config.answer_tokens, eos)
    sequence = torch.cat([prompt_ids, torch.tensor(answer, dtype=torch.long)])
    layers = tuple(head.config.feature_layers)
    features = CachedModel(target.model).forward(sequence[:-1], logits_for=1, with_hidden=True, hidden_layers=layers).hidden
    drafting = HeadRunner(head)
    h = drafting.extend(features, sequence[1:], from_target=True)  # h[p] predicts the feature after token p+1
    drafts = head.draft_ids.cpu()[drafting.logits(h).argmax(-1)]  # the draft for position p+2
    start = len(prompt_ids)
    pairs = []
    for i in range(1, len(answer)):  # answer token i sits at position start+i; its draft came from p = start+i-2
        draft = int(drafts[start + i - 2])
        if draft != answer[i]:
            pairs.append((i, draft))
    return answer, pairs


def build_mismatch_data(target: LoadedModel, head, prompts: list[str], out: Path, config: MismatchConfig = MismatchConfig(),
                        progress: bool = True) -> dict:
    """Write judge examples from the head's mismatches on ``prompts`` (never test sets) to
    ``out`` (JSONL, atomically); split by prompt into train / val."""
    from tqdm.auto import tqdm

    from ..prompting import encode_prompt, eos_ids

    if target.tokenizer is None:
        raise TierspecError("mismatch data needs the target's tokenizer")
    eos = set(eos_ids(target))
    rng = random.Random(config.seed)
    order = list(range(len(prompts)))
    rng.shuffle(order)
    val = set(order[: round(config.val_fraction * len(prompts))])
    lines, counts = [], {"harmless": 0, "harmful": 0, "prompts": len(prompts)}
    decode = target.tokenizer.decode
    with torch.inference_mode():
        for index in tqdm(range(len(prompts)), desc="mismatches", disable=not progress):
            prompt_ids = encode_prompt(target, prompts[index])
            answer, pairs = find_mismatches(target, head, prompt_ids, config, eos)
            if len(pairs) > config.per_prompt:
                pairs = sorted(rng.sample(pairs, config.per_prompt))
            for i, draft in pairs:
                prefix = answer[:i]
                context = torch.cat([prompt_ids, torch.tensor(prefix + [draft], dtype=torch.long)])
                alternative = _greedy(target, context, config.window + config.match, eos)
                harmless = rejoins(answer[i + 1:], alternative, config.window, config.match)
                counts["harmless" if harmless else "harmful"] += 1
                before = decode(prefix, skip_special_tokens=True)
                response = decode(prefix + [draft] + alternative, skip_special_tokens=True)
                if not response.startswith(before) or len(response) == len(before):
                    continue  # the draft token merged into the text before it: no offset to label
                # the id carries the draft token's character offset (its label is the example's verdict)
                example = JudgeExample(f"mismatch-{index}-{i}@{len(before)}", prompts[index], response,
                                       None if harmless else len(before), "val" if index in val else "train")
                lines.append(example.to_json())
    if not lines:
        raise TierspecError("no mismatches found: the head agrees with the target on every prompt given")
    atomic_write_text(Path(out), "\n".join(lines) + "\n")
    return {"out": str(out), "examples": len(lines), **counts, "config": config.__dict__}


def mismatch_prompts(count: int, data_dir: Path | None = None, seed: int = 0) -> list[str]:
    """Training prompts for mismatch data: the draft head's own training mix (GSM8K train, WMT14
    and CNN/DM items Spec-Bench does not use, XSum, synthesised), never Spec-Bench, MT-Bench or
    HumanEval questions."""
    from .draft_prompts import training_items

    own, _ = training_items(data_dir, seed=seed + 101)
    rng = random.Random(seed)
    rng.shuffle(own)
    return [item.prompt for item in own[:count]]


def draft_token_scores(tokens, scores: torch.Tensor, split: str) -> tuple[list[float], list[float]]:
    """Scores of the draft tokens of ``split``'s mismatch examples: (harmless ones, harmful ones).
    The draft token is the response token starting at the offset after ``@`` in the id."""
    harmless, harmful = [], []
    for i, (example, offset, s, label) in enumerate(zip(tokens.example, tokens.offset, tokens.split, tokens.labels.tolist())):
        if s != split or "@" not in example or offset != int(example.rpartition("@")[2]):
            continue
        (harmless if label == 1 else harmful).append(float(scores[i]))
    return harmless, harmful


def operating_curve(harmless: list[float], harmful: list[float], thresholds=None) -> list[dict]:
    """For each threshold δ: the share of harmless mismatches the judge accepts (tokens gained)
    and of harmful ones (fidelity lost)."""
    thresholds = thresholds or [round(0.05 * k, 2) for k in range(1, 20)]
    rows = []
    for delta in thresholds:
        rows.append({"threshold": delta,
                     "harmless_accepted": sum(s >= delta for s in harmless) / max(len(harmless), 1),
                     "harmful_accepted": sum(s >= delta for s in harmful) / max(len(harmful), 1)})
    return rows


def choose_operating_point(curve: list[dict], max_harmful: float) -> dict:
    """The lowest threshold whose harmful acceptance is ≤ ``max_harmful`` (the most tokens gained
    at that fidelity cost); the strictest threshold when none qualifies."""
    allowed = [row for row in curve if row["harmful_accepted"] <= max_harmful]
    return min(allowed, key=lambda row: row["threshold"]) if allowed else max(curve, key=lambda row: row["threshold"])
