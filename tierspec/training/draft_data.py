"""Training data for the draft head: token sequences and the target's features at every position.

Two kinds of text, both labelled by the target itself (docs/algorithms.md §Draft head):

* **own answers** (self-distillation): the target answers training prompts (``prompts.py``),
  in batches through transformers' ``generate`` — greedy for most, sampled at temperature 1 for
  a share (``sampled_fraction``), so that the head also sees the target's sampled text. The
  features are captured from the generation's own forward passes (hooks), no second pass.
* **reference answers**: a prompt with its reference answer (a GSM8K solution, a translation, a
  gold summary) run teacher-forced through the target in one batched pass. The labels are still
  the target's: the head learns the target's features and next-token distributions at every
  position of this text, only the text is not the target's own.

Per position t a shard stores the token x_t and f_t, the input of the LM head (the target's
final hidden state), plus the states after a few earlier layers (``aux_layers``) for heads that
read several layers. Positions before ``response_start`` are the prompt: context for the head,
not trained on.

The job is planned once (``plan.json``: settings, the target's identity, the shard list) and
writes one safetensors shard per batch, atomically; a rerun skips finished shards, and refuses
to continue a folder planned with other settings or for another model.
"""

from __future__ import annotations

import hashlib
import json
import random
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from ..cached_model import HiddenCapture
from ..errors import TierspecError
from ..identity import ModelIdentity
from ..models import LoadedModel, model_code
from ..prompting import prompt_ids
from ..util import atomic_write, atomic_write_text
from .draft_prompts import TrainingItem, training_items

DATA_FORMAT = "tierspec-eagle-data"


class DraftDataError(TierspecError):
    """A data folder that cannot be (re)used: other settings, another model, damaged shards."""


@dataclass(frozen=True)
class DataConfig:
    own_prompts: int = 2400  # prompts the target answers itself
    reference_items: int = 1600  # reference answers run teacher-forced
    max_new_tokens: int = 160  # the longest own answer
    max_prompt_tokens: int = 448  # longer prompts are skipped
    batch_size: int = 48  # own answers generated together
    reference_batch_tokens: int = 6144  # padded tokens per teacher-forced batch
    sampled_fraction: float = 0.25  # own answers sampled at temperature 1 instead of greedy
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("own_prompts", "reference_items"):
            if getattr(self, name) < 0:
                raise DraftDataError(f"{name} must be >= 0")
        if self.batch_size < 1 or self.max_new_tokens < 1 or self.max_prompt_tokens < 8:
            raise DraftDataError("batch_size and max_new_tokens must be >= 1, max_prompt_tokens >= 8")
        if not 0.0 <= self.sampled_fraction <= 1.0:
            raise DraftDataError(f"sampled_fraction must be in [0, 1], got {self.sampled_fraction}")


def aux_layers(num_layers: int) -> list[int]:
    """Decoder layers whose outputs are stored besides the final features (low and middle, as
    EAGLE-3 fuses them): layer 1 and the middle layer, 0-based."""
    return sorted({min(1, num_layers - 1), num_layers // 2})


# ---- planning -----------------------------------------------------------------------------------


def plan_jobs(target: LoadedModel, config: DataConfig, data_dir: Path | None) -> tuple[list[dict], list[TrainingItem], list[TrainingItem]]:
    """Shard jobs: {"kind": "own-greedy" | "own-sampled" | "reference", "items": [indices]}."""
    own, forced = training_items(data_dir, config.seed)
    own, forced = own[: config.own_prompts], forced[: config.reference_items]
    tokenizer = target.tokenizer
    rng = random.Random(config.seed)
    jobs: list[dict] = []
    by_mode: dict[str, list[tuple[int, int]]] = {"own-greedy": [], "own-sampled": []}
    for index, item in enumerate(own):
        length = len(prompt_ids(tokenizer, item.prompt))
        if length > config.max_prompt_tokens:
            continue
        mode = "own-sampled" if rng.random() < config.sampled_fraction else "own-greedy"
        by_mode[mode].append((length, index))
    for mode, entries in by_mode.items():
        entries.sort()  # similar lengths together: less padding
        for start in range(0, len(entries), config.batch_size):
            jobs.append({"kind": mode, "items": [i for _, i in entries[start : start + config.batch_size]]})
    lengths = []
    for index, item in enumerate(forced):
        length = len(prompt_ids(tokenizer, item.prompt)) + len(tokenizer(item.reference, add_special_tokens=False)["input_ids"]) + 1
        if length <= config.max_prompt_tokens + config.max_new_tokens:
            lengths.append((length, index))
    lengths.sort()
    batch: list[int] = []
    for length, index in lengths:
        if batch and length * (len(batch) + 1) > config.reference_batch_tokens:
            jobs.append({"kind": "reference", "items": batch})
            batch = []
        batch.append(index)
    if batch:
        jobs.append({"kind": "reference", "items": batch})
    rng.shuffle(jobs)  # an interrupted job still holds a mix of every kind
    return jobs, own, forced


def _items_hash(own: list[TrainingItem], forced: list[TrainingItem]) -> str:
    digest = hashlib.sha256()
    for item in own + forced:
        digest.update(json.dumps([item.source, item.prompt, item.reference]).encode())
    return digest.hexdigest()[:16]


# ---- running ------------------------------------------------------------------------------------


def _eos_id(target: LoadedModel) -> int:
    from ..prompting import eos_ids

    ids = eos_ids(target)
    if not ids:
        raise DraftDataError(f"model '{target.identity.name}' declares no end-of-sequence token")
    return ids[0]


def _own_answers(target: LoadedModel, items: list[TrainingItem], sampled: bool, config: DataConfig,
                 seed: int, layers: list[int]) -> list[dict]:
    """Generate answers to ``items`` in one batch; return the stored sequences."""
    tokenizer = target.tokenizer
    eos = _eos_id(target)
    prompts = [prompt_ids(tokenizer, item.prompt) for item in items]
    width = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), width), eos, dtype=torch.long)
    attention = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, ids in enumerate(prompts):  # left padding: every answer starts at column ``width``
        input_ids[row, width - len(ids) :] = torch.tensor(ids)
        attention[row, width - len(ids) :] = 1
    torch.manual_seed(seed)
    with HiddenCapture(target.model, layers) as capture:
        with torch.inference_mode():
            kwargs = dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0) if sampled else dict(do_sample=False)
            output = target.model.generate(input_ids=input_ids.to(target.device), attention_mask=attention.to(target.device),
                                           max_new_tokens=config.max_new_tokens, eos_token_id=eos, pad_token_id=eos,
                                           **kwargs).cpu()
        final, aux = capture.take()
    sequences = []
    answers = output[:, width:]
    for row, ids in enumerate(prompts):
        answer = answers[row].tolist()
        length = answer.index(eos) + 1 if eos in answer else len(answer)
        # Fed positions: the prompt and every answer token but the last (whose features no pass
        # computed); the last token is dropped, its prediction is still trained (from f at the
        # position before it).
        start, end = width - len(ids), width + length - 1
        sequences.append({
            "tokens": output[row, start:end],
            "final": final[row, start:end],
            "aux": {i: a[row, start:end] for i, a in aux.items()},
            "response_start": len(ids),
        })
    return sequences


