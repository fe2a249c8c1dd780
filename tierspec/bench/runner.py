"""``tierspec bench``: every method and the transformers peers on the same prompts, in one process
or shared out to the workers of a Ray cluster.

Methods are interleaved prompt by prompt (their order rotated per prompt) so that drift of a
shared machine hits all alike; each method is warmed up first. Every generation is timed the
same way, from token ids in to token ids out (prefill included). Per-prompt records are
appended to ``records.jsonl`` as they are made; a rerun skips what is done. The summary, the
table and the plots are always rebuilt from all records.

On Ray (``cluster``) a unit of work is one prompt and repeat with its methods (``BenchUnit``);
each worker (``BenchWorker``, the class the single process uses too) loads the models once and
runs its units' methods interleaved as above, so ratios are taken within one worker. The
driver alone appends records, a unit's at once; records name the worker and machine that made
them (``MachineInfo``), and the summary groups them per machine where machines differ.

A method spec is a name with optional parameters: ``via:alpha2=0.5:mask=m.json``,
``lossy:alpha=0.2:draft_with=self:draft_mask=m.json``, ``pld:num_draft=3``. The spec string is
the method's label in the results.
"""

from __future__ import annotations

import json
import os
import sys
import time
import weakref
import zlib
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Callable, Iterable, Iterator

import torch

from ..cluster import ClusterConfig, MachineInfo, UnitFailure
from ..data import CONSTRAINED_DATASETS, Prompt, load_prompts, select
from ..decode import DecodeConfig, DecodeRun, GenerationStats, check_constrainable
from ..errors import TierspecError
from ..methods import MethodOptions, build_method, drafts_with_model, method_names, option_fields, takes_num_draft
from ..models import LoadedModel, load_model, model_code, resolve_dtype
from ..prompting import encode_prompt, eos_ids
from ..layerskip.masks import RoutingMask, model_lock
from ..sampling import SamplingConfig
from ..data import as_task_prompts
from ..seq2seq import is_encoder_decoder
from ..util import atomic_write_text, exclusive_lock, source_fingerprint, write_error
from .sandbox import check_code_execution_allowed, check_isolation
from . import metrics
from .llamacpp import LLAMACPP_PARAMETERS, LLAMACPP_PEERS
from .openvino import OPENVINO_PARAMETERS, OPENVINO_PEERS
from .peer_process import PeerFailed, PeerProcess, PeerSpec, peer_class
from .memory import PeakRSS
from .outcome import Outcome

HF_PEERS_ON_OUR_KERNELS = ("hf-greedy", "hf-assisted", "hf-pld", "hf-early-exit")
# The same peers as a user who picks transformers runs them: stock ``nn.Linear`` modules (a copy
# of the model without tierspec's linear kernels). ``hf-*`` without ``-stock`` share tierspec's
# kernels: an algorithm-to-algorithm comparison.
STOCK_SUFFIX = "-stock"
HF_PEERS = HF_PEERS_ON_OUR_KERNELS + tuple(name + STOCK_SUFFIX for name in HF_PEERS_ON_OUR_KERNELS)
BASELINE = "ar"
# The peers that run in worker processes of their own (``peer_process``): name → the peer class.
PEER_FACTORIES = {**{name: "tierspec.bench.llamacpp:LlamaCppPeer" for name in LLAMACPP_PEERS},
                  **{name: "tierspec.bench.openvino:OpenVinoPeer" for name in OPENVINO_PEERS}}
_STOCK_COPIES: "weakref.WeakKeyDictionary[torch.nn.Module, torch.nn.Module]" = weakref.WeakKeyDictionary()


def stock_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of ``model`` whose linear layers are plain ``nn.Linear`` again, in the dtype they were
    loaded in (made once per model)."""
    from ..kernels import unpacked_copy

    if model not in _STOCK_COPIES:
        _STOCK_COPIES[model] = unpacked_copy(model)
    return _STOCK_COPIES[model]


class BenchError(TierspecError):
    pass


@dataclass(frozen=True)
class BenchConfig:
    target: str = "smollm2-135m"
    dtype: str = "auto"  # settled when a run starts (records name what computed them: ``settled_dtype``)
    device: str = "cpu"
    kernels: str = "auto"
    implementation: str = "auto"  # tierspec's methods; hf-* peers always run on transformers' modules
    methods: tuple[str, ...] = ("ar", "hf-greedy", "sd", "pld", "hf-pld")
    dataset: str = "spec_bench"
    per_category: int | None = 5
    limit: int | None = None
    max_new_tokens: int = 128
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    num_draft: int | None = None  # every method's own (methods.MethodOptions.num_draft)
    repeats: int = 1
    seed: int = 0
    drafter: str | None = None
    data_dir: str | None = None
    mask: str | None = None  # default routing mask for self / via specs without one
    hf_pld_tokens: int = 10  # transformers' documented prompt_lookup_num_tokens
    hf_early_exit_layer: int | None = None  # default: half the target's layers
    compute_nll: bool = True
    # Fidelity (exact match, ROUGE-L) is measured against `ar`'s output of the same run; a path to
    # another run's records.jsonl (e.g. a greedy run, for a temperature-1 run) uses its `ar` instead.
    fidelity_reference: str | None = None
    # HumanEval's code runs isolated (bench.sandbox); False is the user's explicit opt-out (--no-sandbox).
    code_sandbox: bool = True
    # A constrained set's prompts as free text (--free-text): what the constraint's speed is compared with.
    free_text: bool = False
    # The tierspec source that made the records (``util.source_fingerprint``): a folder is not resumed by
    # other code, whose records would measure something else under the same method names.
    code: str = field(default_factory=lambda: source_fingerprint())

    @property
    def constrained(self) -> bool:
        """Whether each text is constrained to its task's schema (``data.CONSTRAINED_DATASETS``)."""
        return self.dataset in CONSTRAINED_DATASETS and not self.free_text

    def __post_init__(self) -> None:
        if not self.methods:
            raise BenchError("methods is empty: name at least one method (e.g. --methods ar,pld)")
        least = {"limit": 1, "per_category": 1, "repeats": 1, "max_new_tokens": 1, "num_draft": 0}
        for name, minimum in least.items():
            value = getattr(self, name)
            if value is None and name in ("limit", "per_category", "num_draft"):
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
                raise BenchError(f"{name} must be an integer >= {minimum}, got {value!r}")


