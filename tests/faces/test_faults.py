"""Faults a hostile new user found, each reproduced: the fix must keep these passing."""

import ast
import io
import json
import sys
import threading
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from conftest import as_method, run_ids, tiny_llama

from tierspec.errors import PromptError
from tierspec.drafters import NoDrafter
from tierspec.drafters.self_spec import SelfSpeculativeDrafter
from tierspec.layerskip.masks import RoutingMask

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
    from tierspec.gguf_cache import CONVERTED_MARKER, file_record

    folder.mkdir()
    (folder / "model.safetensors").write_bytes(b"x" * 1000)
    (folder / "config.json").write_text("{}")
    files = {p.name: file_record(p) for p in folder.iterdir()}
    (folder / CONVERTED_MARKER).write_text(json.dumps({"sha256": "s", "files": files}))


def test_damage_to_a_converted_copy_is_detected(tmp_path):
    import os

    from tierspec.gguf_cache import converted_copy_problem

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


def test_a_pipe_named_gguf_is_refused_not_waited_on(tmp_path):
    import os

    from tierspec import load_model
    from tierspec.errors import ModelLoadError

    pipe = tmp_path / "model.gguf"
    os.mkfifo(pipe)  # opening it waited forever for a writer
    with pytest.raises(ModelLoadError, match="not a regular file"):
        load_model(str(pipe))


@pytest.mark.parametrize("files", [
    {"model.safetensors": {"mtime_ns": 1, "sha256": "s"}},  # a record without its size: was a KeyError on every load
    ["model.safetensors"],  # a list: was an AttributeError
    {"../model.safetensors": {"size": 1000, "mtime_ns": 1, "sha256": "s"}},  # a name outside the folder
    {"model.safetensors": {"size": "1000", "mtime_ns": 1, "sha256": "s"}},
])
def test_a_marker_of_another_shape_is_unreadable_not_an_error(files, tmp_path):
    """Valid JSON that is not a marker: the copy is converted again (``converted_copy``), as for broken JSON."""
    from tierspec.gguf_cache import CONVERTED_MARKER, converted_copy_problem

    folder = tmp_path / "copy"
    planted_conversion(folder)
    (folder / CONVERTED_MARKER).write_text(json.dumps({"sha256": "s", "files": files}))
    assert converted_copy_problem(folder).startswith("unreadable conversion marker")


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
    steps = iter(text_stream._run)  # the DecodeRun under the text
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
    (["--method", "pld", "--num-draft", "-2"], "--num-draft must be an integer from 0 to 64"),
    (["--method", "adaptive-pld", "--num-draft", "1000000"], "--num-draft must be an integer from 0 to 64"),
    (["--method", "ar", "--num-draft", "3"], "method 'ar' takes no num_draft"),
])
def test_bad_flags_get_the_flags_message(capsys, flags, message, monkeypatch, tiny_target):
    from tierspec import cli

    monkeypatch.setattr("tierspec.models.load_model", lambda spec, *a, **k: tiny_target)
    assert cli.main(["generate", "hi", *flags]) == 2
    assert message in capsys.readouterr().err


def test_a_mask_for_other_weights_says_so(tiny_target):
    from dataclasses import replace

    from tierspec.layerskip.masks import RoutingMaskError

    made_for = replace(tiny_target.identity, name="smollm2-135m", content_hash="a" * 64)
    loaded = replace(made_for, content_hash="b" * 64)
    mask = RoutingMask.from_units(4, "sublayer", [("mlp", 1)], model=made_for)
    with pytest.raises(RoutingMaskError, match="other weights than those loaded") as error:
        mask.check_model(loaded)
    assert "not for 'smollm2-135m'" not in str(error.value)


def test_one_class_judge_data_is_refused_before_any_extraction(tmp_path):
    from tierspec.training.judge_data import JudgeDataError, read_judge_data

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


# ---- 8. cache and seed problems are one-line errors (issue 23, finding 9) ------------------------

@contextmanager
def read_only(folder: Path):
    """``folder`` read-only for this process for the block: mode 0o555, and the immutable
    attribute where this process is root (root writes through modes); skipped where neither works."""
    import os
    import subprocess

    folder.chmod(0o555)
    immutable = False
    try:
        if os.geteuid() == 0:
            immutable = subprocess.run(["chattr", "+i", str(folder)], capture_output=True).returncode == 0
            if not immutable:
                pytest.skip("running as root without chattr: cannot make a folder read-only")
        yield folder
    finally:
        if immutable:
            subprocess.run(["chattr", "-i", str(folder)], check=True)
        folder.chmod(0o755)


def _cache_cases(tmp_path: Path) -> dict[str, Path]:
    (tmp_path / "a-file").write_text("not a folder")
    return {"a file": tmp_path / "a-file", "below a file": tmp_path / "a-file" / "cache"}


