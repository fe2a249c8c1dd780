"""Model-written code runs sandboxed and only by opt-in (issue 33, item 5; issue 40, item 2): each
limit and each escape the issue found is planted with a program that tries it (and would harm the
machine or the caller without the sandbox)."""

import os
import socket
import subprocess
import tempfile
import textwrap
import time
import uuid
from pathlib import Path

import pytest

from tierspec import cli
from tierspec.bench import metrics, sandbox
from tierspec.bench.sandbox import (ALLOW_ENV, NO_SANDBOX_ENV, CodeExecutionRefused, Limits,
                                    check_code_execution_allowed, run_sandboxed)

FAST = Limits(wall_seconds=5.0, cpu_seconds=5)


def _isolation_problem() -> str | None:
    try:
        sandbox._isolation()
    except CodeExecutionRefused as error:
        return str(error)
    return None


needs_isolation = pytest.mark.skipif(_isolation_problem() is not None,
                                     reason=f"this machine cannot isolate code: {_isolation_problem()}")


def run(code: str, limits: Limits = FAST, **options):
    return run_sandboxed(textwrap.dedent(code), limits, **options)


def _processes_with(marker: str) -> list[int]:
    """Host pids whose command line holds ``marker``."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if marker.encode() in (entry / "cmdline").read_bytes():
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


def _daemon(marker: str, parent: str) -> str:
    """A program that starts a daemon (setsid + a second fork, as servers daemonise) sleeping a
    minute under ``marker``, then runs ``parent``."""
    return f"""
        import os, sys, time
        if os.fork() == 0:
            os.setsid()
            if os.fork() == 0:
                os.execv(sys.executable, [sys.executable, "-c", "import time; time.sleep(60)", "{marker}"])
            os._exit(0)
        os.wait()
        time.sleep(0.3)  # the daemon is up
        print("daemon started", flush=True)
        {parent}
    """


@needs_isolation
def test_a_correct_program_passes_and_a_failing_one_does_not():
    assert run("assert 1 + 1 == 2\n").passed
    assert not run("assert 1 + 1 == 3\n").passed
    result = run("import sys; print('out'); print('err', file=sys.stderr); sys.exit(3)")
    assert (result.returncode, result.stdout, result.stderr) == (3, "out\n", "err\n")


@needs_isolation
def test_an_endless_loop_is_killed_at_the_wall_time_limit():
    started = time.monotonic()
    result = run("import time\nwhile True:\n    time.sleep(0.1)\n", Limits(wall_seconds=1.0, cpu_seconds=5))
    assert result.returncode is None and not result.passed
    assert time.monotonic() - started < 1.0 + 1.0


@needs_isolation
def test_a_busy_loop_meets_the_cpu_limit():
    result = run("while True:\n    pass\n", Limits(wall_seconds=20.0, cpu_seconds=1))
    assert result.returncode is not None and not result.passed  # SIGXCPU/SIGKILL before the wall limit


@needs_isolation
def test_a_huge_allocation_fails_inside_the_memory_limit():
    result = run("blob = bytearray(4 << 30)\n", Limits(wall_seconds=10.0, cpu_seconds=5, memory_bytes=512 << 20))
    assert not result.passed and "MemoryError" in result.stderr


@needs_isolation
def test_a_file_past_the_size_limit_is_cut_in_a_private_scratch(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = run("""
        import os
        print(os.getcwd(), os.environ["HOME"], os.environ["TMPDIR"], flush=True)
        with open("big.bin", "wb") as f:
            f.write(b"x" * (50 << 20))
    """, Limits(wall_seconds=10.0, cpu_seconds=5, file_bytes=1 << 20))
    assert not result.passed  # SIGXFSZ
    assert result.stdout.split() == ["/sandbox", "/sandbox", "/tmp"]
    assert list(tmp_path.iterdir()) == []


@needs_isolation
def test_there_is_no_network():
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        result = run(f"""
            import socket
            for address in (("127.0.0.1", {port}), ("1.1.1.1", 53)):
                try:
                    socket.create_connection(address, timeout=2)
                    print("connected", address)
                except OSError as error:
                    print(type(error).__name__)
        """)
    assert result.passed and "connected" not in result.stdout
    assert result.stdout.split() == ["ConnectionRefusedError", "OSError"]  # its own loopback; no route out


@needs_isolation
def test_the_environment_is_bare():
    result = run("import os, sys\nassert set(os.environ) <= {'PATH', 'PYTHONHASHSEED', 'HOME', 'TMPDIR', "
                 "'PYTHONDONTWRITEBYTECODE', 'LC_CTYPE', 'PWD'}, sorted(os.environ)\n")
    assert result.passed, result.stderr


# ---- the escapes of issue 40 ---------------------------------------------------------------------------


@needs_isolation
def test_a_daemon_that_setsids_and_forks_dies_with_the_sandbox_at_the_limit():
    marker = f"tierspec-escape-{uuid.uuid4().hex}"
    started = time.monotonic()
    result = run(_daemon(marker, "time.sleep(600)"), Limits(wall_seconds=2.0, cpu_seconds=5))
    seconds = time.monotonic() - started
    assert result.returncode is None and result.stdout == "daemon started\n"
    assert seconds < 2.0 + 1.0, f"run_sandboxed came back after {seconds:.1f} s"
    assert _processes_with(marker) == []


@needs_isolation
def test_a_daemon_left_behind_by_a_program_that_exits_dies_too():
    marker = f"tierspec-escape-{uuid.uuid4().hex}"
    started = time.monotonic()
    result = run(_daemon(marker, "pass"), Limits(wall_seconds=5.0, cpu_seconds=5))
    assert result.passed and time.monotonic() - started < 5.0  # the program's exit ends the sandbox
    time.sleep(0.2)
    assert _processes_with(marker) == []


def _scratch_folders() -> set[Path]:
    return set(Path(tempfile.gettempdir()).glob("tierspec-sandbox-*"))


@needs_isolation
def test_the_program_cannot_see_or_signal_the_bench():
    neighbour = subprocess.Popen(["sleep", "30"])  # a host process the program must not reach either
    scratch_before = _scratch_folders()
    result = run("""
        import os, signal
        print(os.getppid(), sorted(int(p) for p in os.listdir("/proc") if p.isdigit()), flush=True)
        os.kill(os.getppid(), signal.SIGKILL)
        try:
            os.kill(-1, signal.SIGKILL)  # every process it may signal: only its own
        except ProcessLookupError:
            pass
    """)
    try:
        assert result.stdout.startswith("1 [1, 2]")  # its PID namespace: the sandbox's init and itself
        assert result.passed, result.stderr  # it ran to its end: nothing it signalled was outside
        assert neighbour.poll() is None  # kill(-1) did not reach the host's processes
        assert _scratch_folders() <= scratch_before  # and its private folder is gone
    finally:
        neighbour.kill()
        neighbour.wait()


@needs_isolation
def test_no_file_outside_the_scratch_can_be_written(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    home = Path.home()
    marker = f"tierspec-escape-{uuid.uuid4().hex}"
    outside = [home / marker, tmp_path / marker, Path(__file__).parent / marker, Path("/usr") / marker]
    result = run(f"""
        for path in {[str(p) for p in outside]!r} + ["/tmp/{marker}"]:
            try:
                open(path, "w").write("escaped")
                print("wrote", path)
            except OSError as error:
                print(type(error).__name__)
    """)
    # read-only where it sees the folder (home: an empty read-only stand-in; /usr), absent where it
    # does not (the caller's folders); its own /tmp is a tmpfs that vanishes with it
    # home: a read-only stand-in where the interpreter lives under it (OSError), absent otherwise
    written = result.stdout.split()
    assert written[0] in ("OSError", "FileNotFoundError"), result.stdout
    assert written[1:] == ["FileNotFoundError", "FileNotFoundError", "OSError", "wrote", f"/tmp/{marker}"], result.stdout
    for target in outside + [Path("/tmp") / marker]:
        assert not target.exists(), f"the sandboxed program wrote {target}"


@needs_isolation
def test_secrets_and_the_callers_folders_cannot_be_read(tmp_path):
    secret = Path.home() / f".tierspec-secret-{uuid.uuid4().hex}"
    secret.write_text("password")
    try:
        result = run(f"""
            import os
            for path in ("/etc/shadow", "/etc/gshadow", {str(secret)!r}, {str(Path(__file__))!r}, {str(tmp_path)!r}):
                try:
                    open(path).read() if not os.path.isdir(path) else os.listdir(path)
                    print("read", path)
                except OSError as error:
                    print(type(error).__name__)
        """)
    finally:
        secret.unlink()
    assert result.passed and "read" not in result.stdout, result.stdout


@needs_isolation
def test_processes_are_limited_even_for_root():
    result = run("""
        import os, time
        started = 0
        for _ in range(200):
            try:
                pid = os.fork()
            except BlockingIOError:
                break
            if pid == 0:
                time.sleep(3)
                os._exit(0)
            started += 1
        print(started)
    """, Limits(wall_seconds=10.0, cpu_seconds=5, processes=8))
    assert result.passed, result.stderr
    assert int(result.stdout) <= 8


@needs_isolation
def test_run_sandboxed_returns_within_its_limit_whatever_the_program_does():
    programs = ["import time; time.sleep(10**6)", "import os, signal; signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
                "while True: os.fork() if len(os.listdir('/proc')) < 40 else None",
                "import os\nos.close(1); os.close(2)\nwhile True: pass"]
    for program in programs:
        started = time.monotonic()
        result = run(program, Limits(wall_seconds=1.5, cpu_seconds=30))
        assert result.returncode is None and time.monotonic() - started < 1.5 + 1.0, program


@needs_isolation
def test_humaneval_scores_are_those_of_the_reference_solutions():
    """The shipped problems' canonical solutions pass and broken ones fail, isolated or not."""
    from tierspec.data import load_prompts

    for problem in load_prompts("humaneval")[:4]:
        extra = problem.extra
        right = extra["prompt"] + problem.reference
        wrong = extra["prompt"] + "    return None\n"
        for program, expected in ((right, True), (wrong, False)):
            assert metrics.humaneval_pass(program, extra["test"], extra["entry_point"]) is expected, problem.id
            assert metrics.humaneval_pass(program, extra["test"], extra["entry_point"], sandbox=False) is expected


