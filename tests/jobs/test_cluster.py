"""Runs on a Ray cluster (issue 32): `tierspec bench --ray` and `tierspec drafter build-data --ray`
on a local cluster bound to the loopback address (two workers of one CPU each, tiny random models
saved to a folder the workers load by path), against the single-process runs of the same work;
a worker killed mid-run, a driver killed and rerun, a prompt that fails on every try. The summary's
grouping per machine is checked on planted records, without Ray."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import pytest
import torch
from conftest import char_tokenizer, tiny_llama, write_spec_bench

from tierspec.bench.runner import BenchConfig, BenchError, read_records, run_bench
from tierspec.cluster import LOCAL, ClusterConfig, ClusterError

REPO = Path(__file__).resolve().parent.parent
METHODS = ("ar", "pld", "sd", "hf-greedy")
CATEGORIES = ("mt_bench", "translation", "summarization", "qa", "math_reasoning", "rag")  # Spec-Bench's
TIME_LIMIT_S = 240  # per test: a hung cluster fails the test instead of the suite


@pytest.fixture(autouse=True)
def _bounded_in_time():
    def expired(signum, frame):
        raise TimeoutError(f"a Ray test ran past {TIME_LIMIT_S} s")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.alarm(TIME_LIMIT_S)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


@pytest.fixture(scope="module")
def ray_cluster():
    """A local Ray cluster of 2 CPUs on 127.0.0.1 for the module; its workers import this
    checkout's tierspec (and these tests) and inherit the test cache folder."""
    from tierspec.cluster import _import_ray

    ray = _import_ray(loopback=True)  # before Ray's first import: its single-machine (loopback) mode
    path = os.pathsep.join([str(REPO), str(REPO / "tests"), os.environ.get("PYTHONPATH", "")])
    ray.init(address=LOCAL, num_cpus=2, include_dashboard=False, runtime_env={"env_vars": {"PYTHONPATH": path}})
    yield ray
    ray.shutdown()


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """A tiny character-level target and drafter, saved where every worker finds them by path."""
    root = tmp_path_factory.mktemp("models")
    for name, seed, layers in (("target", 4, 3), ("drafter", 5, 2)):
        model = tiny_llama(seed=seed, vocab_size=56, layers=layers, sharpness=20.0, dtype=torch.float32).model
        model.generation_config.eos_token_id = None
        model.save_pretrained(root / name)
        char_tokenizer().save_pretrained(root / name)
    return root


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    """12 prompts, 2 in each of 6 categories (repetitive: prompt lookup finds matches)."""
    texts = {c: [f"{c} question {i}: say {c} {c} {c} again and again." for i in range(2)] for c in CATEGORIES}
    return write_spec_bench(tmp_path_factory.mktemp("data"), texts)


def bench_config(models: Path, data_dir: Path, **changes) -> BenchConfig:
    settings = dict(target=str(models / "target"), drafter=str(models / "drafter"), methods=METHODS,
                    dataset="spec_bench", per_category=2, max_new_tokens=24, data_dir=str(data_dir))
    return BenchConfig(**{**settings, **changes})


def two_workers(**changes) -> ClusterConfig:
    return ClusterConfig(LOCAL, **{"workers": 2, **changes})


@pytest.fixture(scope="module")
def single_process(models, data_dir, tmp_path_factory):
    """The single-process run of the same work: its records by (method, prompt) and its summary."""
    out = tmp_path_factory.mktemp("single") / "out"
    summary = run_bench(bench_config(models, data_dir), out, progress=False)
    records = read_records(out / "records.jsonl")
    assert len(records) == 12 * len(METHODS)
    return {(r["method"], r["prompt_id"]): r for r in records}, summary


def tokens(records: list[dict]) -> dict:
    return {(r["method"], r["prompt_id"]): r["token_ids"] for r in records}


