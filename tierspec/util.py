"""Small utilities shared across the package (only ``errors`` imported here: no import circles)."""

from __future__ import annotations

import hashlib
import os
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Callable

from .errors import TierspecError


def one_line(error: Exception) -> str:
    """An error's message on one line (the command line prints a user error as one line)."""
    return " ".join(str(error).split())


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


class WriteError(TierspecError, OSError):
    """A file could not be written (a full disk, no permission): one line naming the file. Also
    an ``OSError`` with the original ``errno`` and ``strerror``, so callers that handle a failed
    write (a cost table kept for the process only) still do."""

    def __init__(self, path: Path, error: OSError):
        super().__init__(f"cannot write {path}: {error.strerror or error}")
        self.errno, self.strerror, self.filename = error.errno, error.strerror, str(path)

    def __str__(self) -> str:
        return self.args[0]


def write_error(path: Path, error: OSError) -> WriteError:
    """The one-line error for ``error`` raised while writing ``path`` (``write()`` itself names
    no file: ENOSPC comes without one)."""
    return WriteError(path, error)


def atomic_write(path: Path, write: Callable[[Path], None]) -> None:
    """Make ``path`` with ``write(staging)`` so that readers see the old file or the new one,
    never half, with the permissions an ordinary write would give it (``write`` may replace the
    staging file: safetensors, for one, creates its files 0o600). An OS error (a full disk) is a
    ``WriteError`` naming ``path``; nothing is left behind."""
    path = Path(path)
    staging = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        handle, staging = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
        os.close(handle)
        write(Path(staging))
        os.chmod(staging, default_file_mode())
        with open(staging, "rb") as written:
            os.fsync(written.fileno())
        os.replace(staging, path)
    except BaseException as error:
        if staging is not None and os.path.exists(staging):
            os.unlink(staging)
        if isinstance(error, OSError):
            raise write_error(path, error) from None
        raise


@contextmanager
def exclusive_lock(lock_path: Path, what: str, job: str, error: type[TierspecError] = TierspecError):
    """Hold an exclusive lock on ``lock_path`` for the block, or refuse at once with the holder's
    pid (``what`` names the thing held: "the bench folder results/x"; ``job`` the command:
    "tierspec bench"). The lock is ``flock``: the
    kernel releases it when its process ends, so a killed run leaves no stale lock. The file holds
    the holder's pid and is removed on release; a run that opened it just before the removal sees
    that the path no longer names the file it locked and tries again."""
    import fcntl

    try:
        lock_path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as failure:
        raise error(f"cannot create the folder {lock_path.parent}: {failure.strerror}") from None
    while True:
        try:
            handle = open(lock_path, "a+")
        except OSError as failure:
            raise error(f"cannot write in the folder {lock_path.parent}: {failure.strerror}") from None
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            holder = handle.read().strip() or "unknown"
            handle.close()
            raise error(f"{what} is in use by another {job} run (pid {holder}); wait for it to end or "
                        "choose another --out") from None
        try:
            same = os.path.samestat(os.fstat(handle.fileno()), os.stat(lock_path))
        except FileNotFoundError:
            same = False
        if same:
            break
        handle.close()  # the holder removed the file as we opened it: lock the one at the path now
    try:
        handle.truncate(0)
        handle.write(str(os.getpid()))
        handle.flush()
        yield
    finally:
        lock_path.unlink(missing_ok=True)  # before the release: a waiting run then sees the path changed
        handle.close()


def atomic_write_text(path: Path, text: str) -> None:
    """``atomic_write`` of ``text``."""
    atomic_write(path, lambda staging: staging.write_text(text))


_SOURCE_FINGERPRINT: list[str] = []


def source_fingerprint() -> str:
    """A digest of the tierspec source this process imports (every Python module, and the C files
    its engine is compiled from), made once per process. What made a record: a bench folder's
    records are not resumed by other code, and every worker of a cluster must run the driver's.
    (``costs.code_fingerprint`` digests the compiled extensions instead: a cost measured times
    the build.)"""
    if not _SOURCE_FINGERPRINT:
        root = Path(__file__).resolve().parent
        digest = hashlib.sha256()
        files = [path for path in root.rglob("*") if path.is_file() and "__pycache__" not in path.parts
                 and (path.suffix == ".py" or (path.suffix in (".c", ".h") and "csrc" in path.parts))]
        for path in sorted(files):
            digest.update(path.relative_to(root).as_posix().encode() + b"\0")
            digest.update(hashlib.sha256(path.read_bytes()).digest())
        _SOURCE_FINGERPRINT.append(digest.hexdigest()[:16])
    return _SOURCE_FINGERPRINT[0]