# ---- refusals and opt-ins ------------------------------------------------------------------------------


def test_code_execution_needs_an_opt_in(monkeypatch):
    monkeypatch.delenv(ALLOW_ENV, raising=False)
    with pytest.raises(CodeExecutionRefused, match="pass --allow-code-execution or set TIERSPEC_ALLOW_CODE_EXECUTION=1"):
        check_code_execution_allowed(False)
    check_code_execution_allowed(True)
    monkeypatch.setenv(ALLOW_ENV, "1")
    check_code_execution_allowed(False)


def test_without_bubblewrap_code_is_refused_unless_the_user_opts_out(monkeypatch):
    monkeypatch.setattr(sandbox.shutil, "which", lambda name: None)
    monkeypatch.delenv(NO_SANDBOX_ENV, raising=False)
    sandbox._isolation.cache_clear()
    try:
        with pytest.raises(CodeExecutionRefused, match=r"bubblewrap \(`bwrap`\) is not installed; install it "
                           r"\(apt-get install bubblewrap.*opt out with --no-sandbox \(TIERSPEC_NO_SANDBOX=1\)$"):
            run("print('never')")
        monkeypatch.setattr(sandbox.shutil, "which", lambda name: "/usr/bin/" + name)
        assert run("print('limits only')", sandbox=False).stdout == "limits only\n"  # the explicit opt-out
        monkeypatch.setenv(NO_SANDBOX_ENV, "1")
        assert run("print('limits only')").stdout == "limits only\n"
    finally:
        sandbox._isolation.cache_clear()


def test_root_without_a_pids_cgroup_is_refused(monkeypatch):
    monkeypatch.setattr(sandbox.os, "geteuid", lambda: 0)
    monkeypatch.setattr(sandbox, "_pids_cgroup_parent", lambda: None)
    monkeypatch.setattr(sandbox.shutil, "which", lambda name: "/usr/bin/" + name)
    sandbox._isolation.cache_clear()
    try:
        with pytest.raises(CodeExecutionRefused, match="the kernel does not apply process limits to uid 0"):
            sandbox.check_isolation()
    finally:
        sandbox._isolation.cache_clear()


def test_the_humaneval_bench_refuses_in_one_line_before_loading_anything(monkeypatch, capsys, tmp_path):
    monkeypatch.delenv(ALLOW_ENV, raising=False)

    def no_loading(*args, **kwargs):
        raise AssertionError("loaded a model before refusing")

    monkeypatch.setattr("tierspec.models.load_model", no_loading)
    assert cli.main(["bench", "--dataset", "humaneval", "--methods", "ar", "--limit", "1",
                     "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("tierspec: error: scoring HumanEval runs the code the model wrote") and err.count("\n") == 1
    assert not (tmp_path / "out").exists()