# Settings that change what a record measures: a run may only resume into a folder made with the
# same values (methods, prompt counts and repeats may grow).
_RESUME_KEYS = ("target", "dtype", "device", "kernels", "implementation", "drafter", "dataset", "data_dir", "max_new_tokens", "temperature", "top_k", "top_p",
                "num_draft", "seed", "mask", "hf_pld_tokens", "hf_early_exit_layer", "free_text", "code")
# What a summary of a folder reports is the folder's run: its methods, prompt selection and generation
# settings, not the flags (or their defaults) of the --summarize-only command. (The model's settings
# are the folder's too, once the worker has settled them: ``_settle``.)
_MODEL_KEYS = ("target", "dtype", "device", "kernels", "implementation", "drafter")
_SUMMARY_KEYS = tuple(key for key in _RESUME_KEYS if key not in _MODEL_KEYS) + ("methods", "per_category", "limit",
                                                                                "repeats")


# What a run made before a setting existed used: its records came from that (not today's default).
_BEFORE_THE_KEY_EXISTED = {"implementation": "transformers", "free_text": False}


def _previous_config(out: Path) -> dict | None:
    """The settings of the run already in ``out`` (with what runs made before a setting existed
    used), or None where there is none."""
    path = out / "config.json"
    if not path.exists():
        return None
    try:
        return {**_BEFORE_THE_KEY_EXISTED, **json.loads(path.read_text())}
    except (OSError, json.JSONDecodeError) as error:
        raise BenchError(f"{path} is unreadable ({error}); use another --out or delete the folder") from error


def check_resumable(config: "BenchConfig", out: Path, unsettled: tuple[str, ...] = ()) -> None:
    """Refuses to add records to ``out`` if its config.json was written with other settings.
    ``unsettled``: settings not compared yet (a run on Ray learns its dtype and implementation
    from its workers; it checks early, without them, then again once they are known)."""
    previous = _previous_config(out) if (out / "records.jsonl").exists() else None
    if previous is None:
        return
    current = asdict(config)
    changed = [f"{key}: {previous.get(key)!r} → {current[key]!r}" for key in _RESUME_KEYS
               if key in previous and key not in unsettled and previous[key] != current[key]]
    if any(change.startswith("code: ") for change in changed):  # (a folder from before the key: not known)
        raise BenchError(f"{out} holds records made by other tierspec code (source {previous['code']}, this is "
                         f"{current['code']}: an upgrade or an edit since); resuming would mix what the two measure: "
                         "use another --out")
    if changed:
        raise BenchError(f"{out} holds records made with other settings ({'; '.join(changed)}); "
                         "resuming would mix them: use another --out")


def read_records(path: Path) -> list[dict]:
    """The records of a records.jsonl; a line cut by an interruption is skipped (and redone)."""
    records = []
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


def _drop_cut_tail(path: Path) -> None:
    """An interrupted write leaves a last line without its newline; the next append would glue a
    good record onto it. Cut it off (it is redone)."""
    if not path.exists():
        return
    data = path.read_bytes()
    if data and not data.endswith(b"\n"):
        atomic_write_text(path, data[: data.rfind(b"\n") + 1].decode())


def load_fidelity_reference(path: str) -> dict:
    """`ar` records of another run, by (prompt id, repeat)."""
    file = Path(path)
    if file.is_dir():
        file = file / "records.jsonl"
    if not file.exists():
        raise BenchError(f"fidelity reference {file} does not exist")
    reference = {(r["prompt_id"], r["repeat"]): r for r in read_records(file) if r.get("method") == BASELINE}
    if not reference:
        raise BenchError(f"fidelity reference {file} holds no `{BASELINE}` records")
    return reference


# ---- method specs ---------------------------------------------------------------------------------

_OPTION_FIELDS = {f.name: f for f in option_fields()}
# Each method parameter's kind: "int", "float", or "other" (text, or a file: masks and heads).
_OPTION_KINDS = {name: "other" if f.metadata.get("kind") else "int" if "int" in str(f.type)
                 else "float" if "float" in str(f.type) else "other" for name, f in _OPTION_FIELDS.items()}
# The parameters of the transformers peers (with and without -stock): prompt_lookup_num_tokens, the exit layer.
_HF_PARAMETERS = {"hf-pld": {"tokens": "int"}, "hf-early-exit": {"layer": "int"}}
#: the methods a run's --mask serves (a spec's own mask= wins): the ones that need a routing mask
MASKED_METHODS = ("self", "via", "via-judge", "pearl", "via-pearl")
_ALIASES = {"draft_with": "drafter_kind"}  # the CLI flag's name


