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

import hashlib
import json
import os
import random
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from ..cached_model import CachedModel
from ..errors import TierspecError
from ..models import LoadedModel
from ..util import atomic_write_text, one_line, write_error
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


#: The progress file's format (its header's ``format``): a different one is not resumed.
PROGRESS_FORMAT = "tierspec-judge-mismatches/1"


def progress_path(out: Path) -> Path:
    """Where a build into ``out`` keeps its finished prompts until it ends: a hidden file beside it."""
    return out.with_name(f".{out.name}.progress.jsonl")


def _signature(target: LoadedModel, head, prompts: list[str], config: MismatchConfig) -> str:
    """What fixes the examples of every prompt: the target, the head's weights, the prompts and the
    settings (a resume with any other is not one)."""
    digest = hashlib.sha256()
    digest.update(json.dumps({"model": target.identity.to_dict(), "config": asdict(config)}, sort_keys=True).encode())
    for name, tensor in sorted(head.state_dict().items()):
        digest.update(name.encode())
        digest.update(tensor.detach().to(torch.float32).contiguous().numpy().tobytes())
    for prompt in prompts:
        digest.update(hashlib.sha256(prompt.encode()).digest())
    return digest.hexdigest()[:16]


@dataclass(frozen=True)
class _PromptDone:
    """One prompt's finished work, as its progress line records it."""

    index: int
    examples: list[str]  # judge JSONL lines
    harmless: int
    harmful: int
    seconds: float

    @classmethod
    def from_line(cls, line: str, prompts: int) -> "_PromptDone":
        record = json.loads(line)
        if not isinstance(record, dict):
            raise ValueError("a line that is not a record")
        done = cls(record["index"], record["examples"], record["harmless"], record["harmful"], float(record["seconds"]))
        counts = (done.index, done.harmless, done.harmful)
        if not all(type(n) is int and n >= 0 for n in counts) or done.index >= prompts:
            raise ValueError(f"a record with counts {counts} for {prompts} prompts")
        if not isinstance(done.examples, list) or not all(isinstance(e, str) for e in done.examples):
            raise ValueError("examples that are not JSONL lines")
        return done


def _resumed(path: Path, signature: str, prompts: int) -> tuple[dict[int, _PromptDone], str | None]:
    """The prompts a progress file holds as finished, and why it cannot be resumed (None: it can).
    A last line without its newline (the run killed while writing it) is dropped: its prompt runs again."""
    try:
        text = path.read_text()
        lines = text.split("\n")
        lines.pop()  # after the last newline: nothing, or a line torn mid-write (its prompt runs again)
        header = json.loads(lines[0])
        if not isinstance(header, dict) or header.get("format") != PROGRESS_FORMAT:
            raise ValueError("not a mismatch-data progress file")
        if header.get("signature") != signature:
            return {}, "its prompts were done with another model, head, prompt list or settings"
        finished: dict[int, _PromptDone] = {}
        for line in lines[1:]:
            done = _PromptDone.from_line(line, prompts)
            finished[done.index] = done
        return finished, None
    except (OSError, ValueError, KeyError, IndexError, TypeError, RecursionError) as error:
        return {}, f"damaged ({one_line(error)[:120] or type(error).__name__})"


def _cut_torn_line(path: Path) -> None:
    """The file cut after its last newline: a line torn by a kill would glue itself to the next one
    appended, and the rerun after that would find the file damaged and start over."""
    data = path.read_bytes()
    keep = data.rfind(b"\n") + 1
    if keep < len(data):
        try:
            with open(path, "r+b") as handle:
                handle.truncate(keep)
        except OSError as error:
            raise write_error(path, error) from None


def _append_line(path: Path, line: str) -> None:
    """``line`` added to the progress file and on disk before the next prompt starts."""
    try:
        with open(path, "a") as handle:
            handle.write(line + "\n")
            handle.flush()
            os.fsync(handle.fileno())
    except OSError as error:
        raise write_error(path, error) from None


def build_mismatch_data(target: LoadedModel, head, prompts: list[str], out: Path, config: MismatchConfig = MismatchConfig(),
                        progress: bool = True) -> dict:
    """Write judge examples from the head's mismatches on ``prompts`` (never test sets) to
    ``out`` (JSONL, atomically); split by prompt into train / val.

    Each finished prompt's examples are kept in a progress file beside ``out`` (``progress_path``)
    until the end: a rerun with the same target, head, prompts and settings resumes after the
    prompts done and writes what one uninterrupted run writes (each prompt draws its sample of
    mismatches from its own seeded stream). The caller holds ``out`` (the CLI locks it)."""
    from tqdm.auto import tqdm

    from ..prompting import encode_prompt, eos_ids

    if target.tokenizer is None:
        raise TierspecError("mismatch data needs the target's tokenizer")
    out = Path(out)
    eos = set(eos_ids(target))
    order = list(range(len(prompts)))
    random.Random(config.seed).shuffle(order)
    val = set(order[: round(config.val_fraction * len(prompts))])
    signature = _signature(target, head, prompts, config)
    log = progress_path(out)
    finished: dict[int, _PromptDone] = {}
    if log.exists():
        finished, problem = _resumed(log, signature, len(prompts))
        if problem is not None:
            print(f"tierspec: {log}: {problem}; the build starts over", file=sys.stderr)
        elif finished:
            print(f"tierspec: resuming from {log}: {len(finished)} of {len(prompts)} prompts done", file=sys.stderr)
            _cut_torn_line(log)
    if not finished:
        atomic_write_text(log, json.dumps({"format": PROGRESS_FORMAT, "signature": signature}) + "\n")
    decode = target.tokenizer.decode
    bar = tqdm(total=len(prompts), initial=len(finished), desc="mismatches", disable=not progress)
    with torch.inference_mode():
        for index in range(len(prompts)):
            if index in finished:
                continue
            started = time.perf_counter()
            rng = random.Random(f"mismatch-sample/{config.seed}/{index}")  # its own stream: resumable
            prompt_ids = encode_prompt(target, prompts[index])
            answer, pairs = find_mismatches(target, head, prompt_ids, config, eos)
            if len(pairs) > config.per_prompt:
                pairs = sorted(rng.sample(pairs, config.per_prompt))
            lines, counts = [], {"harmless": 0, "harmful": 0}
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
            done = _PromptDone(index, lines, counts["harmless"], counts["harmful"], time.perf_counter() - started)
            _append_line(log, json.dumps(asdict(done)))
            finished[index] = done
            bar.update(1)
    bar.close()
    lines = [line for index in sorted(finished) for line in finished[index].examples]
    if not lines:
        log.unlink(missing_ok=True)
        raise TierspecError("no mismatches found: the head agrees with the target on every prompt given")
    atomic_write_text(out, "\n".join(lines) + "\n")
    log.unlink(missing_ok=True)
    harmless = sum(done.harmless for done in finished.values())
    harmful = sum(done.harmful for done in finished.values())
    return {"out": str(out), "examples": len(lines), "harmless": harmless, "harmful": harmful, "prompts": len(prompts),
            "seconds_total": round(sum(done.seconds for done in finished.values()), 1), "config": asdict(config)}


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
