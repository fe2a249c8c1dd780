"""Small utilities shared across the package (no tierspec imports here: no import circles)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Callable


def cache_root() -> Path:
    """tierspec's own cache folder: ``$TIERSPEC_CACHE``, default ``~/.cache/tierspec`` (converted
    GGUF models, measured cost tables)."""
    return Path(os.environ.get("TIERSPEC_CACHE") or Path.home() / ".cache" / "tierspec")


def quiet_transformers() -> None:
    """Silence transformers' warnings and progress bars (imported here, on first use only)."""
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()


def default_file_mode() -> int:
    """The mode a plainly created file gets (0o666 less the umask); mkstemp's own is 0o600.
    The umask is read from /proc where it can be (setting it to read it back is not thread-safe)."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("Umask:"):
                    return 0o666 & ~int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    umask = os.umask(0o022)
    os.umask(umask)
    return 0o666 & ~umask


def atomic_write(path: Path, write: Callable[[Path], None]) -> None:
    """Make ``path`` with ``write(staging)`` so that readers see the old file or the new one,
    never half, with the permissions an ordinary write would give it (``write`` may replace the
    staging file: safetensors, for one, creates its files 0o600)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, staging = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    os.close(handle)
    try:
        write(Path(staging))
        os.chmod(staging, default_file_mode())
        with open(staging, "rb") as written:
            os.fsync(written.fileno())
        os.replace(staging, path)
    except BaseException:
        if os.path.exists(staging):
            os.unlink(staging)
        raise


def atomic_write_text(path: Path, text: str) -> None:
    """``atomic_write`` of ``text``."""
    atomic_write(path, lambda staging: staging.write_text(text))
