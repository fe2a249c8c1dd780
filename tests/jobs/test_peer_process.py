"""llama.cpp and OpenVINO peers in worker processes of their own (issue 40, item 3): a planted
peer that dies with a signal (SIGILL as an AMX llama.cpp build did, SIGSEGV while loading) becomes
that peer's error records naming the signal; the rest of the run goes on and is summarised."""

import json
import os
import signal

import pytest
import torch
from conftest import char_tokenizer, tiny_llama, write_spec_bench

from tierspec.bench import runner
from tierspec.bench.peer_process import PeerFailed, PeerProcess, PeerSpec, death_reason, prompt_seed
from tierspec.bench.runner import BenchConfig, run_bench
from tierspec.errors import TierspecError
from tierspec.models import wrap_model


def spec(factory: str, name: str = "llamacpp-greedy", temperature: float = 0.0) -> PeerSpec:
    return PeerSpec(f"fake_peers:{factory}", name, {}, "tiny", 56, (0,), temperature, 0, 1.0, 1)


@pytest.fixture
def data_dir(tmp_path):
    return write_spec_bench(tmp_path / "data", {"qa": ["What is the capital of France?", "Name a colour."],
                                                "rewrite": ["Copy: apple, banana, cherry."]})


def test_a_peer_runs_in_its_own_process_and_its_clock_is_its_own():
    peer = PeerProcess(spec("EchoPeer"), "cpu", run_seed=7)
    try:
        outcome = peer.run(torch.tensor([5, 6, 7, 8]), 3, torch.Generator().manual_seed(0))
    finally:
        peer.close()
    assert outcome.token_ids == [5, 6, 7] and outcome.record_fields["pid"] != os.getpid()
    assert 0.01 <= outcome.seconds < 0.5 and outcome.record_fields["threads"] == 1
    assert 0 <= outcome.record_fields["worker_round_trip_seconds"] < 0.5
    assert outcome.record_fields["peak_rss_mb"] > 0 and outcome.record_fields["seed"] is None  # greedy: no seed
    assert not peer.process.is_alive()


def test_sampling_seeds_are_drawn_in_the_bench_as_before():
    assert prompt_seed(0.0, 3, torch.Generator().manual_seed(1)) is None
    assert prompt_seed(1.0, 3, None) == 3
    drawn = prompt_seed(1.0, 3, torch.Generator().manual_seed(1))
    assert drawn == int(torch.randint(0, 2**31 - 1, (1,), generator=torch.Generator().manual_seed(1)))
    peer = PeerProcess(spec("EchoPeer", temperature=1.0), "cpu", run_seed=3)
    try:
        assert peer.run(torch.tensor([1, 2]), 2, torch.Generator().manual_seed(1)).record_fields["seed"] == drawn
    finally:
        peer.close()


def test_a_worker_killed_by_sigill_names_the_signal_and_the_mend():
    peer = PeerProcess(spec("IllegalInstructionPeer"), "cpu", run_seed=0)
    with pytest.raises(PeerFailed) as first:
        peer.run(torch.tensor([1, 2, 3]), 4, None)
    assert str(first.value).startswith("llamacpp-greedy's worker process died with SIGILL (Illegal instruction) "
                                       "while generating: the library executed an instruction this CPU")
    assert "-mno-amx-tile" in str(first.value) and "\n" not in str(first.value)
    with pytest.raises(PeerFailed, match="^not run: llamacpp-greedy's worker process died with SIGILL"):
        peer.run(torch.tensor([1, 2, 3]), 4, None)


def test_a_worker_dying_while_it_loads_fails_its_runs_not_the_start():
    peer = PeerProcess(spec("SegfaultAtLoadPeer", name="ov-greedy"), "cpu", run_seed=0)
    with pytest.raises(PeerFailed, match=r"^not run: ov-greedy's worker process died with SIGSEGV \(Segmentation "
                                         r"fault\) while loading its model$"):
        peer.run(torch.tensor([1]), 1, None)


def test_a_setting_the_peer_refuses_stops_the_run_at_once():
    with pytest.raises(TierspecError, match="^ov-greedy: a setting to fix$"):
        PeerProcess(spec("BadSettingPeer", name="ov-greedy"), "cpu", run_seed=0)


def test_a_python_error_in_a_peer_fails_that_generation_only():
    peer = PeerProcess(spec("RaisingPeer"), "cpu", run_seed=0)
    try:
        with pytest.raises(PeerFailed, match="^llamacpp-greedy: RuntimeError: llama_decode returned -1$"):
            peer.run(torch.arange(10), 4, None)
        assert peer.run(torch.arange(3), 4, None).token_ids == [0, 1, 2]  # the worker goes on
    finally:
        peer.close()


