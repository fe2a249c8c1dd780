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
to continue a folder planned with other settings or for another model. On Ray
(``build_data_on_cluster``) the shards are shared out to workers (``DataWorker``) that each load
the target and plan the job themselves; they return each shard's bytes, and the driver writes
every file, so the folder is the one a single process makes, and resumes alike.
"""

from __future__ import annotations

import hashlib
import json
import math
import random
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Callable, Iterable

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


@dataclass(frozen=True)
class DataPlan:
    """The job as planned from the target and the settings: the shard jobs, the items they draw
    on, the layers stored, and ``header``, plan.json's content (what a rerun must find unchanged)."""

    jobs: list[dict]
    own: list[TrainingItem]
    forced: list[TrainingItem]
    layers: list[int]
    header: dict

    def jobs_digest(self) -> str:
        """A digest of the shard list: every worker of a run on Ray must plan the same shards."""
        return hashlib.sha256(json.dumps(self.jobs).encode()).hexdigest()[:16]


@dataclass(frozen=True)
class Shard:
    """One finished shard, as the bytes of its safetensors file (for whoever writes the folder:
    the process itself, or a Ray run's driver), and what it holds."""

    index: int
    kind: str
    sequences: int
    answer_tokens: int
    seconds: float
    data: bytes
    worker: dict | None = None  # cluster.MachineInfo of the Ray worker that made it


def make_plan(target: LoadedModel, config: DataConfig, data_dir: Path | None) -> DataPlan:
    """The job's plan for ``target``: the same on every process given the same model files,
    training data and settings."""
    if target.tokenizer is None:
        raise DraftDataError("building draft-head data needs the target's tokenizer (text prompts)")
    if model_code(target.model) != "transformers":
        raise DraftDataError("building draft-head data generates in padded batches with transformers' generate; "
                             "load the target with implementation='transformers'")
    layers = aux_layers(target.identity.num_layers)
    jobs, own, forced = plan_jobs(target, config, data_dir)
    # The weights' numbers too: a rerun with another --dtype made the later shards' features (and
    # some answers) differ from the first ones', accepted with exit 0.
    dtype = str(next(target.model.parameters()).dtype).removeprefix("torch.")
    header = {"format": DATA_FORMAT, "config": asdict(config), "model": target.identity.to_dict(), "dtype": dtype,
              "aux_layers": layers, "items_hash": _items_hash(own, forced), "shards": len(jobs)}
    return DataPlan(jobs, own, forced, layers, header)


def make_shard(target: LoadedModel, plan: DataPlan, config: DataConfig, index: int) -> Shard:
    """Shard ``index`` of ``plan``: the target's answers (or its teacher-forced pass) and features."""
    started = time.perf_counter()
    job = plan.jobs[index]
    if job["kind"] == "reference":
        items = [plan.forced[i] for i in job["items"]]
        sequences = _reference_answers(target, items, plan.layers)
    else:
        items = [plan.own[i] for i in job["items"]]
        seed = (config.seed * 100003 + index) % 2**64  # within torch's seed range (unchanged below ~1.8e14)
        sequences = _own_answers(target, items, job["kind"] == "own-sampled", config, seed, plan.layers)
    data, answered = _shard_bytes(sequences, [item.source for item in items], job["kind"])
    return Shard(index, job["kind"], len(items), answered, time.perf_counter() - started, data)


def _shard_bytes(sequences: list[dict], sources: list[str], kind: str) -> tuple[bytes, int]:
    """The safetensors file of ``sequences`` and the answer tokens it holds."""
    from safetensors.torch import save

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
    data = save({k: v.contiguous() for k, v in tensors.items()},
                metadata={"format": DATA_FORMAT, "kind": kind, "sources": json.dumps(sources)})
    return data, sum(len(s["tokens"]) - s["response_start"] for s in sequences)


def _write_shard(path: Path, data: bytes) -> None:
    """A shard file, atomically, with an ordinary file's permissions."""
    atomic_write(path, lambda staging: staging.write_bytes(data))


def build_data(target: LoadedModel, out: Path, config: DataConfig = DataConfig(), data_dir: Path | None = None,
               progress: bool = True, max_shards: int | None = None) -> dict:
    """Plan (or resume) and run the data job into ``out``; returns the manifest.

    ``max_shards`` stops after that many shards in this call (tests; a budgeted run)."""
    plan = make_plan(target, config, data_dir)
    return _build(out, plan.header, lambda todo: (make_shard(target, plan, config, index) for index in todo),
                  progress, max_shards)


@dataclass(frozen=True)
class WorkerPlan:
    """The plan a data worker made (plan.json's content, a digest of its shard list) and where it
    runs (``cluster.MachineInfo`` as a dict)."""

    header: dict
    jobs: str
    machine: dict


class DataWorker:
    """A Ray worker's share of the data job (``cluster.WorkerPool``): the target loaded once by
    path, the job planned from it (every worker plans alike; the driver checks), and the shards
    it is given, returned as bytes for the driver to write."""

    def __init__(self, name: str, target: str, loading: tuple[str, str, str, str], config: DataConfig,
                 data_dir: Path | None):
        """``loading``: load_model's dtype, device, kernels and implementation."""
        from ..cluster import MachineInfo
        from ..models import load_model

        self.target = load_model(target, *loading)
        self.config = config
        self.plan = make_plan(self.target, config, data_dir)
        self.machine = MachineInfo.here(name, self.target.device).to_dict()

    def describe(self) -> WorkerPlan:
        return WorkerPlan(self.plan.header, self.plan.jobs_digest(), self.machine)

    def run(self, index: int) -> Shard:
        return replace(make_shard(self.target, self.plan, self.config, index), worker=self.machine)


