"""The faults issue 33's probe found, each reproduced (the server's own are in
tests/faces/test_server_clients.py): a second signal during teardown, a cache folder without its
marker, a closed stdout pipe, full disks, arguments checked only after loading, float16 on a CPU,
progress bars in logs, multi-line errors, and two drafter jobs in one folder."""

import errno
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import char_tokenizer, tiny_llama
from gguf_models import write_tiny_gguf

from tierspec import cli
from tierspec.errors import ModelLoadError, TierspecError
from tierspec.util import WriteError, atomic_write_text, exclusive_lock

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(ROOT)}


# ---- the command line ------------------------------------------------------------------------------


@pytest.mark.real_model
def test_a_closed_stdout_pipe_ends_quietly():
    """`tierspec generate … | head -c 10` printed a BrokenPipeError traceback and exited 1."""
    process = subprocess.Popen([sys.executable, "-m", "tierspec.cli", "generate", "Count from one to fifty.",
                                "--method", "ar", "--max-new-tokens", "200"], env=ENV, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE)
    process.stdout.read(10)
    process.stdout.close()  # the reader goes away while the text still streams
    err = process.stderr.read().decode()
    assert process.wait(timeout=300) in (0, 141)
    assert "Traceback" not in err and "BrokenPipe" not in err, err