def assert_each_record_once(records: list[dict], expected: dict) -> None:
    counts = Counter((r["method"], r["prompt_id"]) for r in records)
    assert set(counts) == set(expected) and set(counts.values()) == {1}, [k for k, n in counts.items() if n != 1]


def test_two_workers_make_the_single_process_runs_records(ray_cluster, models, data_dir, single_process, tmp_path):
    """The target: a greedy bench over 12 prompts on 2 workers gives the tokens of the
    single-process run, each record once, every prompt's methods from one worker (ratios within
    one worker), and a summary with the same methods and categories."""
    expected, single_summary = single_process
    out = tmp_path / "ray"
    summary = run_bench(bench_config(models, data_dir), out, progress=False, cluster=two_workers())
    records = read_records(out / "records.jsonl")
    assert_each_record_once(records, expected)
    assert tokens(records) == {key: r["token_ids"] for key, r in expected.items()}
    by_prompt: dict[str, set] = {}
    for r in records:
        by_prompt.setdefault(r["prompt_id"], set()).add((r["worker"]["worker"], r["worker"]["pid"]))
    assert all(len(workers) == 1 for workers in by_prompt.values())
    assert {name for workers in by_prompt.values() for name, _ in workers} == {"w0", "w1"}  # both worked
    assert {r["worker"]["threads"] for r in records} == {1}  # one CPU each, one thread
    assert list(summary["methods"]) == list(single_summary["methods"])
    for name, result in summary["methods"].items():
        assert set(result["categories"]) == set(single_summary["methods"][name]["categories"]) == set(CATEGORIES)
        assert result["overall"]["n_prompts"] == 12
    assert set(summary["workers"]) == {"w0", "w1"} and "machines" not in summary  # one machine
    assert "Records per worker: `w0`" in (out / "summary.md").read_text()
    # The folder is an ordinary bench folder: a summary needs no cluster, a rerun finds nothing to do.
    again = run_bench(bench_config(models, data_dir), out, progress=False, generate=False)
    assert again["methods"] == summary["methods"]
    before = (out / "records.jsonl").read_text()
    run_bench(bench_config(models, data_dir), out, progress=False, cluster=two_workers())
    assert (out / "records.jsonl").read_text() == before
    # Other settings are refused before any worker starts, and change nothing.
    with pytest.raises(BenchError, match="temperature: 0.0 → 1.0"):
        run_bench(bench_config(models, data_dir, temperature=1.0), out, progress=False, cluster=two_workers())
    assert (out / "records.jsonl").read_text() == before