def parse_spec(spec: str) -> tuple[str, dict[str, str]]:
    """'via:alpha2=0.5:mask=m.json' → ('via', {'alpha2': '0.5', 'mask': 'm.json'})."""
    name, *parts = spec.split(":")
    params = {}
    for part in parts:
        if "=" not in part:
            raise BenchError(f"method spec '{spec}': parameter '{part}' is not key=value")
        key, value = part.split("=", 1)
        params[_ALIASES.get(key.strip(), key.strip())] = value.strip()
    known = set(method_names()) | set(HF_PEERS) | set(LLAMACPP_PEERS) | set(OPENVINO_PEERS)
    if name not in known:
        raise BenchError(f"unknown method '{name}' in '{spec}'; choose from: {', '.join(sorted(known))}")
    if name in HF_PEERS:
        allowed = _HF_PARAMETERS.get(name.removesuffix(STOCK_SUFFIX), {})
    elif name in LLAMACPP_PEERS:
        allowed = {key: "int" for key in LLAMACPP_PARAMETERS.get(name, {})}
    elif name in OPENVINO_PEERS:
        allowed = {key: "int" for key in OPENVINO_PARAMETERS.get(name, {})}
    else:
        allowed = {**_OPTION_KINDS, "dtype": "other"}
    unknown = set(params) - set(allowed)
    if unknown:
        raise BenchError(f"method spec '{spec}': unknown parameter(s) {sorted(unknown)}; known: {sorted(allowed)}")
    for key, value in params.items():
        _number(spec, key, value, allowed[key])  # refuse a bad number before any model is loaded
    if "dtype" in params:
        try:
            resolve_dtype(params["dtype"])
        except TierspecError as error:
            raise BenchError(f"method spec '{spec}': {error}") from None
    return name, params


def spec_dtype(spec: str) -> str | None:
    """The dtype a method spec asks for by its ``dtype=`` parameter (``ar:dtype=float32`` beside the
    run's: one run compares dtypes on the same prompts and clock), or None: the run's own models."""
    return parse_spec(spec)[1].get("dtype")


def settled_dtype(requested: str, target: LoadedModel) -> str:
    """The dtype records name: an explicit ``--dtype`` as given; ``auto`` as what the loaded target
    computes in (``load_model``'s ``auto``: a GGUF model on the pass engine with the engine's default
    numerics for this CPU, ``quant.default_numerics`` — int8 rows and a float16 KV cache where the CPU
    has int8 dot products — else ``fastest_dtype``). Two machines that settle ``auto`` differently
    measure different computations under one setting: the name tells them apart."""
    if requested != "auto":
        return requested
    from ..quant import QuantLinear

    layer = next((m for m in target.model.modules() if isinstance(m, QuantLinear)), None)
    if layer is None:
        return "auto: " + str(next(target.model.parameters()).dtype).removeprefix("torch.")
    numerics = layer.qweight.numerics
    rows = "bfloat16 rounded" if numerics.round_rows else str(numerics.dtype).removeprefix("torch.")
    return f"auto: {rows} rows, {str(numerics.kv_dtype).removeprefix('torch.')} KV cache (engine)"


def _number(spec: str, key: str, value: str, kind: str):
    """``value`` as the ``kind`` ("int", "float" or "other": left as text) of parameter ``key``;
    "none" is None (the parameter's default)."""
    if kind == "other":
        return value
    if value.lower() == "none":
        return None
    try:
        return int(value) if kind == "int" else float(value)
    except ValueError:
        raise BenchError(f"method spec '{spec}': {key} must be {'an integer' if kind == 'int' else 'a number'}, "
                         f"got '{value}'") from None


def _convert(spec: str, key: str, value: str, target: LoadedModel):
    kind = _OPTION_FIELDS[key].metadata.get("kind")
    if kind == "mask":
        return RoutingMask.load(value, target.identity)
    if kind == "judge_head":
        from ..heads.judge import JudgeHead

        return JudgeHead.load(value, target.identity)
    if kind == "draft_head":
        from ..heads.draft import DraftHead

        return DraftHead.load(value, target)
    return _number(spec, key, value, _OPTION_KINDS[key])


class MethodRunner:
    """Runs one method spec on prompt ids; built once, reused for every prompt. The spec names
    one of four engines: a tierspec method (``TierspecMethod``), transformers' own ``generate``
    (``TransformersPeer``, the ``hf-*`` names), llama.cpp (``LlamaCppPeer``, ``llamacpp-*``) or
    OpenVINO GenAI (``OpenVinoPeer``, ``ov-*``), the last two each in a worker process of its own
    (``peer_process.PeerProcess``: a crash there is that peer's ``PeerFailed``, not the run's);
    each has ``run(prompt_ids, max_new_tokens, generator) → Outcome``; a tierspec method also takes
    a ``constraint`` (a compiled grammar: the JSON-extraction set's schemas), and a peer that
    ``takes_json_schema`` (llama.cpp) the schema itself, followed with its own grammar engine; the
    others cannot honour one (``_run_bench`` refuses them on such a set)."""

    def __init__(self, spec: str, target: LoadedModel, drafter: LoadedModel | None, config: BenchConfig,
                 hf_models: tuple[LoadedModel, LoadedModel | None] | None = None):
        """``hf_models``: the target and drafter on transformers' modules for ``hf-*`` peers
        (default: ``target`` and ``drafter`` themselves, which must then be transformers models)."""
        self.spec = spec
        self.name, params = parse_spec(spec)
        eos = eos_ids(target)
        sampling = SamplingConfig(config.temperature, config.top_k, config.top_p)
        params.pop("dtype", None)  # the caller passed the target loaded in that dtype
        if self.name in PEER_FACTORIES:
            spec = PeerSpec(PEER_FACTORIES[self.name], self.name, params, config.target, target.vocab_size,
                            tuple(sorted(eos)), config.temperature, config.top_k, config.top_p, torch.get_num_threads())
            self.engine = PeerProcess(spec, target.device.type, config.seed)
        elif self.name in HF_PEERS:
            hf_target, hf_drafter = hf_models or (target, drafter)
            self.engine = TransformersPeer(spec, params, hf_target, hf_drafter, config, eos, sampling)
        else:
            self.engine = TierspecMethod(spec, params, target, drafter, config, eos, sampling)

    def run(self, prompt_ids: torch.Tensor, max_new_tokens: int, generator: torch.Generator | None,
            constraint=None) -> Outcome:
        if constraint is None:
            return self.engine.run(prompt_ids, max_new_tokens, generator)
        if isinstance(self.engine, TierspecMethod):
            return self.engine.run(prompt_ids, max_new_tokens, generator, constraint)
        if takes_json_schema(self.engine) and constraint.spec.kind == "json_schema":
            return self.engine.run(prompt_ids, max_new_tokens, generator, schema=constraint.spec.source)
        raise BenchError(f"{self.spec} cannot constrain its text to a grammar")


