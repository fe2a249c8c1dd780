"""Running model-written code (HumanEval's pass@1) in a sandbox, and only when the user opts in.

A candidate program runs in ``python -I`` inside bubblewrap (``bwrap``, Debian's ``bubblewrap``
package; it uses the kernel's namespaces, no daemon, no setuid needed where user namespaces are
allowed):

- **its own PID namespace**: the program and everything it starts (a daemon that ``setsid``-s and
  forks included) die together when the sandbox's first process is killed at the wall-time limit;
  it sees no process outside and cannot signal the bench (``os.kill(os.getppid(), SIGKILL)`` names
  the sandbox's own init, which ignores it); the sandbox is also killed if the bench dies
  (``--die-with-parent``);
- **a file system of its own**: read-only binds of ``/usr`` (with ``/bin``, ``/lib``… links), the
  interpreter's prefix and the few ``/etc`` files the dynamic loader reads — nothing else: no
  ``/etc/shadow``, no home folder, no working tree; a private writable scratch (a size-capped
  tmpfs: its working directory, HOME and TMPDIR) that vanishes with it;
- **no network** (a network namespace of its own), no IPC with the host, a bare environment, no
  capabilities, no further user namespaces;
- **limits** (``prlimit`` inside): CPU time, address space, file size, open files, no core files,
  and processes — ``RLIMIT_NPROC`` counts per user namespace, so it binds a non-root caller's
  sandbox alone; the kernel never applies it to uid 0, so for a root caller (CI, these machines)
  the sandbox runs in a pids cgroup of its own (``pids.max``) and code is refused where none can be
  made.

Output goes to files (size-limited like any file), not pipes: a leftover process holding a pipe
cannot keep ``run_sandboxed`` waiting. It returns within the wall-time limit plus about a second
whatever the program does.

Where this isolation cannot be had (no ``bwrap``, user namespaces disabled, root without a pids
cgroup) model-written code is refused in one line that says why, unless the user opts out
explicitly: ``--no-sandbox`` (``tierspec bench``) or ``TIERSPEC_NO_SANDBOX=1`` — then the program
runs with the ``resource`` limits and a scratch folder only, as before this module held. Either
way code runs only by opt-in, as HF ``evaluate``'s ``code_eval`` asks for one:
``--allow-code-execution`` or ``TIERSPEC_ALLOW_CODE_EXECUTION=1``.
"""

from __future__ import annotations

import functools
import os
import resource
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from ..errors import TierspecError

ALLOW_ENV = "TIERSPEC_ALLOW_CODE_EXECUTION"
NO_SANDBOX_ENV = "TIERSPEC_NO_SANDBOX"
BWRAP_INSTALL = "apt-get install bubblewrap (Debian/Ubuntu; dnf install bubblewrap on Fedora)"
# What the dynamic loader and the interpreter read from /etc (no secrets among them).
_ETC_FILES = ("ld.so.cache", "ld.so.conf", "ld.so.conf.d", "localtime")
_SCRATCH = "/sandbox"
_KILL_GRACE_SECONDS = 1.0


class CodeExecutionRefused(TierspecError):
    """Model-written code would run, and the user has not allowed it (or it cannot be isolated)."""


def check_code_execution_allowed(allowed: bool) -> None:
    """Refuse, in one line, to run model-written code unless the user opted in."""
    if not (allowed or os.environ.get(ALLOW_ENV, "") == "1"):
        raise CodeExecutionRefused(
            "scoring HumanEval runs the code the model wrote; it runs sandboxed (its own PID, mount and network "
            "namespaces, a read-only view of the system, time, memory, file-size and process limits, a scratch "
            f"folder), but only if you allow it: pass --allow-code-execution or set {ALLOW_ENV}=1")


@dataclass(frozen=True)
class Limits:
    wall_seconds: float = 10.0
    cpu_seconds: int = 10
    memory_bytes: int = 1 << 30  # address space: an interpreter needs ~50 MB; numpy-free HumanEval far less
    file_bytes: int = 10 << 20
    open_files: int = 64
    processes: int = 16  # threads count too (RLIMIT_NPROC, pids.max)
    scratch_bytes: int = 64 << 20  # the writable tmpfs


@dataclass(frozen=True)
class SandboxResult:
    returncode: int | None  # None: killed at the wall-time limit
    stdout: str
    stderr: str

    @property
    def passed(self) -> bool:
        return self.returncode == 0