def build_data_on_cluster(target: str, loading: tuple[str, str, str, str], out: Path, cluster,
                          config: DataConfig = DataConfig(), data_dir: Path | None = None, progress: bool = True,
                          max_shards: int | None = None) -> dict:
    """``build_data`` with the shards made by Ray workers (``cluster``: a ``ClusterConfig``), each
    loading ``target`` by path (``loading``: load_model's dtype, device, kernels, implementation);
    this process writes every file. A shard that fails on every try is listed in failures.json
    and named in the error raised after the manifest is written; a rerun tries it again."""
    from ..cluster import WorkerPool, connected

    cluster.check_device(loading[1])
    with connected(cluster), WorkerPool(DataWorker, (target, loading, config, data_dir), cluster) as pool:
        planned = pool.start()
        first = planned[0]
        for other in planned[1:]:
            if (other.header, other.jobs) != (first.header, first.jobs):
                raise DraftDataError(f"workers {first.machine['worker']} and {other.machine['worker']} planned the "
                                     "job differently: every node needs the same model files and training data")
        manifest = _build(out, first.header, lambda todo: (shard for _, shard in pool.run(todo, lambda i: f"shard {i}")),
                          progress, max_shards)
        failures = pool.failures
    path = out / "failures.json"
    if not failures:
        path.unlink(missing_ok=True)
        return manifest
    atomic_write_text(path, json.dumps([asdict(failure) for failure in failures], indent=2))
    raise DraftDataError(f"{len(failures)} shard(s) failed on every try ({', '.join(f.unit for f in failures[:3])}"
                         f"{', …' if len(failures) > 3 else ''}); their errors are in {path}; rerun to try them again")


def _build(out: Path, header: dict, make: Callable[[list[int]], Iterable[Shard]], progress: bool,
           max_shards: int | None) -> dict:
    """Checks (or writes) plan.json, writes the shards ``make(todo)`` yields as they come, and the
    manifest; the shards still missing are ``todo``."""
    out.mkdir(parents=True, exist_ok=True)
    plan_path = out / "plan.json"
    if plan_path.exists():
        try:
            previous = json.loads(plan_path.read_text())
        except (OSError, ValueError) as error:
            raise DraftDataError(f"{plan_path} is unreadable ({error}); delete the folder or use another --out") from None
        previous.setdefault("dtype", header["dtype"])  # a plan made before the dtype was recorded: not known
        if {k: previous.get(k) for k in header} != header:
            raise DraftDataError(f"{out} was planned with other settings, data or model; use another --out "
                                 "(or the same settings to resume)")
    else:
        atomic_write_text(plan_path, json.dumps(header, indent=2))

    from tqdm.auto import tqdm

    shards = header["shards"]
    todo = [i for i in range(shards) if not (out / f"shard-{i:05d}.safetensors").exists()]
    if max_shards is not None:
        todo = todo[:max_shards]
    bar = tqdm(total=shards, initial=shards - len(todo) if max_shards is None else 0, desc="draft data",
               disable=not progress)
    # the seconds of the runs before: each run keeps its total to date after every shard (a killed run's too)
    clock = out / ".seconds.json"
    previous_seconds = _seconds_total(clock if clock.exists() else out / "manifest.json")
    started = time.perf_counter()
    workers: dict[str, dict] = {}
    for shard in make(todo):
        _write_shard(out / f"shard-{shard.index:05d}.safetensors", shard.data)
        atomic_write_text(clock, json.dumps({"seconds_total": previous_seconds + time.perf_counter() - started}))
        bar.update(1)
        bar.set_postfix_str(f"{shard.kind} {shard.answer_tokens / shard.seconds:.0f} answer tok/s")
        where = ""
        if shard.worker is not None:
            entry = workers.setdefault(shard.worker["worker"], {**shard.worker, "shards": 0})
            entry["shards"] += 1
            where = f" on {shard.worker['worker']} ({shard.worker['host']})"
        if not progress:
            print(f"shard {shard.index} ({shard.kind}, {shard.sequences} sequences, {shard.answer_tokens} answer tokens) "
                  f"in {shard.seconds:.1f} s{where}", file=sys.stderr, flush=True)
    bar.close()
    manifest = summarize_data(out)
    manifest["seconds_this_run"] = round(time.perf_counter() - started, 1)
    manifest["seconds_total"] = round(previous_seconds + manifest["seconds_this_run"], 1)  # every run of the job
    if workers:  # a run on Ray: who made this run's shards
        manifest["workers_this_run"] = workers
    atomic_write_text(out / "manifest.json", json.dumps(manifest, indent=2))
    clock.unlink(missing_ok=True)  # the manifest holds the total now
    return manifest


def _seconds_total(path: Path) -> float:
    """The ``seconds_total`` a data folder's manifest or running clock holds (0: none, or unreadable)."""
    try:
        seconds = float(json.loads(path.read_text()).get("seconds_total", 0.0))
    except (OSError, ValueError, TypeError, AttributeError):
        return 0.0
    return seconds if 0.0 <= seconds < math.inf else 0.0


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