def _reference_answers(target: LoadedModel, items: list[TrainingItem], layers: list[int]) -> list[dict]:
    """Run prompt + reference answer + EOS teacher-forced, right-padded, in one pass."""
    tokenizer = target.tokenizer
    eos = _eos_id(target)
    rows = []
    for item in items:
        prompt = prompt_ids(tokenizer, item.prompt)
        rows.append((prompt + tokenizer(item.reference, add_special_tokens=False)["input_ids"] + [eos], len(prompt)))
    width = max(len(ids) for ids, _ in rows)
    input_ids = torch.full((len(rows), width), eos, dtype=torch.long)
    attention = torch.zeros((len(rows), width), dtype=torch.long)
    for row, (ids, _) in enumerate(rows):
        input_ids[row, : len(ids)] = torch.tensor(ids)
        attention[row, : len(ids)] = 1
    with HiddenCapture(target.model, layers) as capture:
        with torch.inference_mode():
            target.model.get_decoder()(input_ids=input_ids.to(target.device), attention_mask=attention.to(target.device))
        final, aux = capture.take()
    return [
        {"tokens": input_ids[row, : len(ids)], "final": final[row, : len(ids)],
         "aux": {i: a[row, : len(ids)] for i, a in aux.items()}, "response_start": prompt_length}
        for row, (ids, prompt_length) in enumerate(rows)
    ]


def _write_shard(path: Path, sequences: list[dict], sources: list[str], kind: str) -> int:
    from safetensors.torch import save_file

    offsets = [0]
    for sequence in sequences:
        offsets.append(offsets[-1] + len(sequence["tokens"]))
    tensors = {
        "tokens": torch.cat([s["tokens"] for s in sequences]).to(torch.int32),
        "features": torch.cat([s["final"] for s in sequences]).to(torch.float16),
        "offsets": torch.tensor(offsets, dtype=torch.int64),
        "response_start": torch.tensor([s["response_start"] for s in sequences], dtype=torch.int64),
    }
    for layer in sequences[0]["aux"]:
        tensors[f"aux_{layer}"] = torch.cat([s["aux"][layer] for s in sequences]).to(torch.float16)
    atomic_write(path, lambda staging: save_file({k: v.contiguous() for k, v in tensors.items()}, str(staging),
                                                 metadata={"format": DATA_FORMAT, "kind": kind,
                                                           "sources": json.dumps(sources)}))
    return sum(len(s["tokens"]) - s["response_start"] for s in sequences)


