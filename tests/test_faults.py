"""Faults a hostile new user found, each reproduced: the fix must keep these passing."""

import ast
import io
import json
import sys
import threading
from pathlib import Path

import pytest
import torch
from conftest import as_method, run_ids, tiny_llama

from tierspec.decode import PromptError
from tierspec.drafters import NoDrafter
from tierspec.drafters.self_spec import SelfSpeculativeDrafter
from tierspec.routing import RoutingMask

MASK = RoutingMask.from_units(4, "sublayer", [("mlp", 1), ("attn", 2)])


# ---- 1. two generations on one loaded model in two threads -------------------------------------

def test_a_masked_generation_beside_a_plain_one_on_the_same_model_changes_nothing(prompt_ids):
    """A `self` generation applies its routing mask by swapping modules of the shared model;
    a plain generation in another thread must never run through the swapped modules."""
    target = tiny_llama(seed=1, sharpness=20.0)
    reference = run_ids(target, as_method(NoDrafter()), prompt_ids, 40)
    masked = as_method(SelfSpeculativeDrafter(MASK), num_draft=4)
    results, errors = [], []

    def plain():
        try:
            for _ in range(6):
                results.append(run_ids(target, as_method(NoDrafter()), prompt_ids, 40))
        except Exception as error:  # surfaced below
            errors.append(error)

    def self_drafting():
        try:
            for _ in range(6):
                run_ids(target, masked, prompt_ids, 40)
        except Exception as error:
            errors.append(error)

    threads = [threading.Thread(target=plain), threading.Thread(target=self_drafting)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors
    assert results == [reference] * 6


# ---- 2. a damaged converted model in the cache ------------------------------------------------

def planted_conversion(folder: Path):
    from tierspec.models import _CONVERTED_MARKER, _file_record

    folder.mkdir()
    (folder / "model.safetensors").write_bytes(b"x" * 1000)
    (folder / "config.json").write_text("{}")
    files = {p.name: _file_record(p) for p in folder.iterdir()}
    (folder / _CONVERTED_MARKER).write_text(json.dumps({"sha256": "s", "files": files}))


def test_damage_to_a_converted_copy_is_detected(tmp_path):
    import os

    from tierspec.models import converted_copy_problem

    folder = tmp_path / "copy"
    planted_conversion(folder)
    assert converted_copy_problem(folder) is None
    weights = folder / "model.safetensors"
    weights.write_bytes(b"x" * 500)  # truncated
    assert "500 bytes" in converted_copy_problem(folder)
    weights.write_bytes(b"y" * 1000)  # overwritten at the same size
    assert "modified after conversion" in converted_copy_problem(folder)
    weights.unlink()
    assert "missing" in converted_copy_problem(folder)
    planted_conversion(tmp_path / "again")
    # touched but unchanged: the hash is checked and still matches
    os.utime(tmp_path / "again" / "model.safetensors", ns=(1, 1))
    assert converted_copy_problem(tmp_path / "again") is None


# ---- 3. input that is not UTF-8 -----------------------------------------------------------------

def test_argv_that_is_not_utf8_is_a_clear_error(capsys):
    from tierspec.cli import main

    prompt = b"caf\xe9 au lait".decode("utf-8", "surrogateescape")  # what Python makes of such argv bytes
    assert main(["generate", prompt]) == 2
    assert "not valid UTF-8" in capsys.readouterr().err


def test_stdin_that_is_not_utf8_is_a_clear_error(capsys, monkeypatch):
    from tierspec.cli import main

    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"\xff\xfe hello")))
    assert main(["generate"]) == 2
    assert "stdin is not valid UTF-8" in capsys.readouterr().err


# ---- 4. a suspended stream must not leak inference mode ----------------------------------------

def test_a_suspended_stream_leaves_the_callers_autograd_alone(prompt_ids):
    import tierspec

    target = tiny_llama(seed=1, sharpness=20.0)
    text_stream = tierspec.stream(prompt_ids.tolist(), target=target, method="pld", max_new_tokens=20)
    steps = iter(text_stream._steps)
    next(steps)  # the generation is suspended mid-way
    assert not torch.is_inference_mode_enabled()
    weight = torch.ones(3, requires_grad=True)
    (weight * 2).sum().backward()  # the caller's own autograd code works
    assert weight.grad.tolist() == [2.0, 2.0, 2.0]
    steps.close()


# ---- 6. smaller ones ----------------------------------------------------------------------------

@pytest.mark.parametrize("flags, message", [
    (["--temperature", "nan"], "temperature must be a finite number"),
    (["--top-k", "-3"], "top_k must be an integer >= 0"),
    (["--method", "pld", "--num-draft", "-2"], "num_draft must be an integer >= 0"),
    (["--method", "adaptive-pld", "--num-draft", "-2"], "num_draft must be an integer >= 0"),
])
def test_bad_flags_get_the_flags_message(capsys, flags, message, monkeypatch, tiny_target):
    from tierspec import cli

    monkeypatch.setattr("tierspec.models.load_model", lambda spec, *a, **k: tiny_target)
    assert cli.main(["generate", "hi", *flags]) == 2
    assert message in capsys.readouterr().err