def takes_json_schema(engine) -> bool:
    """Whether a bench engine other than tierspec's follows a JSON schema of its own accord."""
    return getattr(engine, "takes_json_schema", False)


class TierspecMethod:
    """A tierspec method (``methods.build_method`` from the spec's options) through the decode loop."""

    def __init__(self, spec: str, params: dict, target: LoadedModel, drafter: LoadedModel | None, config: BenchConfig,
                 eos: set[int], sampling: SamplingConfig):
        self.target, self.eos, self.sampling = target, eos, sampling
        name = parse_spec(spec)[0]
        # the run's num_draft sizes the methods that take one (ar and PEARL refuse any)
        num_draft = _number(spec, "num_draft", params.pop("num_draft"), "int") if "num_draft" in params else \
            config.num_draft if takes_num_draft(name) else None
        if config.mask and "mask" not in params and name in MASKED_METHODS:
            params["mask"] = config.mask
        options = replace(MethodOptions(num_draft=num_draft), **{k: _convert(spec, k, v, target) for k, v in params.items()})
        # the run's drafter model serves the methods that draft with one
        self.method = build_method(name, target, drafter if drafts_with_model(name, options) else None, options)
        if config.constrained:  # its texts are constrained: a lossy method is refused now
            try:
                check_constrainable(self.method, self.method.generation(num_draft).rule)
            except TierspecError as error:
                raise BenchError(f"method spec '{spec}' on the {config.dataset} set: {error}") from None

    def run(self, prompt_ids: torch.Tensor, max_new_tokens: int, generator: torch.Generator | None,
            constraint=None) -> Outcome:
        """``constraint``: a compiled grammar the text follows (None: free text)."""
        config = DecodeConfig(max_new_tokens, self.sampling, self.eos, constraint=constraint)
        run = DecodeRun(self.target, self.method, prompt_ids, config, generator).finish()
        return Outcome(run.token_ids, run.stats.wall_seconds, run.stats)


class TransformersPeer:
    """transformers' ``generate`` with the algorithm an ``hf-*`` name stands for, on the model
    itself (tierspec's linear kernels) or, for ``-stock`` names, on a copy with stock ``nn.Linear``
    modules (what a user of transformers runs). Timed around ``generate``; no draft statistics."""

    def __init__(self, spec: str, params: dict, target: LoadedModel, drafter: LoadedModel | None, config: BenchConfig,
                 eos: set[int], sampling: SamplingConfig):
        name = parse_spec(spec)[0]
        if model_code(target.model) != "transformers":
            raise BenchError(f"{name} runs transformers' generate; load the target with implementation='transformers'")
        stock = name.endswith(STOCK_SUFFIX)
        self.spec, self.target, self.config, self.eos, self.sampling = spec, target, config, eos, sampling
        self.model = stock_copy(target.model) if stock else target.model
        self.algorithm = name[: -len(STOCK_SUFFIX)] if stock else name
        self.kwargs = self._kwargs(params, drafter, stock)

    def _kwargs(self, params: dict, drafter: LoadedModel | None, stock: bool) -> dict:
        """generate's arguments that make it this peer's algorithm."""
        if self.algorithm == "hf-assisted":
            # The same drafter as `sd`: the --drafter model, else the target itself.
            assistant = (drafter or self.target).model
            return {"assistant_model": stock_copy(assistant) if stock else assistant}
        given = {key: _number(self.spec, key, value, "int") for key, value in params.items()}
        if self.algorithm == "hf-pld":
            tokens = given.get("tokens")
            return {"prompt_lookup_num_tokens": tokens if tokens is not None else self.config.hf_pld_tokens}
        if self.algorithm == "hf-early-exit":
            layer = given.get("layer")
            layer = layer if layer is not None else self.config.hf_early_exit_layer
            return {"assistant_early_exit": layer if layer is not None else self.target.identity.num_layers // 2}
        return {}

    def run(self, prompt_ids: torch.Tensor, max_new_tokens: int, generator: torch.Generator | None) -> Outcome:
        model = self.model
        kwargs = dict(self.kwargs)
        if self.sampling.greedy:
            kwargs.update(do_sample=False)
        else:
            kwargs.update(do_sample=True, temperature=self.sampling.temperature, top_k=self.sampling.top_k or None,
                          top_p=self.sampling.top_p)
            if generator is not None:
                torch.manual_seed(int(torch.randint(0, 2**31 - 1, (1,), generator=generator)))
        eos = list(self.eos) or None
        started = time.perf_counter()
        with torch.inference_mode(), model_lock(model):
            device = next(model.parameters()).device
            output = model.generate(
                prompt_ids[None].to(device), attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long, device=device),
                max_new_tokens=max_new_tokens, eos_token_id=eos, pad_token_id=eos[0] if eos else None, **kwargs,
            )
        tokens = output[0, len(prompt_ids):].tolist()  # copies to the host: the clock reads after the device finished
        seconds = time.perf_counter() - started
        if eos:  # transformers pads nothing for batch 1, but cut after the first EOS to be safe
            for i, token in enumerate(tokens):
                if token in self.eos:
                    tokens = tokens[: i + 1]
                    break
        return Outcome(tokens, seconds, None)