def test_death_reasons():
    assert death_reason("p", -signal.SIGKILL, "generating") == "p's worker process died with SIGKILL (Killed) while generating"
    assert death_reason("p", 3, "generating") == "p's worker process ended (exit status 3) while generating"
    assert death_reason("ov-greedy", -signal.SIGILL, "generating") == \
        "ov-greedy's worker process died with SIGILL (Illegal instruction) while generating"  # no llama.cpp mend


def test_a_bench_with_crashing_peers_completes_and_says_why(tmp_path, data_dir, monkeypatch, capsys):
    """`tierspec bench --methods ar,llamacpp-greedy,ov-greedy` with llama.cpp dying of SIGILL on every
    generation and OpenVINO of SIGSEGV while loading: `ar`'s records are all made, each peer's
    records say why it has none, the summary lists both, and a rerun tries the peers again."""
    monkeypatch.setitem(runner.PEER_FACTORIES, "llamacpp-greedy", "fake_peers:IllegalInstructionPeer")
    monkeypatch.setitem(runner.PEER_FACTORIES, "ov-greedy", "fake_peers:SegfaultAtLoadPeer")
    target = wrap_model(tiny_llama(4, vocab_size=56).model, char_tokenizer(), name="tiny-char")
    config = BenchConfig(target="tiny", methods=("ar", "llamacpp-greedy", "ov-greedy"), per_category=2,
                         max_new_tokens=6, data_dir=str(data_dir), compute_nll=False)
    summary = run_bench(config, tmp_path / "out", progress=False, target=target)
    records = [json.loads(line) for line in (tmp_path / "out" / "records.jsonl").read_text().splitlines()]
    made = [r for r in records if "error" not in r]
    assert sorted(r["prompt_id"] for r in made) == sorted(r["prompt_id"] for r in records if r["method"] == "ar")
    assert {r["method"] for r in made} == {"ar"} and len(made) == 3
    errors = {r["method"]: r["error"] for r in records if "error" in r}
    assert errors["llamacpp-greedy"].startswith("not run: llamacpp-greedy's worker process died with SIGILL")
    assert errors["ov-greedy"] == "not run: ov-greedy's worker process died with SIGSEGV (Segmentation fault) while " \
                                  "loading its model"
    assert summary["failures"]["llamacpp-greedy"]["prompts"] == 3 and summary["failures"]["ov-greedy"]["prompts"] == 3
    assert "llamacpp-greedy" not in summary["methods"] and summary["methods"]["ar"]["overall"]["n_prompts"] == 3
    table = (tmp_path / "out" / "summary.md").read_text()
    assert "**`llamacpp-greedy` failed on 3 prompt(s)**" in table and "SIGSEGV" in table
    assert "llamacpp-greedy failed on 3 prompt(s)" in capsys.readouterr().err
    # a rerun (the peers mended) makes the missing records and supersedes the errors
    monkeypatch.setitem(runner.PEER_FACTORIES, "llamacpp-greedy", "fake_peers:EchoPeer")
    monkeypatch.setitem(runner.PEER_FACTORIES, "ov-greedy", "fake_peers:EchoPeer")
    summary = run_bench(config, tmp_path / "out", progress=False, target=target)
    assert "failures" not in summary and summary["methods"]["ov-greedy"]["overall"]["n_prompts"] == 3


@pytest.mark.real_model
def test_the_real_run_goes_on_past_a_crashing_llama_cpp(tmp_path, data_dir, monkeypatch, capsys):
    """The issue's case on the default model through the CLI: llama.cpp planted to die of SIGILL,
    OpenVINO real: `ar` and `ov-greedy` are measured and summarised, llama.cpp's rows say why."""
    pytest.importorskip("openvino_genai")
    from tierspec import cli

    monkeypatch.setitem(runner.PEER_FACTORIES, "llamacpp-greedy", "fake_peers:IllegalInstructionPeer")
    out = tmp_path / "out"
    assert cli.main(["bench", "--methods", "ar,llamacpp-greedy,ov-greedy", "--data-dir", str(data_dir),
                     "--limit", "2", "--max-new-tokens", "8", "--out", str(out), "--no-progress"]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["methods"]["ar"]["overall"]["n_prompts"] == 2
    assert summary["methods"]["ov-greedy"]["overall"]["n_prompts"] == 2
    assert summary["failures"]["llamacpp-greedy"]["reasons"][0].startswith(
        "not run: llamacpp-greedy's worker process died with SIGILL (Illegal instruction) while generating")
    ov = [json.loads(line) for line in (out / "records.jsonl").read_text().splitlines()
          if '"ov-greedy"' in line]
    assert all(r["seconds"] > 0 and r["worker_round_trip_seconds"] >= 0 for r in ov)