@pytest.fixture
def no_loading(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded before the arguments were checked")

    monkeypatch.setattr("tierspec.models.load_model", refuse)


@pytest.fixture(scope="module")
def small_folder(tmp_path_factory):
    """An HF folder whose config says 512 positions."""
    folder = tmp_path_factory.mktemp("ctx") / "m"
    tiny_llama(seed=3).model.save_pretrained(folder)
    return folder


@pytest.mark.parametrize("flags, message", [
    (["   "], "the prompt is empty"),
    (["hi", "--max-new-tokens", "0"], "--max-new-tokens must be >= 1, got 0"),
    (["hi", "--max-new-tokens", "-1"], "--max-new-tokens must be >= 1, got -1"),
    (["hi", "--max-new-tokens", "100000", "--target", "{folder}"], "does not fit the model's context of 512"),
    (["hi", "--dtype", "float16"], "float16 on a CPU runs on torch's slow generic kernels"),
])
def test_generate_checks_its_arguments_before_loading_anything(flags, message, no_loading, small_folder, capsys):
    """They were refused only after loading the model and measuring its cost table (10-56 s)."""
    flags = [flag.replace("{folder}", str(small_folder)) for flag in flags]
    assert cli.main(["generate", *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith("tierspec: error: ") and message in err and err.count("\n") == 1, err


def test_serve_refuses_float16_on_a_cpu_before_loading(no_loading, capsys):
    assert cli.main(["serve", "--dtype", "float16", "--port", "1"]) == 2
    assert "float16 on a CPU" in capsys.readouterr().err


def test_a_user_error_with_several_lines_prints_as_one(monkeypatch, capsys):
    def failing(args):
        raise TierspecError("draft head h.safetensors does not hold the expected weights: Error(s):\n\tMissing key(s)")

    monkeypatch.setattr(cli, "_run_generate", failing)
    parser_run = cli.build_parser
    monkeypatch.setattr(cli, "build_parser", lambda: _with_run(parser_run(), failing))
    assert cli.main(["generate", "hi"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "weights: Error(s): Missing key(s)" in err


def _with_run(parser, run):
    parser.set_defaults(run=run)
    for action in parser._subparsers._group_actions:
        for sub in action.choices.values():
            sub.set_defaults(run=run)
    return parser


def test_a_damaged_head_is_a_one_line_error(tmp_path):
    """A head file missing a weight: torch's message spans lines; the error must not."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from tierspec.heads.draft import DraftHead, DraftHeadError

    target = tiny_llama(seed=4, dtype=torch.float32)
    head = DraftHead.for_target(target, torch.arange(0, 64, 2), seed=1)
    path = tmp_path / "head.safetensors"
    head.save(path)
    with safe_open(str(path), "pt") as handle:
        metadata = handle.metadata()
        tensors = {key: handle.get_tensor(key) for key in handle.keys()}
    dropped = next(key for key in tensors if key != "draft_ids")
    del tensors[dropped]
    save_file(tensors, str(path), metadata=metadata)
    with pytest.raises(DraftHeadError) as caught:
        DraftHead.load(path, target)
    assert "\n" not in str(caught.value) and "does not hold the expected weights" in str(caught.value)


@pytest.mark.parametrize("planted", [[1, 2, 10 ** 6], [-1, 2, 3], [4, 4, 5], [1, 2]])
def test_a_vocabulary_map_outside_the_targets_vocabulary_is_refused_at_load(planted, tmp_path):
    """Ids past the vocabulary (or negative, repeated, too few) with the checksum recomputed to
    match: an IndexError from the engine at the first draft, now the head's one-line error."""
    import hashlib
    import json

    from safetensors import safe_open
    from safetensors.torch import save_file

    from tierspec.heads.draft import DraftHead, DraftHeadError

    target = tiny_llama(seed=4, dtype=torch.float32)
    path = tmp_path / "head.safetensors"
    DraftHead.for_target(target, torch.arange(0, 6, 2), seed=1).save(path)
    with safe_open(str(path), "pt") as handle:
        metadata = handle.metadata()
        tensors = {key: handle.get_tensor(key) for key in handle.keys()}
    tensors["draft_ids"] = torch.tensor(planted, dtype=torch.long)
    info = json.loads(metadata["info"])
    info["draft_vocab_sha256"] = hashlib.sha256(tensors["draft_ids"].numpy().tobytes()).hexdigest()
    save_file(tensors, str(path), metadata={**metadata, "info": json.dumps(info)})
    with pytest.raises(DraftHeadError, match="its vocabulary map is not 3 distinct token ids"):
        DraftHead.load(path, target)


def test_an_os_error_no_writer_named_is_one_line(monkeypatch, capsys):
    def full(args):
        raise OSError(errno.ENOSPC, "No space left on device", "results/x/records.jsonl")

    parser_run = cli.build_parser
    monkeypatch.setattr(cli, "build_parser", lambda: _with_run(parser_run(), full))
    assert cli.main(["generate", "hi"]) == 2
    assert capsys.readouterr().err == "tierspec: error: No space left on device (results/x/records.jsonl)\n"


# ---- full disks --------------------------------------------------------------------------------------


def test_a_full_disk_during_an_atomic_write_names_the_file_and_leaves_nothing(tmp_path):
    def full(staging):
        raise OSError(errno.ENOSPC, "No space left on device")

    from tierspec.util import atomic_write

    with pytest.raises(WriteError, match=f"cannot write {tmp_path / 'summary.json'}: No space left on device"):
        atomic_write(tmp_path / "summary.json", full)
    assert list(tmp_path.iterdir()) == []


def test_a_full_disk_while_writing_bench_records_is_one_line(tmp_path, monkeypatch):
    """A full /dev/full stands for the disk: every write to it fails with ENOSPC."""
    if not Path("/dev/full").exists():
        pytest.skip("needs /dev/full")
    from tierspec.util import write_error

    with pytest.raises(OSError) as caught:
        with open("/dev/full", "a") as sink:
            sink.write("x" * 10)
    error = write_error(Path("results/x/records.jsonl"), caught.value)
    assert str(error) == "cannot write results/x/records.jsonl: No space left on device"


# ---- the model cache ---------------------------------------------------------------------------------


@pytest.fixture
def fake_gguf(tmp_path, monkeypatch):
    """A 'GGUF file' whose reading transformers is faked with a tiny model (and a tqdm bar, as the
    real reader draws one per tensor group), in a private cache."""
    import transformers
    from tqdm.auto import tqdm

    monkeypatch.setenv("TIERSPEC_CACHE", str(tmp_path / "cache"))
    gguf = tmp_path / "tiny.gguf"
    gguf.write_bytes(write_tiny_gguf(tmp_path / "written").gguf.read_bytes())  # a sound file: checked before converting
    model = tiny_llama(seed=5, dtype=torch.float32).model
    tokenizer = char_tokenizer()

    def read_model(*args, **kwargs):
        for _ in tqdm(range(30), desc="Converting and de-quantizing GGUF tensors..."):
            pass
        return model

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", read_model)
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda *a, **k: tokenizer)
    return gguf


def test_a_cache_folder_without_its_marker_is_rebuilt(fake_gguf, capsys):
    """It never healed: every run converted again and then failed with 'Directory not empty'."""
    from tierspec.gguf_cache import CONVERTED_MARKER, converted_copy, converted_copy_problem, gguf_cache_dir

    folder = gguf_cache_dir(fake_gguf)
    folder.mkdir(parents=True)
    (folder / "model.safetensors").write_bytes(b"half a file")  # left without a marker
    assert converted_copy(fake_gguf) == folder
    assert (folder / CONVERTED_MARKER).exists() and converted_copy_problem(folder) is None
    assert "no conversion marker" in capsys.readouterr().err


def test_conversion_draws_no_progress_bars_into_a_log(fake_gguf, capsys):
    from tierspec.gguf_cache import converted_copy

    converted_copy(fake_gguf)
    err = capsys.readouterr().err
    assert "%|" not in err and "it/s" not in err and err.count("\n") == 1, err
    assert "converting the GGUF file once" in err


def test_a_full_disk_during_conversion_is_one_line_and_leaves_nothing(fake_gguf, monkeypatch):
    import safetensors.torch

    from tierspec.gguf_cache import converted_copy, gguf_cache_dir

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(safetensors.torch, "save_file", full)
    with pytest.raises(ModelLoadError) as caught:
        converted_copy(fake_gguf)
    message = str(caught.value)
    assert "\n" not in message and "No space left on device" in message
    assert str(gguf_cache_dir(fake_gguf).parent) in message
    assert list(gguf_cache_dir(fake_gguf).parent.iterdir()) == []  # no staging folder left


# ---- one run per folder ------------------------------------------------------------------------------


@pytest.mark.parametrize("command, lock", [
    (["drafter", "build-data", "--out", "{out}"], "{out}/.build-data.lock"),
    (["drafter", "train", "--data", "{out}", "--out", "{out}/head.safetensors"], "{out}/.head.safetensors.train.lock"),
    (["judge", "build-mismatch-data", "--out", "{out}/m.jsonl"], "{out}/.m.jsonl.build-mismatch-data.lock"),
    (["judge", "train", "--data", "{out}/j.jsonl", "--out", "{out}/h.safetensors"], "{out}/.h.safetensors.train.lock"),
])
def test_a_second_training_job_into_the_same_place_is_refused_with_the_first_pid(command, lock, tmp_path, no_loading,
                                                                               capsys):
    out = tmp_path / "data"
    command = [part.replace("{out}", str(out)) for part in command]
    with exclusive_lock(Path(lock.replace("{out}", str(out))), "held", "a test"):
        assert cli.main(command) == 2
    err = capsys.readouterr().err
    assert f"is in use by another tierspec {command[0]} {command[1]}" in err and f"(pid {os.getpid()})" in err
    assert err.count("\n") == 1


# ---- serve: a second signal during teardown -----------------------------------------------------------


@pytest.mark.real_model
def test_a_second_sigterm_during_teardown_still_exits_0():
    """A second SIGTERM 0.3-0.6 s after the first exited 143: uvicorn had restored the default
    handler for the teardown. Here signals keep coming every 50 ms until the server exits."""
    import json
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    process = subprocess.Popen([sys.executable, "-m", "tierspec.cli", "serve", "--port", str(port), "--method", "ar",
                                "--log-level", "warning"], env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        import http.client

        deadline = time.monotonic() + 180
        while True:
            assert process.poll() is None, process.stderr.read().decode()
            try:
                connection = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
                connection.request("GET", "/health")
                if connection.getresponse().status == 200:
                    break
            except OSError:
                pass
            assert time.monotonic() < deadline
            time.sleep(0.1)
        stream = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        stream.request("POST", "/v1/completions", json.dumps({"prompt": "1, 2, 3,", "max_tokens": 2000, "stream": True,
                                                               "temperature": 0}), {"Content-Type": "application/json"})
        response = stream.getresponse()
        response.readline()
        while process.poll() is None:
            process.send_signal(signal.SIGTERM)
            time.sleep(0.05)
        assert process.wait(timeout=60) == 0, process.stderr.read().decode()
        assert "Traceback" not in process.stderr.read().decode()
    finally:
        if process.poll() is None:
            process.kill()
