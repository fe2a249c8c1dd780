"""Model-written code runs sandboxed and only by opt-in (issue 33, item 5): each limit is planted
with a program that breaks it (and would harm the machine or the caller without it)."""

import os
import socket
import textwrap
from pathlib import Path

import pytest

from tierspec import cli
from tierspec.bench.sandbox import (ALLOW_ENV, CodeExecutionRefused, Limits, check_code_execution_allowed,
                                    run_sandboxed)

FAST = Limits(wall_seconds=5.0, cpu_seconds=5)


def run(code: str, limits: Limits = FAST):
    return run_sandboxed(textwrap.dedent(code), limits)


def test_a_correct_program_passes_and_a_failing_one_does_not():
    assert run("assert 1 + 1 == 2\n").passed
    assert not run("assert 1 + 1 == 3\n").passed


def test_an_endless_loop_is_killed_at_the_wall_time_limit():
    result = run("import time\nwhile True:\n    time.sleep(0.1)\n", Limits(wall_seconds=1.0, cpu_seconds=5))
    assert result.returncode is None and not result.passed


def test_a_busy_loop_meets_the_cpu_limit():
    result = run("while True:\n    pass\n", Limits(wall_seconds=20.0, cpu_seconds=1))
    assert result.returncode is not None and not result.passed  # SIGXCPU/SIGKILL before the wall limit


def test_a_huge_allocation_fails_inside_the_memory_limit():
    result = run("blob = bytearray(4 << 30)\n", Limits(wall_seconds=10.0, cpu_seconds=5, memory_bytes=512 << 20))
    assert not result.passed and "MemoryError" in result.stderr


def test_a_file_past_the_size_limit_is_cut_and_everything_lands_in_a_scratch_folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = run("""
        import os
        print(os.getcwd())
        with open("big.bin", "wb") as f:
            f.write(b"x" * (50 << 20))
    """, Limits(wall_seconds=10.0, cpu_seconds=5, file_bytes=1 << 20))
    assert not result.passed  # SIGXFSZ
    scratch = result.stdout.strip()
    assert scratch != str(tmp_path) and not Path(scratch).exists()  # its own folder, removed afterwards
    assert list(tmp_path.iterdir()) == []


def test_there_is_no_network():
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        result = run(f"""
            import socket
            socket.create_connection(("127.0.0.1", {port}), timeout=2)
        """)
    assert not result.passed and ("ConnectionRefused" in result.stderr or "unreachable" in result.stderr
                                  or "OSError" in result.stderr)


@pytest.mark.skipif(os.geteuid() == 0, reason="the kernel does not apply RLIMIT_NPROC to root")
def test_processes_are_limited():
    result = run("""
        import os
        for _ in range(64):
            if os.fork() == 0:
                import time; time.sleep(3); os._exit(0)
    """, Limits(wall_seconds=10.0, cpu_seconds=5, processes=8))
    assert not result.passed and "BlockingIOError" in result.stderr


def test_the_environment_is_bare():
    result = run("import os, sys\nassert set(os.environ) <= {'PATH', 'PYTHONHASHSEED', 'HOME', 'TMPDIR', "
                 "'PYTHONDONTWRITEBYTECODE', 'LC_CTYPE'}, sorted(os.environ)\n")
    assert result.passed, result.stderr


def test_code_execution_needs_an_opt_in(monkeypatch):
    monkeypatch.delenv(ALLOW_ENV, raising=False)
    with pytest.raises(CodeExecutionRefused, match="pass --allow-code-execution or set TIERSPEC_ALLOW_CODE_EXECUTION=1"):
        check_code_execution_allowed(False)
    check_code_execution_allowed(True)
    monkeypatch.setenv(ALLOW_ENV, "1")
    check_code_execution_allowed(False)


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