def sandbox_opted_out(sandbox: bool = True) -> bool:
    """Whether the user asked to run code without isolation (``--no-sandbox`` or the variable)."""
    return not sandbox or os.environ.get(NO_SANDBOX_ENV, "") == "1"


def check_isolation(sandbox: bool = True) -> None:
    """Refuse, in one line and before any generation, where code cannot be isolated (unless the
    user opted out)."""
    if not sandbox_opted_out(sandbox):
        _isolation()


@functools.lru_cache(maxsize=1)
def _isolation() -> "_Isolation":
    """How this machine isolates code: the ``bwrap`` binary, probed once, and whether a pids
    cgroup must bound the processes (a root caller). Raises ``CodeExecutionRefused``."""
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        raise CodeExecutionRefused(f"cannot run model-written code isolated: bubblewrap (`bwrap`) is not installed; "
                                   f"install it ({BWRAP_INSTALL}) or, on a machine you do not mind losing, opt out with "
                                   f"--no-sandbox ({NO_SANDBOX_ENV}=1)")
    if shutil.which("prlimit") is None:
        raise CodeExecutionRefused("cannot run model-written code isolated: `prlimit` (util-linux) is not installed")
    isolation = _Isolation(bwrap, shutil.which("prlimit"), os.geteuid() == 0)
    if isolation.needs_cgroup and _pids_cgroup_parent() is None:
        raise CodeExecutionRefused("cannot run model-written code isolated as root: the kernel does not apply process "
                                   "limits to uid 0 and no pids cgroup can be made here (/sys/fs/cgroup); run as "
                                   f"another user, or opt out with --no-sandbox ({NO_SANDBOX_ENV}=1)")
    probe = subprocess.run(isolation.command(Limits(), Path("/dev/null"), probe=True), capture_output=True, text=True,
                           timeout=30, stdin=subprocess.DEVNULL)
    if probe.returncode != 0:
        reason = " ".join(probe.stderr.split()) or f"exit {probe.returncode}"
        raise CodeExecutionRefused(f"cannot run model-written code isolated: bubblewrap cannot make its namespaces "
                                   f"here ({reason}); user namespaces must be allowed, or opt out with --no-sandbox "
                                   f"({NO_SANDBOX_ENV}=1)")
    return isolation


def _pids_cgroup_parent() -> Path | None:
    """A cgroup folder this process may create pids-limited children in: cgroup v1's pids
    hierarchy, or v2 where this process's cgroup delegates the pids controller."""
    v1 = Path("/sys/fs/cgroup/pids")
    if (v1 / "cgroup.procs").exists() and os.access(v1, os.W_OK):
        return v1
    try:
        own = next(line.split("::", 1)[1] for line in Path("/proc/self/cgroup").read_text().splitlines()
                   if line.startswith("0::"))
    except (OSError, StopIteration):
        return None
    for root in (Path("/sys/fs/cgroup"), Path("/sys/fs/cgroup/unified")):
        folder = root / own.strip().lstrip("/")
        try:
            if "pids" in (folder / "cgroup.subtree_control").read_text().split() and os.access(folder, os.W_OK):
                return folder
        except OSError:
            continue
    return None


@dataclass(frozen=True)
class _Isolation:
    bwrap: str
    prlimit: str
    needs_cgroup: bool

    def command(self, limits: Limits, program: Path, probe: bool = False, info_fd: int | None = None) -> list[str]:
        """The bwrap command line that runs ``program`` (read-only, as /sandbox/candidate.py) under
        ``limits``; ``probe``: one that only checks the namespaces can be made."""
        args = [self.bwrap, "--unshare-all", "--unshare-user", "--die-with-parent", "--new-session", "--cap-drop", "ALL",
                "--disable-userns", "--hostname", "sandbox", "--clearenv",
                "--ro-bind", "/usr", "/usr"]
        for name in ("bin", "sbin", "lib", "lib32", "lib64", "libx32"):
            path = Path("/") / name
            if path.is_symlink():
                args += ["--symlink", os.readlink(path), str(path)]
            elif path.is_dir():
                args += ["--ro-bind", str(path), str(path)]
        for name in _ETC_FILES:
            args += ["--ro-bind-try", f"/etc/{name}", f"/etc/{name}"]
        for folder in _interpreter_folders():
            args += ["--ro-bind", folder, folder]
        args += ["--proc", "/proc", "--dev", "/dev", "--size", str(limits.scratch_bytes), "--tmpfs", "/tmp",
                 "--size", str(limits.scratch_bytes), "--tmpfs", _SCRATCH]
        if info_fd is not None:
            args += ["--info-fd", str(info_fd)]
        if probe:
            return args + ["--remount-ro", "/", "--", sys.executable, "-I", "-c", "pass"]
        args += ["--ro-bind", str(program), f"{_SCRATCH}/candidate.py", "--remount-ro", "/", "--chdir", _SCRATCH]
        for key, value in _environment(_SCRATCH, "/tmp").items():
            args += ["--setenv", key, value]
        return args + ["--", self.prlimit, f"--cpu={limits.cpu_seconds}", f"--as={limits.memory_bytes}",
                       f"--fsize={limits.file_bytes}", f"--nofile={limits.open_files}",
                       f"--nproc={limits.processes}", "--core=0", "--",
                       sys.executable, "-I", f"{_SCRATCH}/candidate.py"]