@pytest.mark.parametrize("case", ["a file", "below a file", "not permitted"])
def test_a_cache_that_cannot_be_used_is_a_one_line_error(case, tmp_path, monkeypatch, capsys):
    from tierspec import cli

    if case == "not permitted":
        if not Path("/sys/kernel").is_dir():
            pytest.skip("needs Linux's /sys (no process may create folders in it)")
        cache = Path("/sys/kernel/tierspec-cache")
    else:
        cache = _cache_cases(tmp_path)[case]
    monkeypatch.setenv("TIERSPEC_CACHE", str(cache))
    assert cli.main(["generate", "hi", "--method", "pld", "--max-new-tokens", "2"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("tierspec: error: cannot load model 'smollm2-135m': ") and err.count("\n") == 1
    assert "set TIERSPEC_CACHE to a folder this process can write" in err


def test_a_read_only_cache_without_the_converted_model_is_a_one_line_error(tmp_path, monkeypatch, capsys):
    from tierspec import cli

    cache = tmp_path / "cache"
    cache.mkdir()
    monkeypatch.setenv("TIERSPEC_CACHE", str(cache))
    with read_only(cache):
        assert cli.main(["generate", "hi", "--method", "pld", "--max-new-tokens", "2"]) == 2
        err = capsys.readouterr().err
        assert err.startswith("tierspec: error: cannot load model 'smollm2-135m': ") and err.count("\n") == 1
        assert list(cache.iterdir()) == []


def test_a_read_only_cache_holding_the_converted_model_serves_and_does_not_cache_costs(tmp_path, monkeypatch, capsys,
                                                                                     tiny_target):
    """A shared, read-only cache that holds the conversion is usable; a cost table that cannot be
    written there is kept for the process only, with a line saying so."""
    import os
    import shutil

    from tierspec import costs
    from tierspec.gguf_cache import gguf_cache_dir
    from tierspec.models import default_model_file, load_model

    converted = gguf_cache_dir(default_model_file())
    load_model("smollm2-135m")  # converts into the session's cache once
    cache = tmp_path / "cache"
    cache.mkdir()
    shutil.copytree(converted, cache / converted.name, copy_function=os.link)
    monkeypatch.setenv("TIERSPEC_CACHE", str(cache))
    monkeypatch.setattr(costs, "measure_forward_costs", lambda model, max_tokens, *a, **k: costs.ForwardCosts(
        {n: 0.01 * n for n in range(1, max_tokens + 1)}))
    monkeypatch.setattr(costs, "spot_check", lambda *a, **k: 0.01)
    monkeypatch.setattr(costs, "_MEASURED", {})
    from tierspec import cli

    with read_only(cache):
        assert cli.main(["generate", "hi", "--method", "pld", "--max-new-tokens", "2"]) == 0
        table = costs.forward_costs(tiny_target, max_tokens=4)
        assert table.seconds == {1: 0.01, 2: 0.02, 3: 0.03, 4: 0.04}
        assert "cannot keep it in" in capsys.readouterr().err
        assert sorted(p.name for p in cache.iterdir()) == [converted.name]


def test_an_unreadable_cache_is_a_one_line_error(tmp_path, monkeypatch, capsys):
    import os

    from tierspec import cli

    if os.geteuid() == 0:
        pytest.skip("root reads any folder")
    cache = tmp_path / "cache"
    cache.mkdir(mode=0o000)
    monkeypatch.setenv("TIERSPEC_CACHE", str(cache / "inner"))
    try:
        assert cli.main(["generate", "hi", "--method", "pld", "--max-new-tokens", "2"]) == 2
    finally:
        cache.chmod(0o755)
    err = capsys.readouterr().err
    assert err.startswith("tierspec: error: cannot load model 'smollm2-135m': ") and err.count("\n") == 1


@pytest.mark.parametrize("command", [["generate", "hi"], ["bench", "--out", "never-written"],
                                     ["route", "--out", "never-written.json"],
                                     ["drafter", "train", "--data", "d", "--out", "never-written"]])
@pytest.mark.parametrize("seed, shown", [(2**63, "9223372036854775808"), (2**64, "18446744073709551616"), (-1, "-1")])
def test_a_seed_outside_int64_is_a_one_line_error(command, seed, shown, monkeypatch, capsys, tmp_path):
    from tierspec import cli
    from tierspec.models import wrap_model

    from conftest import char_tokenizer

    monkeypatch.chdir(tmp_path)
    target = wrap_model(tiny_llama(seed=3, vocab_size=56).model, char_tokenizer(), name="tiny-char")
    monkeypatch.setattr("tierspec.models.load_model", lambda *a, **k: target)
    monkeypatch.setattr("tierspec.bench.runner.load_model", lambda *a, **k: target)
    assert cli.main([*command, "--seed", str(seed)]) == 2
    assert capsys.readouterr().err == (f"tierspec: error: --seed must be an integer from 0 to 2**63 - 1 "
                                       f"(9223372036854775807), got {shown}\n")
    assert list(tmp_path.iterdir()) == []


def _write_draft_head(path: Path) -> None:
    from tierspec.heads.draft import DraftHead

    target = tiny_llama(seed=5, dtype=torch.float32)
    DraftHead.for_target(target, torch.arange(8)).save(path)


def _write_judge_head(path: Path) -> None:
    from tierspec.heads.judge import JudgeHead

    JudgeHead(torch.ones(4), 0.0, torch.zeros(4), torch.ones(4), "hidden", 0.5).save(path)


def _write_data_shard(path: Path) -> None:
    from tierspec.training.draft_data import _shard_bytes, _write_shard

    sequence = {"tokens": torch.arange(5), "final": torch.zeros(5, 4), "aux": {}, "response_start": 2}
    _write_shard(path, _shard_bytes([sequence], ["test"], "own-greedy")[0])


def _write_training_checkpoint(path: Path) -> None:
    from tierspec.training.draft_train import _save_checkpoint

    _save_checkpoint(path, {"step": 1})


@pytest.mark.parametrize("write", [_write_draft_head, _write_judge_head, _write_data_shard, _write_training_checkpoint])
def test_heads_shards_and_checkpoints_get_the_permissions_of_an_ordinary_write(write, tmp_path):
    """safetensors creates its files 0o600 and a staging file made by mkstemp is 0o600: a head
    or shard in a shared folder was unreadable to everyone else (issue 23, finding 12)."""
    import os
    import stat

    (tmp_path / "plain.txt").write_text("x")
    write(tmp_path / "written.safetensors")
    mode = lambda name: stat.S_IMODE(os.stat(tmp_path / name).st_mode)  # noqa: E731
    assert mode("written.safetensors") == mode("plain.txt")
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []  # no staging file left


@pytest.mark.parametrize("argv, message", [
    (["route", "--out", "m.json", "--context", "0"], "--context must be at least 1, got 0"),  # was a traceback
    (["route", "--out", "m.json", "--patience", "0"], "--patience must be at least 1"),  # "min() arg is an empty sequence"
    (["route", "--out", "m.json", "--strategy", "random", "--bo-every", "3"], "--bo-every (--strategy random"),
    (["route", "--out", "m.json", "--objective", "agreement", "--alpha", "0.1"], "--alpha / --beta"),
    (["route", "--out", "m.json", "--calibration-file", "p.txt", "--data-dir", "d"], "--data-dir (--calibration-file"),
    (["route", "--out", "."], "--out . is a folder"),  # was said after the whole search
    (["judge", "build-data", "--out", "j.jsonl", "--count", "0"], "--count must be at least 1"),  # an empty file, exit 0
    (["judge", "build-data", "--out", "j.jsonl", "--val-fraction", "1.5"], "--val-fraction must be between 0 and 1"),
    (["judge", "train", "--data", "j.jsonl", "--out", "h.safetensors", "--max-mistake-acceptance", "-0.5"],
     "--max-mistake-acceptance is a share of mistakes"),  # indexed from the list's end: 75% of mistakes accepted
    (["judge", "train", "--data", "j.jsonl", "--out", "."], "--out . is a folder"),
    (["judge", "build-mismatch-data", "--out", "m.jsonl", "--per-prompt", "0"], "--per-prompt must be at least 1"),
    (["drafter", "train", "--data", "d", "--out", "."], "--out . is a folder"),
    (["generate", "hi", "--top-k", "5"], "at --temperature 0 (greedy) they would change nothing"),
    (["bench", "--out", "b", "--top-p", "0.5"], "at --temperature 0 (greedy) they would change nothing"),
])
def test_a_jobs_bad_flags_are_refused_before_any_work(argv, message, capsys, monkeypatch):
    from tierspec.cli import main

    monkeypatch.setattr("tierspec.models.load_model", lambda *a, **k: pytest.fail("loaded a model before refusing"))
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_a_second_mask_search_into_one_file_is_refused_at_once(tmp_path, capsys, monkeypatch):
    """Its progress file is the mask's + .partial.json: two searches would write it in turn."""
    from tierspec.cli import main
    from tierspec.util import exclusive_lock

    out = tmp_path / "mask.json"
    monkeypatch.setattr("tierspec.models.load_model", lambda *a, **k: pytest.fail("loaded a model before refusing"))
    with exclusive_lock(out.with_name(f".{out.name}.route.lock"), "the mask file", "tierspec route"):
        assert main(["route", "--out", str(out)]) == 2
    assert "is in use by another tierspec route run" in capsys.readouterr().err


@pytest.mark.parametrize("stop, message", [(KeyboardInterrupt, "tierspec: interrupted"),
                                           (lambda: PromptError("the disk went away"), "tierspec: error: the disk went away")])
def test_a_job_stopped_mid_bar_says_so_on_a_line_of_its_own(monkeypatch, capsys, stop, message):
    """The message was printed on the progress bar's line, after the bar."""
    from tqdm.auto import tqdm

    from tierspec import cli

    def job(args):  # a bar updated by hand, as the mask search's (one iterated closes itself)
        bar = tqdm(total=4, desc="a job")
        for step in range(4):
            if step == 2:
                raise stop()
            bar.update(1)
        return 0

    monkeypatch.setattr(cli, "_run_judge_build", job)
    assert cli.main(["judge", "build-data", "--out", "x.jsonl"]) in (2, 130)
    err = capsys.readouterr().err
    assert "a job" in err and f"\n{message}" in err
