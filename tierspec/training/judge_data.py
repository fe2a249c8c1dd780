"""Judge data: the JSONL format, an offline builder from GSM8K train, and token labels.

Format, one JSON object a line::

    {"id": "gsm8k-17-wrong", "prompt": "...", "response": "...", "mistake_offset": 123, "split": "train"}

``mistake_offset`` is the character offset in ``response`` of the first wrong character, or
null for a correct response. Token labels (Judge Decoding §4): tokens of a correct response
and tokens before the mistake are positive (1), the token holding the first wrong character
is negative (0), later tokens are dropped (None).
"""

from __future__ import annotations

import hashlib
import json
import random
import re
from dataclasses import dataclass
from pathlib import Path

from ..data import gsm8k_prompt
from ..errors import TierspecError
from ..util import atomic_write_text

_CALCULATOR = re.compile(r"<<[^>]*>>")
_RESULT = re.compile(r"=\s*\$?(-?\d[\d,]*(?:\.\d+)?)")


class JudgeDataError(TierspecError):
    pass


@dataclass(frozen=True)
class JudgeExample:
    id: str
    prompt: str
    response: str
    mistake_offset: int | None
    split: str = "train"

    def to_json(self) -> str:
        return json.dumps(self.__dict__)


def clean_solution(answer: str) -> str:
    """GSM8K reference → natural text: calculator annotations removed, '#### N' spelled out."""
    text = _CALCULATOR.sub("", answer)
    body, _, final = text.rpartition("####")
    return f"{body.strip()}\nThe answer is {final.strip()}." if body else text.strip()


def plant_error(solution: str, rng: random.Random) -> tuple[str, int] | None:
    """Change one intermediate result ('= N') that a later line reuses, when there is one (else
    the first); return the wrong solution and the offset of its first wrong character."""
    results = list(_RESULT.finditer(solution))
    if not results:
        return None
    reused = [m for m in results if m.group(1) in solution[m.end():]]
    match = rng.choice(reused) if reused else results[0]
    original = match.group(1)
    value = float(original.replace(",", ""))
    for _ in range(20):
        delta = rng.choice([-3, -2, -1, 1, 2, 3, 4, 5, 10])
        changed = value * 2 if rng.random() < 0.2 else value + delta
        new = str(int(changed)) if float(changed).is_integer() and "." not in original else f"{changed:g}"
        if new != original.replace(",", "") and not new.startswith("-"):
            break
    else:
        return None
    start, end = match.span(1)
    wrong = solution[:start] + new + solution[end:]
    first_diff = next((i for i, (a, b) in enumerate(zip(original, new)) if a != b), min(len(original), len(new)))
    return wrong, start + first_diff


_WORD = re.compile(r"\S+")


def plant_copy_error(solution: str, question: str, rng: random.Random, max_words: int = 6) -> tuple[str, int] | None:
    """The mistake a copying (n-gram) drafter makes: at a random word of ``solution``, continue
    with the words that followed the latest earlier occurrence of the previous word (in the
    question or the solution so far) instead of the right ones. Returns the wrong response
    (cut after the copied words: later text is unlabelled anyway) and the offset of its first
    wrong character, or None where no such continuation differs from the solution.

    Planted arithmetic errors only teach the judge that a number is wrong; without these, a head
    accepts any fluent-looking copy (measured: an n-gram drafter then runs away on GSM8K)."""
    spans = list(_WORD.finditer(solution))
    words = [m.group() for m in spans]
    question_words = _WORD.findall(question)
    positions = list(range(1, len(words)))
    rng.shuffle(positions)
    for i in positions:
        history = question_words + words[: i - 1]
        hits = [j for j, w in enumerate(history) if w == words[i - 1] and j + 1 < len(history)]
        if not hits:
            continue
        copied = history[hits[-1] + 1 : hits[-1] + 1 + rng.randint(2, max_words)]
        if copied[0] == words[i]:
            continue  # the copy starts right: its mistake, if any, is for a later word
        start = spans[i].start()
        wrong = solution[:start] + " ".join(copied)
        first_diff = next((k for k, (a, b) in enumerate(zip(wrong[start:], solution[start:])) if a != b), None)
        if first_diff is None:
            continue  # the copy is a prefix of the truth: nothing wrong
        return wrong, start + first_diff
    return None


