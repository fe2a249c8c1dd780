"""Offline evaluation data (shipped in ``tierspec/datasets``, gzip-compressed, with their sources
and licences in ``SOURCES.md`` there) and the task prompt templates.

Every record becomes a ``Prompt``: the text fed to the chat template, its category, and the
reference the task metric needs (a final number, a summary, a translation, HumanEval tests; for
the JSON-extraction set, ``bench.json_extract``, the gold fields as JSON text, and the schema the
text is constrained to in ``extra["schema"]``).
"""

from __future__ import annotations

import gzip
import json
import os
import random
from dataclasses import dataclass, field
from pathlib import Path

from .errors import TierspecError

DATASETS = ("spec_bench", "gsm8k", "humaneval", "mt_bench", "cnn_dailymail", "xsum", "wmt14", "json_extract")
#: Datasets whose prompts carry a JSON schema (``Prompt.extra["schema"]``) the text is constrained to.
CONSTRAINED_DATASETS = ("json_extract",)
#: The JSON-extraction set's tasks (``bench.json_extract`` builds them and checks outputs).
JSON_EXTRACT_FILE = Path("json_extract") / "tasks.jsonl.gz"

# Spec-Bench lists its MT-bench part under the 8 MT-bench sub-categories; it has 6 tasks.
_MT_BENCH_SUBCATEGORIES = {"writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities"}


class DataError(TierspecError):
    pass


@dataclass(frozen=True)
class Prompt:
    id: str
    category: str
    text: str
    reference: str | None = None  # gold answer / summary / translation
    extra: dict = field(default_factory=dict, compare=False, hash=False)  # e.g. HumanEval test code


PACKAGED_DATA = Path(__file__).resolve().parent / "datasets"


def default_data_dir() -> Path:
    """``$TIERSPEC_DATA`` when set, else the copy shipped inside the package (works from any folder)."""
    if os.environ.get("TIERSPEC_DATA"):
        chosen = Path(os.environ["TIERSPEC_DATA"]).expanduser()
        if not chosen.is_dir():
            raise DataError(f"TIERSPEC_DATA={chosen} is not a folder")
        return chosen
    if not PACKAGED_DATA.is_dir():
        raise DataError(f"the packaged evaluation data is missing ({PACKAGED_DATA}); reinstall tierspec or pass --data-dir")
    return PACKAGED_DATA