def _on_transformers(loaded: LoadedModel | None, spec: str | None, dtype: str, config: BenchConfig) -> LoadedModel | None:
    """``loaded`` if it runs on transformers' modules, else the same model loaded that way in
    ``dtype`` (the ``hf-*`` peers are transformers' generate on transformers' modules: what its users
    get; ``auto`` there is ``fastest_dtype``)."""
    if loaded is None or model_code(loaded.model) == "transformers":
        return loaded
    twin = load_model(spec, dtype, config.device, config.kernels, "transformers")
    if twin.identity != loaded.identity:
        raise BenchError(f"the transformers copy of {spec} is not the model the methods run ({twin.identity.mismatch(loaded.identity)})")
    return twin


# ---- the run --------------------------------------------------------------------------------------

def _task_quality(prompt: Prompt, text: str, dataset: str, code_sandbox: bool = True, cut: bool = False) -> dict:
    """The dataset's own quality columns for one text; ``cut``: the token budget ended it."""
    if dataset == "json_extract":
        return metrics.json_extract_scores(prompt.extra["schema"], text, prompt.reference, cut)
    if dataset == "gsm8k" and prompt.reference:
        return {"gsm8k_exact_match": metrics.gsm8k_exact_match(text, prompt.reference)}
    if dataset == "humaneval":
        program = metrics.extract_code(text, prompt.extra["prompt"], prompt.extra["entry_point"])
        passed = metrics.humaneval_pass(program, prompt.extra["test"], prompt.extra["entry_point"], sandbox=code_sandbox)
        return {"humaneval_pass@1": float(passed)}
    if dataset in ("cnn_dailymail", "xsum") and prompt.reference:
        return {"rouge_l": metrics.rouge_l(text, prompt.reference)}
    if dataset == "mt_bench" and prompt.reference:
        return {"rouge_l": metrics.rouge_l(text, prompt.reference)}
    return {}


def run_bench(config: BenchConfig, out: Path, progress: bool = True, target: LoadedModel | None = None,
              drafter: LoadedModel | None = None, generate: bool = True, cluster: ClusterConfig | None = None,
              allow_code_execution: bool = False) -> dict:
    """Run (or resume) a benchmark into ``out``; returns the summary.

    ``generate=False`` only rebuilds the summary, table and plots from the records already in
    ``out`` (e.g. of a run that was stopped early). One run at a time holds ``out``
    (``folder_lock``): a second is refused, not interleaved with the first. ``cluster``: the
    prompts are shared out to Ray workers (``tierspec.cluster``), each loading the models by path;
    this process stays the folder's only writer (a summary never needs the cluster). HumanEval
    scores run the model's code (``sandbox``): refused unless ``allow_code_execution`` or
    ``TIERSPEC_ALLOW_CODE_EXECUTION=1``."""
    if config.dataset == "humaneval" and generate:
        check_code_execution_allowed(allow_code_execution)
        check_isolation(config.code_sandbox)  # no isolation (and no opt-out), no run: said before any generation
    elif generate and (allow_code_execution or not config.code_sandbox):
        raise BenchError(f"--allow-code-execution and --no-sandbox concern humaneval's code runs; {config.dataset} runs "
                         "no code: leave them out")
    if out.exists() and not out.is_dir():
        raise BenchError(f"--out {out} is a file; give a folder (a new one, or one a bench run made)")
    cluster = cluster if generate else None
    if cluster is not None:
        if target is not None or drafter is not None:
            raise BenchError("a run on Ray loads its models on every worker, by path: pass the models' paths, "
                             "not loaded models")
        cluster.check_device(config.device)
    if not generate and not out.is_dir():
        raise BenchError(f"{out} does not exist: nothing to summarize")
    created = not out.exists()
    try:
        with folder_lock(out):
            if not generate and not (out / "records.jsonl").is_file():
                raise BenchError(f"{out} holds no records.jsonl of a bench run: nothing to summarize")
            return _run_bench(config, out, progress, target, drafter, generate, cluster)
    except BaseException:
        # A run that failed before writing anything leaves no empty folder behind.
        if created and out.is_dir() and not any(out.iterdir()):
            out.rmdir()
        raise


_LOCK_NAME = ".bench.lock"


def folder_lock(out: Path):
    """Hold the bench folder ``out`` for a run, or refuse at once with the holder's pid
    (``util.exclusive_lock`` on ``out/.bench.lock``)."""
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise BenchError(f"cannot create the bench folder {out}: {error.strerror}") from None
    return exclusive_lock(out / _LOCK_NAME, f"the bench folder {out}", "tierspec bench", BenchError)


@dataclass(frozen=True)
class BenchUnit:
    """The bench's unit of work: one prompt and repeat, with the methods still to run on it in
    the order they run. One worker runs a unit's methods back to back, so that every ratio on a
    prompt is taken on one machine, a moment apart."""

    repeat: int
    prompt: Prompt
    methods: tuple[str, ...]

    def __str__(self) -> str:
        return f"prompt {self.prompt.id} (repeat {self.repeat})"


def bench_units(prompts: list[Prompt], methods: list[str], repeats: int,
                done: set[tuple[str, str, int]]) -> list[BenchUnit]:
    """The units still to do, repeat by repeat and prompt by prompt, methods in their order
    rotated by the prompt's place (drift of a shared machine hits all alike); ``done`` holds
    (method, prompt id, repeat) of the records already made."""
    units = []
    for repeat in range(repeats):
        for i, prompt in enumerate(prompts):
            order = methods[i % len(methods):] + methods[: i % len(methods)]
            todo = tuple(m for m in order if (m, prompt.id, repeat) not in done)
            if todo:
                units.append(BenchUnit(repeat, prompt, todo))
    return units


@dataclass(frozen=True)
class WorkerSettings:
    """What a worker settled that the run's settings may leave open (records name the dtype and
    the code they were computed in), and where it runs (``cluster.MachineInfo`` as a dict)."""

    dtype: str
    implementation: str
    encoder_decoder: bool
    machine: dict


