"""The GGUF conversion cache: a GGUF file de-quantised once into a float32 safetensors folder.

transformers de-quantises GGUF on every load (~20 s on 2 cores for the default model), so the
first load writes a plain copy under ``$TIERSPEC_CACHE`` (``util.cache_root``) and later loads
read that (well under a second). Each copy carries a marker file recording the source file's
hash (the loaded model's identity) and every written file's size, mtime and hash, so a copy
damaged later (truncated, overwritten) is found and converted again instead of failing on every
run until deleted by hand. ``models.load_model`` is the only caller.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

import torch

from .errors import ModelLoadError
from .gguf_check import check_gguf
from .util import cache_root, default_file_mode, quiet_transformers

CONVERTED_MARKER = "tierspec-source.json"


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 22), b""):
            digest.update(chunk)
    return digest.hexdigest()


def gguf_cache_dir(gguf: Path) -> Path:
    """Where the converted copy of ``gguf`` lives: keyed by the file's path, size and mtime (a
    replaced file gets a new copy without hashing it on every load)."""
    stat = gguf.stat()
    key = hashlib.sha256(f"{gguf.resolve()}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    return cache_root() / f"{gguf.stem}-{key}"


def converted_copy(gguf: Path, header=None) -> Path:
    """The folder of ``gguf``'s converted copy, converting it first when it is missing or
    damaged (a damaged one with a message). ``header``: the file's ``gguf_check.GgufHeader``
    where the caller checked it already (a conversion checks the file first otherwise)."""
    folder = gguf_cache_dir(gguf)
    problem = converted_copy_problem(folder)
    if problem is not None and folder.exists():
        # A folder without its marker is no finished copy (conversions finish in a staging folder
        # and are renamed into place with the marker): left by hand or by another tool. Keeping it
        # made every later conversion fail to move its result into place.
        print(f"tierspec: the converted copy of {gguf.name} in {folder} is damaged ({problem}); converting it again",
              file=sys.stderr)
        _remove_folder(folder)
    if problem is not None:
        convert_gguf(gguf, folder, torch.float32, header)
    return folder


def _remove_folder(folder: Path) -> None:
    """Delete a damaged copy, or say in one line what to delete by hand."""
    try:
        shutil.rmtree(folder)
    except OSError as error:
        raise ModelLoadError(f"the damaged converted copy {folder} cannot be removed ({error.strerror}); "
                             f"delete that folder and run again") from None


def reconvert(gguf: Path, reason: str) -> Path:
    """Convert ``gguf`` again after its copy failed to load for ``reason`` (damage the cheap
    check of ``converted_copy_problem`` did not see); returns the folder."""
    folder = gguf_cache_dir(gguf)
    print(f"tierspec: the converted copy in {folder} cannot be loaded ({reason}); converting it again", file=sys.stderr)
    _remove_folder(folder)
    convert_gguf(gguf, folder, torch.float32)
    return folder


def tokenizer_copy(gguf: Path, fields: dict) -> Path:
    """The folder of ``gguf``'s tokenizer copy: its tokenizer (with the chat template, where the file
    has one) and generation settings, no weights — for the models tierspec builds from the GGUF file
    itself (``tierspec.gguf_model``), which need no de-quantised copy (an 8B file's would take 32 GB).
    ``fields``: the file's header (``quant.read_gguf_tensors``). Written once, atomically, checked
    like a converted copy; its own folder, so no reader of converted copies mistakes it for one."""
    base = gguf_cache_dir(gguf)
    folder = base.with_name(base.name + "-tokenizer")
    problem = converted_copy_problem(folder)
    if problem is None:
        return folder
    if folder.exists():
        print(f"tierspec: the tokenizer copy of {gguf.name} in {folder} is damaged ({problem}); writing it again",
              file=sys.stderr)
        _remove_folder(folder)
    folder.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".staging-", dir=folder.parent))
    try:
        tokenizer = None  # a file without a tokenizer (a test's) gives a model of token ids, as such a folder does
        if "tokenizer.ggml.model" in fields:
            quiet_transformers()
            from transformers import AutoTokenizer

            try:
                with progress_bars_only_on_a_terminal("reading the GGUF file's tokenizer once"):
                    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
            except Exception as error:  # transformers raises many types for a tokenizer it cannot convert
                raise ModelLoadError(f"cannot read the tokenizer of GGUF file {gguf}: {error}") from error
        try:
            if tokenizer is not None:
                tokenizer.save_pretrained(staging)
            (staging / "generation_config.json").write_text(json.dumps(generation_settings(fields), indent=2))
            file_mode = default_file_mode()
            for item in staging.iterdir():
                os.chmod(item, file_mode)
            os.chmod(staging, file_mode | ((file_mode & 0o444) >> 2))
            write_conversion_marker(staging, gguf, sha256_file(gguf))
        except OSError as error:
            raise ModelLoadError(f"cannot write the tokenizer copy of {gguf.name} to {folder.parent}: {error.strerror}; "
                                 "free space there or set TIERSPEC_CACHE to another folder") from None
        try:
            os.replace(staging, folder)
        except OSError:
            if not (folder / CONVERTED_MARKER).exists():  # else another process finished it first
                raise
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    return folder


def generation_settings(fields: dict) -> dict:
    """generation_config.json's ids from a GGUF header: bos, pad and the end-of-generation ids (the
    end-of-sequence token and, where the file names them, the end-of-turn and end-of-message tokens
    that llama.cpp also stops at)."""
    ends = [fields[key] for key in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id",
                                    "tokenizer.ggml.eom_token_id") if isinstance(fields.get(key), int)]
    settings = {"eos_token_id": sorted(set(ends)) if len(set(ends)) > 1 else (ends[0] if ends else None)}
    for key, name in (("tokenizer.ggml.bos_token_id", "bos_token_id"), ("tokenizer.ggml.padding_token_id", "pad_token_id")):
        if isinstance(fields.get(key), int):
            settings[name] = fields[key]
    return {name: value for name, value in settings.items() if value is not None}


def source_hash(folder: Path) -> str:
    """The sha256 of the GGUF file a converted ``folder`` was made from (the model's identity)."""
    return json.loads((folder / CONVERTED_MARKER).read_text())["sha256"]


def convert_gguf(gguf: Path, dest: Path, dtype: torch.dtype, header=None) -> None:
    """De-quantise ``gguf`` once and write a safetensors folder to ``dest`` atomically. The file is
    checked first (``gguf_check``; skipped where ``header`` says it was): transformers' reader
    would convert a damaged file into a model that writes blank text, or never finish."""
    if header is None:
        check_gguf(gguf)
    from safetensors import SafetensorError
    from safetensors.torch import save_file

    quiet_transformers()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    # The staging folder first: a cache that cannot be written fails here, not after the slow read.
    dest.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".staging-", dir=dest.parent))
    try:
        try:
            with progress_bars_only_on_a_terminal():
                tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
                model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=dtype)
        except Exception as error:  # transformers raises many types for a bad GGUF file
            first = next(iter(str(error).strip().splitlines()), type(error).__name__)
            raise ModelLoadError(f"cannot read GGUF file {gguf}: {first}") from error
        tied = bool(getattr(model.config, "tie_word_embeddings", False))
        # safetensors refuses aliased tensors; a tied LM head is rebuilt from the embedding.
        state = {
            name: tensor.contiguous()
            for name, tensor in model.state_dict().items()
            if not (tied and name == "lm_head.weight")
        }
        try:
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
            write_conversion_marker(staging, gguf, sha256_file(gguf))
        except (OSError, SafetensorError) as error:  # a full disk: one line, nothing partial left
            reason = getattr(error, "strerror", None) or str(error)
            raise ModelLoadError(f"cannot write the converted copy of {gguf.name} to {dest.parent}: {reason}; free "
                                 "space there or set TIERSPEC_CACHE to another folder") from None
        try:
            os.replace(staging, dest)
        except OSError:
            # Another process finished the same conversion first; its copy is as good.
            if not (dest / CONVERTED_MARKER).exists():
                raise
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)