def _interpreter_folders() -> list[str]:
    """The folders the interpreter runs from (its prefix; a virtual environment's base too),
    outermost only."""
    folders = {os.path.realpath(p) for p in (sys.prefix, sys.base_prefix, os.path.dirname(os.path.realpath(sys.executable)))}
    folders = {f for f in folders if not f.startswith("/usr/") and f != "/usr"}
    return sorted(f for f in folders if not any(f != g and f.startswith(g + os.sep) for g in folders))


def _environment(home: str, tmp: str) -> dict[str, str]:
    return {"PATH": "/usr/bin:/bin", "PYTHONHASHSEED": "0", "HOME": home, "TMPDIR": tmp,
            "PYTHONDONTWRITEBYTECODE": "1"}


def run_sandboxed(source: str, limits: Limits = Limits(), sandbox: bool = True) -> SandboxResult:
    """Run the Python ``source`` in the sandbox described in the module docstring (``sandbox``
    False, or ``TIERSPEC_NO_SANDBOX=1``: the user's opt-out, limits only). Returns within
    ``limits.wall_seconds`` + about a second."""
    if sandbox_opted_out(sandbox):
        return _run_unisolated(source, limits)
    isolation = _isolation()
    private = Path(tempfile.mkdtemp(prefix="tierspec-sandbox-"))  # 0o700: the program never sees it
    cgroup = None
    try:
        program = private / "candidate.py"
        program.write_text(source)
        if isolation.needs_cgroup:
            cgroup = _PidsCgroup(limits.processes)
        info_read, info_write = os.pipe()
        with open(private / "stdout", "wb") as out, open(private / "stderr", "wb") as err:
            try:
                process = subprocess.Popen(isolation.command(limits, program, info_fd=info_write), stdin=subprocess.DEVNULL,
                                           stdout=out, stderr=err, pass_fds=(info_write,), start_new_session=True,
                                           preexec_fn=cgroup.enter if cgroup else None)
            finally:
                os.close(info_write)
            try:
                returncode = _wait(process, info_read, limits.wall_seconds)
            finally:
                os.close(info_read)
        return SandboxResult(returncode, _read(private / "stdout", limits), _read(private / "stderr", limits))
    finally:
        if cgroup is not None:
            cgroup.remove()
        shutil.rmtree(private, ignore_errors=True)


def _wait(process: subprocess.Popen, info_read: int, wall_seconds: float) -> int | None:
    """The sandbox's exit status, or None after killing it at the deadline. bwrap writes its
    sandbox's first process (the PID namespace's init) to the info pipe; killing that one ends
    every process in the namespace, and bwrap exits once they are gone."""
    deadline = time.monotonic() + wall_seconds
    info = b""
    while time.monotonic() < deadline:
        ready, _, _ = select.select([info_read], [], [], max(0.0, min(0.05, deadline - time.monotonic())))
        if ready:
            chunk = os.read(info_read, 4096)
            if not chunk:
                break
            info += chunk
        if process.poll() is not None:
            return _status(process.returncode)
    try:
        return _status(process.wait(timeout=max(0.0, deadline - time.monotonic())))
    except subprocess.TimeoutExpired:
        pass
    init = _child_pid(info)
    if init is not None and _parent_of(init) == process.pid:
        try:
            os.kill(init, signal.SIGKILL)
        except ProcessLookupError:
            pass
    try:
        process.wait(timeout=_KILL_GRACE_SECONDS)
    except subprocess.TimeoutExpired:
        _kill_group(process)
        process.wait()
    return None