class BenchWorker:
    """One process's share of a bench run: the models (loaded once), the method runners, and
    the records of the units it is given. The single-process run has one; a run on Ray one per
    worker (``cluster.WorkerPool``), each loading the target, drafter and peers by path."""

    def __init__(self, name: str, config: BenchConfig, target: LoadedModel | None = None,
                 drafter: LoadedModel | None = None, build_runners: bool = True):
        """``build_runners=False`` leaves the runners to ``build_runners()``: a run checks that it
        may resume into its folder first (building them can take seconds: peers, heads, costs)."""
        self.requested_dtype = config.dtype  # what the models load with: ``auto`` is load_model's own
        self.target = target or load_model(config.target, config.dtype, config.device, config.kernels,
                                           config.implementation)
        if drafter is None and config.drafter:
            drafter = load_model(config.drafter, config.dtype, config.device, config.kernels, config.implementation)
        self.drafter = drafter
        # The records say what computed them ("auto" is settled here, by every worker of a Ray run
        # itself: it depends on the model and the CPU, and the driver may lack the workers' devices).
        self.config = replace(config, dtype=settled_dtype(config.dtype, self.target),
                              implementation=model_code(self.target.model))
        self.machine = MachineInfo.here(name, self.target.device).to_dict()
        self.runners: dict[str, MethodRunner] = {}
        self._grammars: dict[str, object] = {}  # a constrained set's compiled schemas, by their JSON text
        self.warmed_up = False
        if build_runners:
            self.build_runners()

    def describe(self) -> WorkerSettings:
        return WorkerSettings(self.config.dtype, self.config.implementation, is_encoder_decoder(self.target.model),
                              self.machine)

    def build_runners(self) -> None:
        config, target, drafter = self.config, self.target, self.drafter
        hf_models = None
        if any(parse_spec(spec)[0] in HF_PEERS for spec in config.methods):
            hf_models = tuple(_on_transformers(model, spec, self.requested_dtype, config) for model, spec in
                              ((target, config.target), (drafter, config.drafter)))
        # Models in another dtype, for specs that ask for one (loaded once per dtype; the run's own
        # target still encodes the prompts and scores every method's text).
        models = {None: (target, drafter)}
        for spec in config.methods:
            dtype = spec_dtype(spec)
            dtype = None if dtype == self.requested_dtype else dtype
            if dtype not in models:
                models[dtype] = tuple(load_model(name, dtype, config.device, config.kernels, config.implementation)
                                      if name else None for name in (config.target, config.drafter))
            self.runners[spec] = MethodRunner(spec, *models[dtype], config, hf_models)

    def constraint(self, prompt: Prompt):
        """The compiled grammar ``prompt``'s text is constrained to (its JSON schema, on a set of
        ``data.CONSTRAINED_DATASETS``; compiled once per schema), else None."""
        if not self.config.constrained:
            return None
        from ..grammar import GrammarSpec, compile_grammar

        spec = GrammarSpec.json_schema(prompt.extra["schema"])
        if spec.source not in self._grammars:
            target = self.target
            self._grammars[spec.source] = compile_grammar(spec, target.tokenizer, target.vocab_size, eos_ids(target))
        return self._grammars[spec.source]

    def run(self, unit: BenchUnit) -> list[dict]:
        """The unit's records, together (what a Ray worker returns)."""
        return list(self.records(unit))

    def records(self, unit: BenchUnit) -> Iterator[dict]:
        """The unit's records, one per method, each as soon as it is made."""
        config, target, prompt = self.config, self.target, unit.prompt
        prompt_ids = encode_prompt(target, prompt.text)
        constraint = self.constraint(prompt)
        if not self.warmed_up:
            # Warm-up: first calls pay for allocator growth, thread pools and lazy imports.
            for runner in self.runners.values():
                try:
                    runner.run(prompt_ids, 8, torch.Generator().manual_seed(0), constraint)
                except PeerFailed:
                    pass  # a peer whose worker died: its records say why (below)
            self.warmed_up = True
        for spec in unit.methods:
            # Reduced to torch's 64-bit seed range (the same seed as before for every seed below ~1.8e13).
            generator = torch.Generator().manual_seed(
                (config.seed * 1000003 + unit.repeat * 7919 + zlib.crc32(prompt.id.encode())) % 2**64)
            on_cuda = target.device.type == "cuda"
            if on_cuda:
                torch.cuda.synchronize(target.device)
                torch.cuda.reset_peak_memory_stats(target.device)
            try:
                with PeakRSS() as memory:
                    outcome = self.runners[spec].run(prompt_ids, config.max_new_tokens, generator, constraint)
            except PeerFailed as error:  # the peer's worker died, hung or raised: this record says so
                yield {"method": spec, "prompt_id": prompt.id, "category": prompt.category, "repeat": unit.repeat,
                       "error": str(error), "worker": self.machine}
                continue
            text = target.tokenizer.decode(outcome.token_ids, skip_special_tokens=True) if target.tokenizer else ""
            record = {
                "method": spec,
                "prompt_id": prompt.id,
                "category": prompt.category,
                "repeat": unit.repeat,
                "emitted": len(outcome.token_ids),
                "seconds": outcome.seconds,
                "tokens_per_s": len(outcome.token_ids) / outcome.seconds if outcome.seconds > 0 else 0.0,
                "peak_rss_mb": round(memory.peak, 1),
                "token_ids": outcome.token_ids,
                "text": text,
                **(_stats_fields(outcome.stats) if outcome.stats else {}),
                **outcome.record_fields,
                **_task_quality(prompt, text, config.dataset, config.code_sandbox,
                                cut=bool(outcome.token_ids) and len(outcome.token_ids) >= config.max_new_tokens
                                and outcome.token_ids[-1] not in eos_ids(target)),
                "worker": self.machine,
            }
            if on_cuda:  # the GPU's own peak (the process's RSS says little there)
                record["cuda_max_allocated_mb"] = round(torch.cuda.max_memory_allocated(target.device) / 2**20, 1)
            if config.compute_nll:
                record["target_nll"] = metrics.target_nll(target.model, prompt_ids, outcome.token_ids)
            yield record