ERROR_KINDS = ("arithmetic", "copy")


def build_gsm8k_judge_data(train_path: Path, out: Path, count: int = 500, val_fraction: float = 0.2, seed: int = 0,
                           errors: tuple[str, ...] = ERROR_KINDS) -> dict:
    """Write ``count`` problems as a correct response and one wrong response per error kind
    (``arithmetic``: a changed intermediate result later lines reuse; ``copy``: an n-gram
    drafter's wrong continuation), as JSONL, atomically."""
    unknown = set(errors) - set(ERROR_KINDS)
    if unknown or not errors:
        raise JudgeDataError(f"error kinds must be among {', '.join(ERROR_KINDS)}; got {', '.join(errors) or 'none'}")
    from ..data import read_jsonl

    rows = read_jsonl(Path(train_path))
    rng = random.Random(seed)
    chosen = rng.sample(range(len(rows)), min(count, len(rows)))
    n_val = max(1, round(len(chosen) * val_fraction))
    examples = []
    for rank, index in enumerate(chosen):
        row = rows[index]
        split = "val" if rank < n_val else "train"
        correct = clean_solution(row["answer"])
        planted = {
            "arithmetic": plant_error(correct, random.Random(f"{seed}-{index}")) if "arithmetic" in errors else None,
            "copy": plant_copy_error(correct, row["question"], random.Random(f"{seed}-{index}-copy")) if "copy" in errors else None,
        }
        if not any(planted.values()):
            continue
        prompt = gsm8k_prompt(row["question"])
        examples.append(JudgeExample(f"gsm8k-{index}-correct", prompt, correct, None, split))
        for kind, wrong in planted.items():
            if wrong is not None:
                suffix = "wrong" if kind == "arithmetic" else kind  # "-wrong": the id of the first data format
                examples.append(JudgeExample(f"gsm8k-{index}-{suffix}", prompt, wrong[0], wrong[1], split))
    text = "\n".join(e.to_json() for e in examples) + "\n"
    atomic_write_text(Path(out), text)
    return {"examples": len(examples), "val": sum(e.split == "val" for e in examples), "sha256": hashlib.sha256(text.encode()).hexdigest()}


def read_judge_data(path: Path) -> list[JudgeExample]:
    examples = []
    for number, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            example = JudgeExample(str(record["id"]), record["prompt"], record["response"], record.get("mistake_offset"),
                                   record.get("split", "train"))
        except (json.JSONDecodeError, KeyError, TypeError) as error:
            raise JudgeDataError(f"{path}:{number}: not a judge record ({error})") from None
        if example.mistake_offset is not None and not 0 <= example.mistake_offset < len(example.response):
            raise JudgeDataError(f"{path}:{number}: mistake_offset {example.mistake_offset} is outside the response")
        examples.append(example)
    if not examples:
        raise JudgeDataError(f"{path} holds no judge record")
    check_judge_data(examples, path)
    return examples


def check_judge_data(examples: list[JudgeExample], path) -> None:
    """Refuse data a head cannot be trained or validated on, before any feature extraction:
    each split needs responses with a planted mistake (negatives) and responses without."""
    for split in ("train", "val"):
        chosen = [e for e in examples if e.split == split]
        if not chosen:
            raise JudgeDataError(f"{path}: judge data needs both a 'train' and a 'val' split; '{split}' is empty")
        if all(e.mistake_offset is None for e in chosen):
            raise JudgeDataError(f"{path}: the '{split}' split has no response with a mistake (no negative examples); "
                                 "a judge needs both classes")


def token_labels(offsets: list[tuple[int, int]], mistake_offset: int | None) -> list[int | None]:
    """Labels for response tokens with character spans ``offsets``: 1 before the mistake,
    0 for the token holding the first wrong character, None after it."""
    labels: list[int | None] = []
    seen_mistake = False
    for start, end in offsets:
        if mistake_offset is None:
            labels.append(1)
        elif seen_mistake:
            labels.append(None)
        elif end <= mistake_offset:
            labels.append(1)
        else:
            labels.append(0)
            seen_mistake = True
    return labels