def _status(returncode: int) -> int:
    """bwrap reports a program killed by signal s as 128 + s; keep it as Popen does (−s)."""
    return -(returncode - 128) if 128 < returncode < 160 else returncode


def _child_pid(info: bytes) -> int | None:
    import json

    try:
        return int(json.loads(info.decode())["child-pid"])
    except (ValueError, KeyError, TypeError):
        return None


def _parent_of(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("PPid:"):
                return int(line.split()[1])
    except (OSError, ValueError):
        return None
    return None


def _read(path: Path, limits: Limits) -> str:
    with open(path, "rb") as handle:
        return handle.read(limits.file_bytes).decode("utf-8", "replace")


class _PidsCgroup:
    """A pids cgroup of its own for one sandbox (a root caller's process limit): created before the
    sandbox starts, entered by its first process before it runs bwrap, removed after."""

    def __init__(self, processes: int):
        parent = _pids_cgroup_parent()
        if parent is None:
            raise CodeExecutionRefused("no pids cgroup can be made here to limit a root caller's sandbox")
        self.path = parent / f"tierspec-sandbox-{uuid.uuid4().hex[:12]}"
        try:
            self.path.mkdir()
            # bwrap's two processes come on top of the program's own
            (self.path / "pids.max").write_text(str(processes + 2))
        except OSError as error:
            raise CodeExecutionRefused(f"cannot make the pids cgroup {self.path} that limits a root caller's sandbox "
                                       f"({error.strerror or error})") from None
        self.procs = str(self.path / "cgroup.procs")

    def enter(self) -> None:  # in the child, before exec: only os calls
        fd = os.open(self.procs, os.O_WRONLY)
        try:
            os.write(fd, str(os.getpid()).encode())
        finally:
            os.close(fd)

    def remove(self) -> None:
        deadline = time.monotonic() + _KILL_GRACE_SECONDS
        while True:
            try:
                self.path.rmdir()
                return
            except OSError:
                if time.monotonic() > deadline:
                    return  # a process still leaving: the empty cgroup is harmless
                for pid in (self.path / "cgroup.procs").read_text().split():
                    try:
                        os.kill(int(pid), signal.SIGKILL)
                    except (ProcessLookupError, ValueError):
                        pass
                time.sleep(0.01)


# ---- the user's opt-out: limits only -----------------------------------------------------------------


def _apply_limits(limits: Limits):
    def apply() -> None:  # in the child, before exec
        resource.setrlimit(resource.RLIMIT_CPU, (limits.cpu_seconds, limits.cpu_seconds))
        resource.setrlimit(resource.RLIMIT_AS, (limits.memory_bytes, limits.memory_bytes))
        resource.setrlimit(resource.RLIMIT_FSIZE, (limits.file_bytes, limits.file_bytes))
        resource.setrlimit(resource.RLIMIT_NOFILE, (limits.open_files, limits.open_files))
        resource.setrlimit(resource.RLIMIT_NPROC, (limits.processes, limits.processes))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))

    return apply


def _run_unisolated(source: str, limits: Limits) -> SandboxResult:
    """The opt-out: a child interpreter with the ``resource`` limits, a scratch folder (its HOME and
    TMPDIR) and output to files, killed with its process group at the limit. Nothing keeps it from
    the file system, the network or the bench's processes."""
    scratch = Path(tempfile.mkdtemp(prefix="tierspec-unsandboxed-"))
    try:
        (scratch / "candidate.py").write_text(source)
        with open(scratch / ".stdout", "wb") as out, open(scratch / ".stderr", "wb") as err:
            process = subprocess.Popen([sys.executable, "-I", "candidate.py"], cwd=scratch,
                                       env={**_environment(str(scratch), str(scratch)),
                                            "PATH": os.environ.get("PATH", "")},
                                       stdin=subprocess.DEVNULL, stdout=out, stderr=err, start_new_session=True,
                                       preexec_fn=_apply_limits(limits))
            try:
                returncode = process.wait(timeout=limits.wall_seconds)
            except subprocess.TimeoutExpired:
                _kill_group(process)
                process.wait()
                returncode = None
            _kill_group(process)  # what it left running in its session
        return SandboxResult(returncode, _read(scratch / ".stdout", limits), _read(scratch / ".stderr", limits))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _kill_group(process: subprocess.Popen) -> None:
    """The child and everything it started in its session (``start_new_session``)."""
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