def build_data(target: LoadedModel, out: Path, config: DataConfig = DataConfig(), data_dir: Path | None = None,
               progress: bool = True, max_shards: int | None = None) -> dict:
    """Plan (or resume) and run the data job into ``out``; returns the manifest.

    ``max_shards`` stops after that many shards in this call (tests; a budgeted run)."""
    if target.tokenizer is None:
        raise DraftDataError("building draft-head data needs the target's tokenizer (text prompts)")
    if model_code(target.model) != "transformers":
        raise DraftDataError("building draft-head data generates in padded batches with transformers' generate; "
                             "load the target with implementation='transformers'")
    out.mkdir(parents=True, exist_ok=True)
    layers = aux_layers(target.identity.num_layers)
    jobs, own, forced = plan_jobs(target, config, data_dir)
    plan = {"format": DATA_FORMAT, "config": asdict(config), "model": target.identity.to_dict(),
            "aux_layers": layers, "items_hash": _items_hash(own, forced), "shards": len(jobs)}
    plan_path = out / "plan.json"
    if plan_path.exists():
        try:
            previous = json.loads(plan_path.read_text())
        except (OSError, ValueError) as error:
            raise DraftDataError(f"{plan_path} is unreadable ({error}); delete the folder or use another --out") from None
        if {k: previous.get(k) for k in plan} != plan:
            raise DraftDataError(f"{out} was planned with other settings, data or model; use another --out "
                                 "(or the same settings to resume)")
    else:
        atomic_write_text(plan_path, json.dumps(plan, indent=2))

    from tqdm.auto import tqdm

    todo = [i for i in range(len(jobs)) if not (out / f"shard-{i:05d}.safetensors").exists()]
    if max_shards is not None:
        todo = todo[:max_shards]
    bar = tqdm(total=len(jobs), initial=len(jobs) - len(todo) if max_shards is None else 0, desc="draft data",
               disable=not progress)
    started = time.perf_counter()
    new_tokens = 0
    for index in todo:
        job = jobs[index]
        shard_started = time.perf_counter()
        if job["kind"] == "reference":
            items = [forced[i] for i in job["items"]]
            sequences = _reference_answers(target, items, layers)
        else:
            items = [own[i] for i in job["items"]]
            seed = (config.seed * 100003 + index) % 2**64  # within torch's seed range (unchanged below ~1.8e14)
            sequences = _own_answers(target, items, job["kind"] == "own-sampled", config, seed, layers)
        answered = _write_shard(out / f"shard-{index:05d}.safetensors", sequences, [item.source for item in items], job["kind"])
        new_tokens += answered
        bar.update(1)
        bar.set_postfix_str(f"{job['kind']} {answered / (time.perf_counter() - shard_started):.0f} answer tok/s")
        if not progress:
            print(f"shard {index} ({job['kind']}, {len(items)} sequences, {answered} answer tokens) in "
                  f"{time.perf_counter() - shard_started:.1f} s", file=sys.stderr, flush=True)
    bar.close()
    previous_seconds = 0.0
    if (out / "manifest.json").exists():
        try:
            previous_seconds = float(json.loads((out / "manifest.json").read_text()).get("seconds_total", 0.0))
        except (OSError, ValueError, TypeError):
            previous_seconds = 0.0
    manifest = summarize_data(out)
    manifest["seconds_this_run"] = round(time.perf_counter() - started, 1)
    manifest["seconds_total"] = round(previous_seconds + manifest["seconds_this_run"], 1)  # every run of the job
    atomic_write_text(out / "manifest.json", json.dumps(manifest, indent=2))
    return manifest


def summarize_data(folder: Path) -> dict:
    """Totals over the finished shards: sequences and answer tokens per source."""
    from safetensors import safe_open

    plan = read_plan(folder)
    per_source: dict[str, dict[str, int]] = {}
    shards = sorted(folder.glob("shard-*.safetensors"))
    for path in shards:
        with safe_open(str(path), "pt") as handle:
            sources = json.loads(handle.metadata()["sources"])
            offsets = handle.get_tensor("offsets")
            starts = handle.get_tensor("response_start")
        for i, source in enumerate(sources):
            entry = per_source.setdefault(source.split("/")[0] if not source.startswith("synthetic") else source, {"sequences": 0, "answer_tokens": 0})
            entry["sequences"] += 1
            entry["answer_tokens"] += int(offsets[i + 1] - offsets[i] - starts[i])
    return {"format": DATA_FORMAT, "model": plan["model"], "shards_done": len(shards), "shards_planned": plan["shards"],
            "answer_tokens": sum(e["answer_tokens"] for e in per_source.values()), "per_source": per_source}


def read_plan(folder: Path) -> dict:
    path = Path(folder) / "plan.json"
    try:
        plan = json.loads(path.read_text())
    except FileNotFoundError:
        raise DraftDataError(f"{folder} holds no draft-head data (no plan.json); make it with `tierspec drafter build-data`") from None
    except (OSError, ValueError) as error:
        raise DraftDataError(f"{path} is unreadable: {error}") from None
    if plan.get("format") != DATA_FORMAT:
        raise DraftDataError(f"{path} is not a tierspec draft-head data plan")
    return plan


def check_data_model(folder: Path, identity: ModelIdentity) -> dict:
    """The plan, after checking the data was made by ``identity``'s model."""
    plan = read_plan(folder)
    made_by = ModelIdentity(**plan["model"])
    if not made_by.matches(identity):
        raise DraftDataError(f"the data in {folder} was made with model '{made_by.name}', not '{identity.name}'")
    return plan