def test_a_mask_for_other_weights_says_so(tiny_target):
    from dataclasses import replace

    from tierspec.routing import RoutingMaskError

    made_for = replace(tiny_target.identity, name="smollm2-135m", content_hash="a" * 64)
    loaded = replace(made_for, content_hash="b" * 64)
    mask = RoutingMask.from_units(4, "sublayer", [("mlp", 1)], model=made_for)
    with pytest.raises(RoutingMaskError, match="other weights than those loaded") as error:
        mask.check_model(loaded)
    assert "not for 'smollm2-135m'" not in str(error.value)


def test_one_class_judge_data_is_refused_before_any_extraction(tmp_path):
    from tierspec.judge.data import JudgeDataError, read_judge_data

    path = tmp_path / "judge.jsonl"
    rows = [{"id": str(i), "prompt": "p", "response": "r 1 2", "mistake_offset": None, "split": s}
            for i, s in enumerate(["train", "train", "val"])]
    path.write_text("\n".join(json.dumps(r) for r in rows))
    with pytest.raises(JudgeDataError, match="no response with a mistake"):
        read_judge_data(path)


def test_token_ids_outside_the_vocabulary_are_a_prompt_error(tiny_target):
    with pytest.raises(PromptError, match="token id 64 is outside the model's vocabulary"):
        run_ids(tiny_target, as_method(NoDrafter()), torch.tensor([1, 2, 64]), 5)
    with pytest.raises(PromptError, match="must be integers"):
        run_ids(tiny_target, as_method(NoDrafter()), torch.tensor([1.5, 2.0]), 5)


def test_a_failed_bench_run_leaves_no_empty_folder(tmp_path):
    from tierspec.bench.runner import BenchConfig, BenchError, run_bench

    out = tmp_path / "run"
    with pytest.raises(BenchError):
        run_bench(BenchConfig(methods=("warp",)), out, progress=False)
    assert not out.exists()


def test_interrupting_a_resumable_command_says_how_to_resume(capsys, monkeypatch):
    from tierspec import cli

    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "_run_bench", interrupted)
    assert cli.main(["bench", "--out", "x"]) == 130
    assert "rerun the same command to resume" in capsys.readouterr().err


# ---- 7. internal bugs show their traceback; validation errors are one line ----------------------

def test_an_internal_bug_is_not_dressed_up_as_a_user_error(monkeypatch):
    from tierspec import cli

    def buggy(args):
        raise ValueError("an internal bug")  # not a TierspecError

    monkeypatch.setattr(cli, "_run_generate", buggy)
    with pytest.raises(ValueError, match="an internal bug"):
        cli.main(["generate", "hi"])


def test_debug_shows_the_traceback_of_validation_errors(monkeypatch, capsys):
    from tierspec import cli
    from tierspec.methods import UnknownMethodError

    assert cli.main(["generate", "hi", "--method", "warp"]) == 2
    assert capsys.readouterr().err.count("\n") == 1
    with pytest.raises(UnknownMethodError):
        cli.main(["--debug", "generate", "hi", "--method", "warp"])
    monkeypatch.setenv("TIERSPEC_DEBUG", "1")
    with pytest.raises(UnknownMethodError):
        cli.main(["generate", "hi", "--method", "warp"])


# ---- structure: no import circles ---------------------------------------------------------------

def _imports(package_root: Path) -> dict[str, set[str]]:
    """Module → tierspec modules it imports (at any level, functions included)."""
    graph = {}
    for path in package_root.rglob("*.py"):
        parts = path.relative_to(package_root.parent).with_suffix("").parts
        module = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        package = ".".join(parts[:-1])
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")
                    base = base[: len(base) - node.level + 1]
                    name = ".".join(base + ([node.module] if node.module else []))
                else:
                    name = node.module or ""
                names = [name] + [f"{name}.{alias.name}" for alias in node.names]
            elif isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            else:
                continue
            targets.update(n for n in names if n.startswith("tierspec"))
        graph[module] = targets
    modules = set(graph)
    return {m: {t for t in targets if t in modules and t != m} for m, targets in graph.items()}


def test_the_package_has_no_import_circles():
    import tierspec

    graph = _imports(Path(tierspec.__file__).parent)
    # A package's __init__ re-exporting its modules is not a circle; drop edges into packages
    # from their own submodules.
    for module, targets in graph.items():
        graph[module] = {t for t in targets if not module.startswith(t + ".")}
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(module):
        state[module] = 1
        stack.append(module)
        for target in sorted(graph[module]):
            if state.get(target) == 1:
                cycle = stack[stack.index(target):] + [target]
                pytest.fail("import circle: " + " → ".join(cycle))
            if target not in state:
                visit(target)
        stack.pop()
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module)


def test_atomic_writes_get_the_permissions_of_an_ordinary_write(tmp_path):
    import os
    import stat

    from tierspec.util import atomic_write_text

    (tmp_path / "plain.txt").write_text("x")
    atomic_write_text(tmp_path / "atomic.txt", "x")
    mode = lambda name: stat.S_IMODE(os.stat(tmp_path / name).st_mode)  # noqa: E731
    assert mode("atomic.txt") == mode("plain.txt")