def agreed_settings(settings: list[WorkerSettings]) -> WorkerSettings:
    """The settings every worker settled alike; workers that settled ``auto`` differently (a
    bfloat16 CPU beside one without) would measure different things under one name."""
    def where(worker: WorkerSettings) -> str:
        return f"{worker.machine['worker']} on {worker.machine['host']}"

    first = settings[0]
    for other in settings[1:]:
        for key in ("dtype", "implementation", "encoder_decoder"):
            if getattr(other, key) != getattr(first, key):
                raise BenchError(f"the workers settled {key} differently ({where(first)}: {getattr(first, key)}, "
                                 f"{where(other)}: {getattr(other, key)}); pass --dtype and --implementation explicitly")
    return first


def append_records(path: Path, records: list[dict]) -> None:
    """Appends whole lines in one write: a unit's records land together (a write cut by a kill
    leaves a last line without its newline, which ``_drop_cut_tail`` removes). Opened per call:
    a file replaced under a long run (an editor, a git checkout) then receives the next records
    instead of an unlinked inode swallowing them."""
    try:
        with open(path, "a") as sink:
            sink.write("".join(json.dumps(record) + "\n" for record in records))
    except OSError as error:  # a full disk: the records so far stay whole (a rerun resumes)
        raise write_error(path, error) from None


def check_run_flags(config: BenchConfig, specs: list[tuple[str, dict[str, str]]]) -> None:
    """Refuse a run-wide setting that no method of the run reads (it would change nothing, with
    exit 0): ``--mask`` with no masked method that names none, ``--drafter`` with no method that
    drafts with a model, ``--hf-pld-tokens`` / ``--hf-early-exit-layer`` without their peer (or
    with every one of them naming its own)."""
    def bare(names: tuple[str, ...], own: str) -> bool:  # a spec of ``names`` that leaves ``own`` to the run
        return any(name.removesuffix(STOCK_SUFFIX) in names and own not in params for name, params in specs)

    unused = []
    if config.mask is not None and not bare(MASKED_METHODS, "mask"):
        unused.append(f"--mask (it serves {', '.join(MASKED_METHODS)} specs without a mask= of their own)")
    if config.drafter is not None and not any(
            name.removesuffix(STOCK_SUFFIX) == "hf-assisted" or (name in method_names() and drafts_with_model(
                name, MethodOptions(drafter_kind=params.get("drafter_kind", "auto")))) for name, params in specs):
        unused.append("--drafter (no method here drafts with a drafter model: sd, adaptive-sd, csd, pearl, hf-assisted, "
                      "or a lossy rule drafting with --draft-with auto or model)")
    if config.hf_pld_tokens != BenchConfig.hf_pld_tokens and not bare(("hf-pld",), "tokens"):
        unused.append("--hf-pld-tokens (it serves hf-pld specs without a tokens= of their own)")
    if config.hf_early_exit_layer is not None and not bare(("hf-early-exit",), "layer"):
        unused.append("--hf-early-exit-layer (it serves hf-early-exit specs without a layer= of their own)")
    if unused:
        raise BenchError(f"no method of this run uses {'; '.join(unused)}: leave it out or add a method that uses it")


def _run_bench(config: BenchConfig, out: Path, progress: bool, target: LoadedModel | None, drafter: LoadedModel | None,
               generate: bool, cluster: ClusterConfig | None) -> dict:
    if not generate:
        config = _the_folders_run(config, out)
    methods = list(dict.fromkeys(config.methods))
    if BASELINE not in methods:
        methods.insert(0, BASELINE)  # speed-ups are defined against plain decoding of the same run
    config = replace(config, methods=tuple(methods))
    if generate:  # a summary reports what the folder's run was given
        check_run_flags(config, [parse_spec(spec) for spec in methods])
    else:
        for spec in methods:
            parse_spec(spec)
    if config.free_text and config.dataset not in CONSTRAINED_DATASETS:
        raise BenchError(f"--free-text leaves a constrained set's texts free; {config.dataset} constrains none "
                         f"(constrained sets: {', '.join(CONSTRAINED_DATASETS)})")
    if config.constrained:
        names = [parse_spec(spec)[0] for spec in methods]
        peers = [spec for spec, name in zip(methods, names) if name not in method_names()
                 and not (name in PEER_FACTORIES and takes_json_schema(peer_class(PEER_FACTORIES[name])))]
        if peers:
            raise BenchError(f"the {config.dataset} set constrains each text to its JSON schema, which "
                             f"{', '.join(peers)} cannot do: bench tierspec's lossless methods and the "
                             f"llama.cpp peers on it")
    prompts = select(load_prompts(config.dataset, Path(config.data_dir) if config.data_dir else None),
                     config.per_category, config.limit, config.seed)
    if not prompts:
        raise BenchError("no prompts selected")
    reference = load_fidelity_reference(config.fidelity_reference) if config.fidelity_reference else None
    prompts = round_robin(prompts)
    failures: list[UnitFailure] = []
    if cluster is None:
        worker = BenchWorker("local", config, target, drafter, build_runners=False)
        config, prompts = _settle(config, worker.describe(), prompts, out, generate)
        if generate:
            worker.build_runners()
        _generate(config, out, prompts, progress, generate,
                  lambda units: ([record] for unit in units for record in worker.records(unit)))
    else:
        from ..cluster import WorkerPool, connected

        check_resumable(config, out, unsettled=("dtype", "implementation"))  # before any worker loads a model
        with connected(cluster), WorkerPool(BenchWorker, (config,), cluster) as pool:
            settings = agreed_settings(pool.start())
            config, prompts = _settle(config, settings, prompts, out, generate)
            _generate(config, out, prompts, progress, generate,
                      lambda units: (records for _, records in pool.run(units)))
            failures = pool.failures

    from .report import summarize, write_report

    records = read_records(out / "records.jsonl")
    references = {p.id: p.reference for p in prompts}
    summary = summarize(records, config, references, fidelity_reference=reference)
    write_report(summary, records, out)
    for name, failure in summary.get("failures", {}).items():  # the run went on; say loudly what is missing
        print(f"tierspec: warning: {name} failed on {failure['prompts']} prompt(s) (see summary.md; a rerun tries "
              f"them again): {failure['reasons'][0]}", file=sys.stderr)
    if generate:
        _report_failures(out, failures)
    return summary


