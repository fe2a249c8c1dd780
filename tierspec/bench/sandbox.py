"""Running model-written code (HumanEval's pass@1) in a sandbox, and only when the user opts in.

A candidate program runs in a child interpreter (``python -I``: no user site, no PYTHON* variables)
with:

- no network: a fresh network namespace (``unshare -rn``; its loopback is down); where the kernel
  refuses one, the code is not run at all;
- a wall-time limit (the whole process group is killed when it passes) and a CPU-time limit;
- limits from ``resource``: address space (memory), file size, open files, processes, no core
  files;
- a scratch working directory of its own (also its HOME and TMPDIR), removed afterwards, and an
  environment with nothing but PATH.

This keeps an accident (an endless loop, a huge allocation, a file filling the disk, a fork loop,
a download) from harming the machine; it is not a security boundary against code written to
escape (it runs as the same user). Hence the opt-in, as HF ``evaluate``'s ``code_eval`` asks
for one: ``--allow-code-execution`` or ``TIERSPEC_ALLOW_CODE_EXECUTION=1``."""

from __future__ import annotations

import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass

from ..errors import TierspecError

ALLOW_ENV = "TIERSPEC_ALLOW_CODE_EXECUTION"


class CodeExecutionRefused(TierspecError):
    """Model-written code would run, and the user has not allowed it (or it cannot be isolated)."""


def check_code_execution_allowed(allowed: bool) -> None:
    """Refuse, in one line, to run model-written code unless the user opted in."""
    if not (allowed or os.environ.get(ALLOW_ENV, "") == "1"):
        raise CodeExecutionRefused(
            "scoring HumanEval runs the code the model wrote; it runs sandboxed (no network, time, memory, file-size "
            f"and process limits, a scratch folder), but only if you allow it: pass --allow-code-execution or set "
            f"{ALLOW_ENV}=1")


@dataclass(frozen=True)
class Limits:
    wall_seconds: float = 10.0
    cpu_seconds: int = 10
    memory_bytes: int = 1 << 30  # address space: an interpreter needs ~50 MB; numpy-free HumanEval far less
    file_bytes: int = 10 << 20
    open_files: int = 64
    processes: int = 16  # threads count too (RLIMIT_NPROC)


@dataclass(frozen=True)
class SandboxResult:
    returncode: int | None  # None: killed at the wall-time limit
    stdout: str
    stderr: str

    @property
    def passed(self) -> bool:
        return self.returncode == 0


def network_isolation() -> list[str]:
    """The command prefix that gives the child a network namespace of its own, or a
    ``CodeExecutionRefused`` saying why there is none."""
    unshare = shutil.which("unshare")
    if unshare is None:
        raise CodeExecutionRefused("cannot run model-written code without network isolation: `unshare` (util-linux) "
                                   "is not installed")
    probe = subprocess.run([unshare, "-rn", "true"], capture_output=True, text=True)
    if probe.returncode != 0:
        raise CodeExecutionRefused("cannot run model-written code without network isolation: `unshare -rn` failed "
                                   f"({' '.join(probe.stderr.split()) or 'exit ' + str(probe.returncode)}); user "
                                   "namespaces are needed")
    return [unshare, "-rn"]


def _apply_limits(limits: Limits):
    def apply() -> None:  # in the child, before exec
        resource.setrlimit(resource.RLIMIT_CPU, (limits.cpu_seconds, limits.cpu_seconds))
        resource.setrlimit(resource.RLIMIT_AS, (limits.memory_bytes, limits.memory_bytes))
        resource.setrlimit(resource.RLIMIT_FSIZE, (limits.file_bytes, limits.file_bytes))
        resource.setrlimit(resource.RLIMIT_NOFILE, (limits.open_files, limits.open_files))
        resource.setrlimit(resource.RLIMIT_NPROC, (limits.processes, limits.processes))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))

    return apply


def run_sandboxed(source: str, limits: Limits = Limits()) -> SandboxResult:
    """Run the Python ``source`` in the sandbox described in the module docstring."""
    prefix = network_isolation()
    scratch = tempfile.mkdtemp(prefix="tierspec-sandbox-")
    try:
        path = os.path.join(scratch, "candidate.py")
        with open(path, "w") as handle:
            handle.write(source)
        env = {"PATH": os.environ.get("PATH", ""), "PYTHONHASHSEED": "0", "HOME": scratch, "TMPDIR": scratch,
               "PYTHONDONTWRITEBYTECODE": "1"}
        process = subprocess.Popen(prefix + [sys.executable, "-I", path], cwd=scratch, env=env,
                                   stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                   text=True, errors="replace", start_new_session=True,
                                   preexec_fn=_apply_limits(limits))
        try:
            stdout, stderr = process.communicate(timeout=limits.wall_seconds)
            return SandboxResult(process.returncode, stdout, stderr)
        except subprocess.TimeoutExpired:
            _kill_group(process)
            stdout, stderr = process.communicate()
            return SandboxResult(None, stdout, stderr)
        finally:
            if process.poll() is None:
                _kill_group(process)
                process.wait()
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _kill_group(process: subprocess.Popen) -> None:
    """The child and everything it started (its own session: ``start_new_session``)."""
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