def kill_the_first_records_worker(records_path: Path, killed: list[int]) -> None:
    """Waits for the first record, then kills (SIGKILL) the worker that made it: by then the
    driver has given that worker its next prompt."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            first = records_path.read_text().split("\n", 1)
            if len(first) == 2:
                pid = json.loads(first[0])["worker"]["pid"]
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
                return
        except (FileNotFoundError, json.JSONDecodeError):
            pass
        time.sleep(0.005)


def test_a_killed_workers_prompt_is_requeued_and_every_record_made_once(ray_cluster, models, data_dir, single_process,
                                                                        tmp_path, capfd):
    expected, _ = single_process
    out = tmp_path / "ray"
    killed: list[int] = []
    killer = threading.Thread(target=kill_the_first_records_worker, args=(out / "records.jsonl", killed), daemon=True)
    killer.start()
    run_bench(bench_config(models, data_dir), out, progress=False, cluster=two_workers())
    killer.join()
    err = capfd.readouterr().err
    assert killed, "the worker was never killed"
    assert "was lost running prompt" in err and "re-queued (try 2 of 3)" in err, err
    records = read_records(out / "records.jsonl")
    assert_each_record_once(records, expected)
    assert tokens(records) == {key: r["token_ids"] for key, r in expected.items()}
    # The killed process made only the records written before its death; a fresh process (Ray's
    # restart of that worker, or the other worker) made the rest.
    assert len({r["worker"]["pid"] for r in records}) >= 2


def test_a_killed_driver_reruns_into_its_folder_without_duplicates(ray_cluster, models, data_dir, single_process,
                                                                   tmp_path):
    """A driver (the CLI, joined to the running cluster by its address) killed with SIGKILL once
    its first records are written; rerun, it does only what is missing."""
    expected, _ = single_process
    out = tmp_path / "ray"
    address = ray_cluster.get_runtime_context().gcs_address
    command = [sys.executable, "-m", "tierspec.cli", "bench", "--target", str(models / "target"), "--drafter",
               str(models / "drafter"), "--methods", ",".join(METHODS), "--per-category", "2", "--max-new-tokens", "24",
               "--data-dir", str(data_dir), "--out", str(out), "--no-progress", "--ray", address, "--ray-workers", "2"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    log = tmp_path / "driver.log"
    with open(log, "w") as sink:
        driver = subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT, env=env)
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and driver.poll() is None:
            if (out / "records.jsonl").exists() and (out / "records.jsonl").read_text().count("\n") >= 1:
                break
            time.sleep(0.005)
        assert driver.poll() is None, f"the driver ended before it was killed:\n{log.read_text()}"
        driver.send_signal(signal.SIGKILL)
    finally:
        driver.kill()
        driver.wait()
    written = (out / "records.jsonl").read_text()
    kept = written[: written.rfind("\n") + 1]  # a line cut by the kill is redone
    assert 0 < kept.count("\n") < len(expected), "the kill came too late to test a resume"
    run_bench(bench_config(models, data_dir), out, progress=False, cluster=two_workers())
    final = (out / "records.jsonl").read_text()
    assert final.startswith(kept)  # nothing the killed run wrote is rewritten or redone
    records = read_records(out / "records.jsonl")
    assert_each_record_once(records, expected)
    assert tokens(records) == {key: r["token_ids"] for key, r in expected.items()}


def test_a_prompt_that_fails_on_every_try_is_reported_and_the_rest_is_done(ray_cluster, models, tmp_path, capfd):
    """A prompt longer than the tiny model's 512 positions fails wherever it runs: tried twice
    (--ray-tries 2), then listed in failures.json and named in the error, after the report of
    the other prompts is written. A rerun tries it again."""
    texts = {"qa": ["what is one and one?", "x" * 600], "rag": ["say rain, rain, rain."]}
    data = write_spec_bench(tmp_path / "data", texts)
    config = bench_config(models, data, methods=("ar", "pld"), per_category=None, max_new_tokens=8, drafter=None)
    out = tmp_path / "ray"
    with pytest.raises(BenchError, match=r"1 prompt\(s\) failed on every try \(prompt spec_bench/2 \(repeat 0\)\)"):
        run_bench(config, out, progress=False, cluster=two_workers(max_tries=2))
    err = capfd.readouterr().err
    assert "re-queued (try 2 of 2)" in err and "given up after 2 tries" in err
    failures = json.loads((out / "failures.json").read_text())
    assert [(f["unit"], f["tries"]) for f in failures] == [("prompt spec_bench/2 (repeat 0)", 2)]
    assert all("exceeds the model's context of 512 positions" in e for e in failures[0]["errors"])
    records = read_records(out / "records.jsonl")
    assert sorted((r["method"], r["prompt_id"]) for r in records) == sorted(
        (m, p) for m in ("ar", "pld") for p in ("spec_bench/1", "spec_bench/3"))
    summary = json.loads((out / "summary.json").read_text())
    assert summary["methods"]["pld"]["overall"]["n_prompts"] == 2


def test_build_data_on_two_workers_writes_the_single_process_shards(ray_cluster, training_data_dir, tmp_path, capsys):
    """`tierspec drafter build-data --ray`: the shards (greedy and sampled own answers, reference
    answers) hold exactly the single-process run's tensors and metadata (the files' bytes differ:
    safetensors writes metadata keys in no fixed order), written by the driver; both workers made
    some; a rerun finds nothing to do."""
    from tierspec.cli import main

    folder = tmp_path / "tiny"
    tiny_llama(seed=4, vocab_size=56, layers=4, sharpness=20.0, dtype=torch.float32).model.save_pretrained(folder)
    char_tokenizer().save_pretrained(folder)
    build = ["drafter", "build-data", "--target", str(folder), "--own-prompts", "8", "--reference-items", "6",
             "--batch-size", "2", "--max-new-tokens", "12", "--max-prompt-tokens", "120", "--sampled-fraction", "0.5",
             "--data-dir", str(training_data_dir), "--no-progress"]
    assert main([*build, "--out", str(tmp_path / "single")]) == 0, capsys.readouterr().err
    capsys.readouterr()
    assert main([*build, "--out", str(tmp_path / "ray"), "--ray", LOCAL, "--ray-workers", "2"]) == 0
    manifest = json.loads(capsys.readouterr().out)
    shards = sorted(p.name for p in (tmp_path / "single").glob("shard-*.safetensors"))
    planned = json.loads((tmp_path / "single" / "plan.json").read_text())["shards"]
    assert len(shards) == manifest["shards_done"] == manifest["shards_planned"] == planned >= 4
    assert sorted(p.name for p in (tmp_path / "ray").glob("shard-*.safetensors")) == shards
    assert (tmp_path / "ray" / "plan.json").read_text() == (tmp_path / "single" / "plan.json").read_text()
    from safetensors import safe_open

    def contents(path: Path) -> tuple[dict, dict]:
        with safe_open(str(path), "pt") as handle:
            return handle.metadata(), {key: handle.get_tensor(key) for key in handle.keys()}

    made = set()
    for name in shards:
        (metadata, tensors), (ray_metadata, ray_tensors) = (contents(tmp_path / run / name) for run in ("single", "ray"))
        assert ray_metadata == metadata and ray_tensors.keys() == tensors.keys(), name
        assert all(torch.equal(ray_tensors[key], tensors[key]) for key in tensors), name
        made.add(metadata["kind"])
    assert made == {"own-greedy", "own-sampled", "reference"}
    assert set(manifest["workers_this_run"]) == {"w0", "w1"}
    assert sum(w["shards"] for w in manifest["workers_this_run"].values()) == len(shards)
    assert main([*build, "--out", str(tmp_path / "ray"), "--ray", LOCAL, "--ray-workers", "2"]) == 0
    assert "workers_this_run" not in json.loads(capsys.readouterr().out)  # nothing left: no shard made


# ---- without Ray: the summary per machine, the flags ----------------------------------------------

def planted(method: str, prompt: str, tokens_per_s: float, cpu: str, worker: str) -> dict:
    return {"method": method, "prompt_id": prompt, "category": "qa", "repeat": 0, "emitted": 10,
            "seconds": 10 / tokens_per_s, "tokens_per_s": tokens_per_s, "peak_rss_mb": 1.0, "token_ids": [1] * 10, "text": "a",
            "worker": {"worker": worker, "host": f"host-{worker}", "pid": 1, "cpu": cpu, "threads": 1, "device": "cpu"}}


def test_the_summary_groups_records_per_machine_where_machines_differ():
    """Two machines, each `ar` and `pld` on its own prompt: on the slow one pld doubles ar's
    speed (10 → 20 tok/s), on the fast one it matches it (40 → 40). Per machine the speed-ups
    are 2.0 and 1.0, each against its own `ar`; overall (60 / 50) they would hide both."""
    from tierspec.bench.report import markdown_table, summarize

    records = [planted("ar", "p1", 10.0, "Slow CPU", "w0"), planted("pld", "p1", 20.0, "Slow CPU", "w0"),
               planted("ar", "p2", 40.0, "Fast CPU", "w1"), planted("pld", "p2", 40.0, "Fast CPU", "w1")]
    summary = summarize(records, BenchConfig(methods=("ar", "pld"), compute_nll=False), {})
    assert summary["methods"]["pld"]["overall"]["speedup"] == pytest.approx(30.0 / 25.0)
    machines = summary["machines"]
    assert set(machines) == {"Slow CPU, 1 thread, cpu", "Fast CPU, 1 thread, cpu"}
    assert machines["Slow CPU, 1 thread, cpu"]["methods"]["pld"]["speedup"] == pytest.approx(2.0)
    assert machines["Fast CPU, 1 thread, cpu"]["methods"]["pld"]["speedup"] == pytest.approx(1.0)
    assert machines["Fast CPU, 1 thread, cpu"]["workers"] == ["w1"]
    assert summary["workers"]["w0"] == {"machine": "Slow CPU, 1 thread, cpu", "hosts": ["host-w0"], "records": 2}
    table = markdown_table(summary)
    assert "| `pld` | 2.00× (20.0, 1) | 1.00× (40.0, 1) |" in table
    # One machine (two workers on it): no per-machine table.
    same = [dict(r, worker={**r["worker"], "cpu": "Slow CPU"}) for r in records]
    assert "machines" not in summarize(same, BenchConfig(methods=("ar", "pld"), compute_nll=False), {})


@pytest.mark.parametrize("flags, message", [
    (["--ray-workers", "2"], "--ray-workers without --ray: add --ray local (or auto, or the cluster's address)"),
    (["--ray", "local", "--ray-gpus", "1"],
     "--ray-gpus 1 reserves GPUs for workers that run on --device cpu; pass --device cuda"),
    (["--ray", "local", "--device", "cuda"], "--device cuda on Ray needs --ray-gpus (1 per worker)"),
    (["--ray", "local", "--ray-workers", "0"], "workers must be an integer >= 1, got 0"),
    (["--ray", "local", "--ray-tries", "0"], "max_tries must be an integer >= 1, got 0"),
])
def test_bad_ray_flags_are_one_line_errors(flags, message, tmp_path, capsys):
    from tierspec import cli

    out = tmp_path / "out"
    assert cli.main(["bench", "--out", str(out), "--methods", "ar", "--no-progress", *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"tierspec: error: {message}") and err.count("\n") == 1, err
    assert not out.exists()


def test_workers_that_settle_auto_differently_are_refused():
    """A bfloat16 CPU beside one without: under --dtype auto their records would measure two
    dtypes under one name."""
    from tierspec.bench.runner import WorkerSettings, agreed_settings

    machine = lambda name: {"worker": name, "host": f"host-{name}"}  # noqa: E731
    same = [WorkerSettings("bfloat16", "tierspec", False, machine(name)) for name in ("w0", "w1")]
    assert agreed_settings(same) == same[0]
    mixed = [same[0], WorkerSettings("float32", "tierspec", False, machine("w1"))]
    with pytest.raises(BenchError, match=r"settled dtype differently \(w0 on host-w0: bfloat16, w1 on host-w1: "
                                         r"float32\); pass --dtype and --implementation explicitly"):
        agreed_settings(mixed)


@pytest.mark.parametrize("address, loopback", [("local", True), ("127.0.0.1:6379", True), ("localhost:6379", True),
                                               ("ray://127.0.0.1:10001", True), ("auto", False),
                                               ("10.0.0.5:6379", False), ("ray://head:10001", False)])
def test_which_addresses_are_on_the_loopback(address, loopback):
    from tierspec.cluster import _on_loopback

    assert _on_loopback(address) is loopback


def test_ray_missing_is_a_clear_error(monkeypatch):
    from tierspec.cluster import connected

    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` fails as where it is not installed
    with pytest.raises(ClusterError, match=r"--ray needs Ray: pip install 'tierspec\[ray\]'"):
        with connected(ClusterConfig(LOCAL)):
            pass