def _the_folders_run(config: BenchConfig, out: Path) -> BenchConfig:
    """``config`` with the settings, methods and prompt selection of the run in ``out`` (its
    config.json), every method of its records included: a summary reports what was run. Without
    this, ``--summarize-only`` took the command's own --methods and --dataset (their defaults when
    left out) and rewrote the report without the other methods' results, with exit 0."""
    previous = _previous_config(out) or {}
    settings = {key: previous[key] for key in _SUMMARY_KEYS if key in previous}
    methods = list(settings.get("methods", config.methods))
    for record in read_records(out / "records.jsonl"):
        if record.get("method") not in methods:
            methods.append(record["method"])
    settings["methods"] = tuple(methods)
    return replace(config, **settings)


def _settle(config: BenchConfig, settings: WorkerSettings, prompts: list[Prompt], out: Path,
            generate: bool) -> tuple[BenchConfig, list[Prompt]]:
    """The run's settings as its worker(s) settled them, checked against the folder's (or, for a
    summary, taken from it), and the prompts in the form the target reads."""
    if settings.encoder_decoder:  # the same prompts in T5's task format (summarize: / translate English to German:)
        prompts = as_task_prompts(prompts, config.dataset, Path(config.data_dir) if config.data_dir else None)
    config = replace(config, implementation=settings.implementation, **({"dtype": settings.dtype} if generate else {}))
    if generate:
        check_resumable(config, out)
    else:  # a summary of records made earlier reports the settings they were made with
        previous = _previous_config(out) or {}
        config = replace(config, **{key: value for key, value in previous.items() if key in _RESUME_KEYS})
    return config, prompts


def _generate(config: BenchConfig, out: Path, prompts: list[Prompt], progress: bool, generate: bool,
              execute: Callable[[list[BenchUnit]], Iterable[list[dict]]]) -> None:
    """Makes the records still missing from ``out``: ``execute(units)`` yields them in batches
    as they are made (one record at a time in one process, a unit's on Ray), each batch
    appended at once by this process alone."""
    from tqdm.auto import tqdm

    records_path = out / "records.jsonl"
    if generate:
        _drop_cut_tail(records_path)
    # Error records (a peer that failed) are tried again by a rerun.
    done = {(r["method"], r["prompt_id"], r["repeat"]) for r in read_records(records_path) if "error" not in r}
    atomic_write_text(out / "config.json", json.dumps(asdict(config), indent=2))
    units = bench_units(prompts, list(config.methods), config.repeats, done) if generate else []
    # a resumed run's bar counts the run's whole work, starting at what the folder holds (it read 0/13, not 5/18)
    left = sum(len(unit.methods) for unit in units)
    whole = len(prompts) * len(config.methods) * config.repeats if generate else 0
    bar = tqdm(total=max(whole, left), initial=max(whole - left, 0), desc="bench", disable=not progress)
    for records in execute(units):
        append_records(records_path, records)
        bar.set_postfix_str(f"{records[-1]['method']} {records[-1]['prompt_id']}")
        bar.update(len(records))
    bar.close()


def _report_failures(out: Path, failures: list[UnitFailure]) -> None:
    """``failures.json`` lists the units a run gave up (each try's error), and the run fails
    loudly after its report is written; a run that gave up nothing removes an old list."""
    path = out / "failures.json"
    if not failures:
        path.unlink(missing_ok=True)
        return
    atomic_write_text(path, json.dumps([asdict(failure) for failure in failures], indent=2))
    named = ", ".join(failure.unit for failure in failures[:3]) + (", …" if len(failures) > 3 else "")
    raise BenchError(f"{len(failures)} prompt(s) failed on every try ({named}); their errors are in {path}. The report "
                     "covers the rest; a rerun tries them again")


def round_robin(prompts: list[Prompt]) -> list[Prompt]:
    """Categories take turns (one prompt of each, then the next of each …), so that a run
    stopped early still covers every category evenly."""
    by_category: dict[str, list[Prompt]] = {}
    for prompt in prompts:
        by_category.setdefault(prompt.category, []).append(prompt)
    ordered = []
    for i in range(max(len(v) for v in by_category.values())):
        ordered.extend(items[i] for items in by_category.values() if i < len(items))
    return ordered


def _stats_fields(stats: GenerationStats) -> dict:
    return {
        "position_drafted": stats.position_drafted,
        "position_accepted": stats.position_accepted,
        "draft_seconds": round(stats.draft_seconds, 5),
        "pass_seconds": round(stats.pass_seconds, 5),
        "grammar_seconds": round(stats.grammar_seconds, 5),
        "drafted": stats.drafted,
        "evaluated": stats.evaluated,
        "accepted": stats.accepted,
        "target_calls": stats.target_calls,
        "slim_calls": stats.slim_calls,
        "drafter_calls": stats.drafter_calls,
        "cycles": stats.cycles,
        "tiers": dict(stats.decided_by),
        "accepted_lengths": stats.accepted_lengths,
        **({"tree_cycles": stats.tree_cycles, "tree_nodes": stats.tree_nodes, "tree_depth": stats.tree_depth,
            "tree_max_nodes": stats.tree_max_nodes} if stats.tree_cycles else {}),
    }