@contextlib.contextmanager
def progress_bars_only_on_a_terminal(what: str = "converting the GGUF file once (de-quantising; about 20 s on 2 cores)"):
    """transformers' GGUF reader draws a tqdm bar per tensor group (30-46 lines of it in a log):
    on a terminal it shows the slow conversion moving; anywhere else (a log, a pipe, CI) the bars
    are dropped, with one line saying what runs instead. Errors are raised, not printed, so none
    is lost."""
    if sys.stderr.isatty():
        yield
        return
    print(f"tierspec: {what}", file=sys.stderr, flush=True)
    with contextlib.redirect_stderr(io.StringIO()):
        yield


def write_conversion_marker(folder: Path, source: Path, source_sha256: str) -> None:
    """Record, in ``folder``, the source file's hash and every file the conversion wrote
    (size, mtime, hash) so that :func:`converted_copy_problem` can tell damage later."""
    marker = {"source": str(source), "sha256": source_sha256, "name": source.stem,
              "files": {item.name: file_record(item) for item in sorted(folder.iterdir()) if item.is_file()}}
    (folder / CONVERTED_MARKER).write_text(json.dumps(marker, indent=2))


def file_record(path: Path) -> dict:
    stat = path.stat()
    return {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns, "sha256": sha256_file(path)}


def converted_copy_problem(folder: Path) -> str | None:
    """Why the converted copy in ``folder`` cannot be trusted (None: it can).

    Every file the conversion wrote is checked against the marker: a missing file or another
    size is damage; a file whose modification time changed is hashed again (an overwrite at the
    same size). Unchanged files are not re-hashed, so a normal load stays fast.
    """
    marker_path = folder / CONVERTED_MARKER
    if not marker_path.exists():
        return "no conversion marker"
    unreadable = "unreadable conversion marker (or one written by an older tierspec)"
    try:
        files = json.loads(marker_path.read_text())["files"]
    except (OSError, ValueError, KeyError, TypeError):
        return unreadable
    # Valid JSON of another shape (a record without its size, a list of files) is as unreadable as
    # broken JSON: it was a KeyError on every later load, until the folder was deleted by hand.
    if not isinstance(files, dict) or not all(
            isinstance(name, str) and name and "/" not in name and name not in (".", "..") and isinstance(record, dict)
            and all(isinstance(record.get(key), int) and not isinstance(record.get(key), bool)
                    for key in ("size", "mtime_ns")) and isinstance(record.get("sha256"), str)
            for name, record in files.items()):
        return unreadable
    for name, record in files.items():
        path = folder / name
        if not path.exists():
            return f"{name} is missing"
        stat = path.stat()
        if stat.st_size != record["size"]:
            return f"{name} has {stat.st_size} bytes, {record['size']} were written"
        if stat.st_mtime_ns != record["mtime_ns"] and sha256_file(path) != record["sha256"]:
            return f"{name} was modified after conversion (checksum differs)"
    return None