def read_jsonl(path: Path) -> list[dict]:
    """Rows of ``path`` (a ``.jsonl`` file, or its ``.jsonl.gz`` twin when only that exists)."""
    if not path.exists() and path.suffix == ".jsonl" and path.with_name(path.name + ".gz").exists():
        path = path.with_name(path.name + ".gz")
    if not path.exists():
        raise DataError(f"data file {path} is missing")
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rt", encoding="utf-8") as handle:
            return [json.loads(line) for line in handle if line.strip()]
    except (OSError, EOFError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise DataError(f"data file {path} is damaged: {error}") from error


def gsm8k_prompt(question: str) -> str:
    return f"{question}\nSolve the problem step by step, then give the final answer as a number on the last line."


def summary_prompt(document: str, one_sentence: bool = False) -> str:
    task = "in one sentence" if one_sentence else "in a few sentences"
    return f"Summarize the following article {task}.\n\n{document.strip()}"


def translation_prompt(german: str) -> str:
    return f"Translate German to English: {german.strip()}"


def code_prompt(prompt: str) -> str:
    return f"Complete the following Python function. Reply with the whole function in a Python code block.\n\n```python\n{prompt}```"


def load_prompts(dataset: str, data_dir: Path | None = None, split: str = "test") -> list[Prompt]:
    """All prompts of ``dataset`` (see ``DATASETS``), in file order."""
    if dataset not in DATASETS:
        raise DataError(f"unknown dataset '{dataset}'; choose one of: {', '.join(DATASETS)}")
    root = Path(data_dir) if data_dir else default_data_dir()
    if dataset == "spec_bench":
        rows = read_jsonl(root / "spec_bench" / "question.jsonl")
        return [
            Prompt(
                f"spec_bench/{r['question_id']}",
                "mt_bench" if r["category"] in _MT_BENCH_SUBCATEGORIES else r["category"],
                r["turns"][0],
                (r.get("reference") or [None])[0],
            )
            for r in rows
        ]
    if dataset == "mt_bench":
        rows = read_jsonl(root / "mt_bench" / "question.jsonl")
        return [Prompt(f"mt_bench/{r['question_id']}", r["category"], r["turns"][0]) for r in rows]
    if dataset == "gsm8k":
        rows = read_jsonl(root / "gsm8k" / f"{split}.jsonl")
        return [
            Prompt(f"gsm8k-{split}/{i}", "math_reasoning", gsm8k_prompt(r["question"]), r["answer"], {"question": r["question"]})
            for i, r in enumerate(rows)
        ]
    if dataset == "humaneval":
        rows = read_jsonl(root / "humaneval" / "HumanEval.jsonl.gz")
        return [
            Prompt(
                r["task_id"],
                "coding",
                code_prompt(r["prompt"]),
                r["canonical_solution"],
                {"prompt": r["prompt"], "test": r["test"], "entry_point": r["entry_point"]},
            )
            for r in rows
        ]
    if dataset == "json_extract":
        rows = read_jsonl(root / JSON_EXTRACT_FILE)
        try:
            return [Prompt(f"json_extract/{r['id']}", r["shape"], r["prompt"],
                           None if r.get("reference") is None else json.dumps(r["reference"]), {"schema": r["schema"]})
                    for r in rows]
        except (KeyError, TypeError) as error:
            raise DataError(f"{JSON_EXTRACT_FILE} has a malformed task: {error}") from error
    if dataset == "cnn_dailymail":
        rows = read_jsonl(root / "cnn_dailymail" / "test.jsonl")
        return [
            Prompt(r["id"], "summarization", summary_prompt(r["article"]), r["highlights"], {"in_spec_bench": r.get("in_spec_bench", False)})
            for r in rows
        ]
    if dataset == "xsum":
        rows = read_jsonl(root / "xsum" / "test.jsonl")
        return [Prompt(f"xsum/{r['id']}", "summarization", summary_prompt(r["document"], True), r["summary"]) for r in rows]
    rows = read_jsonl(root / "wmt14" / "newstest2014_deen.jsonl")
    return [
        Prompt(f"wmt14/{r['id']}", "translation", translation_prompt(r["de"]), r["en"], {"in_spec_bench": r.get("in_spec_bench", False)})
        for r in rows
    ]


def select(prompts: list[Prompt], per_category: int | None = None, limit: int | None = None, seed: int = 0) -> list[Prompt]:
    """A seeded sample: up to ``per_category`` prompts of each category, then at most ``limit``.

    Categories keep their first-seen order; within one the sample is random but fixed by ``seed``.
    """
    rng = random.Random(seed)
    if per_category is not None:
        by_category: dict[str, list[Prompt]] = {}
        for prompt in prompts:
            by_category.setdefault(prompt.category, []).append(prompt)
        chosen = []
        for items in by_category.values():
            picked = sorted(rng.sample(range(len(items)), min(per_category, len(items))))
            chosen.extend(items[i] for i in picked)
        prompts = chosen
    elif limit is not None and limit < len(prompts):
        picked = sorted(rng.sample(range(len(prompts)), limit))
        prompts = [prompts[i] for i in picked]
    return prompts[:limit] if limit is not None else prompts


def calibration_prompts(count: int, data_dir: Path | None = None, seed: int = 0) -> list[str]:
    """A fixed, seeded mix of prompts for offline searches (DIMR), kept apart from the
    Spec-Bench test prompts: GSM8K train questions, WMT14 and CNN/DM items that Spec-Bench does
    not use, and XSum articles, in equal shares."""
    pools = [
        load_prompts("gsm8k", data_dir, split="train"),
        [p for p in load_prompts("wmt14", data_dir) if not p.extra.get("in_spec_bench")],
        [p for p in load_prompts("cnn_dailymail", data_dir) if not p.extra.get("in_spec_bench")],
        load_prompts("xsum", data_dir),
    ]
    rng = random.Random(seed)
    texts = []
    for i in range(count):
        pool = pools[i % len(pools)]
        texts.append(pool[rng.randrange(len(pool))].text)
    return texts


# -- encoder–decoder targets: prompts in T5's task format ------------------------------------

#: The datasets ``tierspec bench`` runs an encoder–decoder target on, with T5's task prefixes:
#: summarisation and English→German translation (the VIA-SD paper's Table 3 setting).
TASK_DATASETS = ("xsum", "cnn_dailymail", "wmt14")


def task_prompts(dataset: str, data_dir: Path | None = None):
    """The prompts of ``dataset`` in T5's task format, with the ids ``data.load_prompts`` gives
    them: ``summarize: <document>`` (XSum, CNN/DailyMail) and ``translate English to German:
    <English>`` (WMT14, with the German side as reference: T5's supervised mixture translates
    from English, and the paper's setting is En–De)."""
    if dataset not in TASK_DATASETS:
        raise DataError(f"an encoder–decoder target runs the bench on {', '.join(TASK_DATASETS)}, not on '{dataset}' "
                           "(its prompts are not in a T5 task format)")
    root = Path(data_dir) if data_dir else default_data_dir()
    if dataset == "xsum":
        return [Prompt(f"xsum/{r['id']}", "summarization", f"summarize: {r['document'].strip()}", r["summary"])
                for r in read_jsonl(root / "xsum" / "test.jsonl")]
    if dataset == "cnn_dailymail":
        return [Prompt(r["id"], "summarization", f"summarize: {r['article'].strip()}", r["highlights"],
                       {"in_spec_bench": r.get("in_spec_bench", False)})
                for r in read_jsonl(root / "cnn_dailymail" / "test.jsonl")]
    return [Prompt(f"wmt14/{r['id']}", "translation", f"translate English to German: {r['en'].strip()}", r["de"],
                   {"in_spec_bench": r.get("in_spec_bench", False)})
            for r in read_jsonl(root / "wmt14" / "newstest2014_deen.jsonl")]


def as_task_prompts(prompts: list, dataset: str, data_dir: Path | None = None) -> list:
    """The selected ``prompts`` (from ``data.load_prompts``) in T5's task format, same ids and order."""
    by_id = {p.id: p for p in task_prompts(dataset, data_dir)}
    return [by_id[p.id] for p in prompts]


def task_calibration_prompts(count: int, data_dir: Path | None = None, seed: int = 0) -> list[str]:
    """``data.calibration_prompts`` for an encoder–decoder target: a seeded mix of XSum,
    CNN/DailyMail and WMT14 prompts in T5's task format, leaving out, as that function does, the
    CNN/DM and WMT14 items Spec-Bench uses (XSum has no such mark: its items may also be bench
    prompts)."""
    import random

    pools = [[p for p in task_prompts(dataset, data_dir) if not p.extra.get("in_spec_bench")] for dataset in TASK_DATASETS]
    rng = random.Random(seed)
    return [pools[i % len(pools)][rng.randrange(len(pools[i % len(pools)]))].text for i in range(count)]
