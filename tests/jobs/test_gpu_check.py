"""benchmarks/gpu_check.py: its CPU smoke mode runs every step on the real model (so the script
cannot rot while no GPU is at hand), and without CUDA the GPU run refuses clearly."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_check.py"


@pytest.fixture(scope="module")
def gpu_check():
    """The script as a module (registered while in use: its dataclasses look their module up)."""
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop(spec.name, None)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA device")
def test_without_cuda_it_refuses_in_one_line(gpu_check, tmp_path, capsys):
    assert gpu_check.main(["--out", str(tmp_path / "out")]) == 2
    message = capsys.readouterr().err.strip()
    assert "\n" not in message and "sees no CUDA device" in message and "--device cpu --quick" in message
    assert not (tmp_path / "out").exists()


@pytest.mark.real_model
def test_cpu_smoke_run_checks_exactness_and_benches(gpu_check, tmp_path):
    out = tmp_path / "gpu_check"
    # Every step at its smallest: float32, two lossless methods (one with the draft head), a
    # one-prompt bench of three methods including a transformers peer.
    status = gpu_check.main(["--device", "cpu", "--quick", "--dtypes", "float32", "--methods", "pld,eagle",
                             "--bench-methods", "ar,eagle,hf-greedy-stock", "--out", str(out)])
    summary = json.loads((out / "summary.json").read_text())
    rows = {(row["dtype"], row["method"]): row for row in summary["exactness"]}
    assert set(rows) == {("float32", "ar"), ("float32", "pld"), ("float32", "eagle")}
    assert all(row["equal"] == row["prompts"] == 1 for row in rows.values())  # float32: lossless means equal
    assert status == 0
    assert set(summary["bench"]) == {"ar", "eagle", "hf-greedy-stock"}
    assert summary["bench"]["eagle"]["fidelity_exact_match"] == 1.0
    report = (out / "summary.md").read_text()
    assert "All outputs equal `ar`'s." in report and "| float32 | `eagle` | 1/1 |" in report
    assert (out / "bench" / "records.jsonl").exists()


def test_a_divergence_reports_position_tokens_and_logit_gap(gpu_check, tiny_target):
    """On planted outputs: the first differing position, both tokens, and the target's logit gap."""
    prompt = torch.tensor([5, 9, 13, 5])
    reference, output = [3, 7, 11, 2], [3, 7, 12]
    parted = gpu_check.divergence(tiny_target, "p", prompt, reference, output)
    with torch.inference_mode():
        logits = tiny_target.model(input_ids=torch.tensor([[5, 9, 13, 5, 3, 7]])).logits[0, -1].float()
    assert (parted.position, parted.ar_token, parted.method_token) == (2, 11, 12)
    assert parted.logit_gap == pytest.approx(float(logits[11] - logits[12]), abs=1e-4)
    ended = gpu_check.divergence(tiny_target, "p", prompt, reference, reference[:2])
    assert (ended.position, ended.ar_token, ended.method_token, ended.logit_gap) == (2, 11, None, None)
