"""`judge train` on the real default model: the head it trains, and a killed run that resumes after the
feature chunks it extracted and trains the head an uninterrupted run trains."""

import json

import pytest
import torch

import tierspec
from tierspec.training import judge_train
from tierspec.training.judge_data import JudgeExample
from tierspec.training.judge_train import FeatureStore, features_folder, train_judge

pytestmark = pytest.mark.real_model

CHUNK = 4  # examples a feature chunk holds here: 12 examples, 3 chunks


def _examples() -> list[JudgeExample]:
    """Six problems, each answered right and with a wrong sum (the mistake at the wrong digit)."""
    examples = []
    for n, (a, b) in enumerate([(2, 3), (4, 5), (7, 6), (8, 9), (3, 9), (5, 5)]):
        prompt = f"What is {a} plus {b}?"
        right = f"{a} + {b} = {a + b}, so the answer is {a + b}."
        wrong = f"{a} + {b} = {a + b + 1}, so the answer is {a + b + 1}."
        split = "val" if n >= 4 else "train"
        offset = next(i for i, (x, y) in enumerate(zip(right, wrong)) if x != y)
        examples += [JudgeExample(f"p{n}-correct", prompt, right, None, split),
                     JudgeExample(f"p{n}-wrong", prompt, wrong, offset, split)]
    return examples


@pytest.fixture(scope="module")
def smollm():
    return tierspec.load_model("smollm2-135m")


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    path = tmp_path_factory.mktemp("judge") / "judge.jsonl"
    path.write_text("\n".join(example.to_json() for example in _examples()) + "\n")
    return path


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch):
    monkeypatch.setattr(FeatureStore, "CHUNK", CHUNK)


@pytest.fixture(scope="module")
def uninterrupted(smollm, data):
    head, metrics = train_judge(smollm, data, progress=False)
    return head, metrics


def counting(monkeypatch, stop_at=None):
    """The chunks extracted (``_extract_examples`` calls); a KeyboardInterrupt at call ``stop_at``."""
    calls = []
    original = judge_train._extract_examples

    def extract(target, examples, kind):
        calls.append(len(examples))
        if stop_at is not None and len(calls) == stop_at:
            raise KeyboardInterrupt
        return original(target, examples, kind)

    monkeypatch.setattr(judge_train, "_extract_examples", extract)
    return calls


def same_head(a, b):
    return torch.equal(a.weight, b.weight) and a.bias == b.bias and a.threshold == b.threshold \
        and torch.equal(a.mean, b.mean) and torch.equal(a.std, b.std)


def test_the_head_trains_and_reports_its_validation_metrics(uninterrupted):
    """(Twelve examples train no judge worth ranking: its quality is measured on the real data, docs/methods.md.)"""
    head, metrics = uninterrupted
    assert metrics["matched_pairs"] == 2 and metrics["tokens"] > 0 and metrics["negatives"] == 2
    assert 0.0 <= metrics["auroc_all"] <= 1.0 and head.metadata["train_seconds"] > 0
    assert head.weight.abs().sum() > 0 and 0.0 < head.threshold <= 1.0


def test_the_store_changes_nothing_and_a_killed_run_resumes_after_its_chunks(smollm, data, uninterrupted, tmp_path,
                                                                           monkeypatch):
    folder = features_folder(tmp_path / "head.safetensors")
    counting(monkeypatch, stop_at=3)
    with pytest.raises(KeyboardInterrupt):
        train_judge(smollm, data, progress=False, features=folder)
    assert sorted(p.name for p in folder.iterdir()) == ["chunk-00000.safetensors", "chunk-00001.safetensors",
                                                        "plan.json"]
    calls = counting(monkeypatch)
    head, metrics = train_judge(smollm, data, progress=False, features=folder)
    assert calls == [CHUNK]  # the third chunk only
    assert same_head(head, uninterrupted[0])
    assert metrics == uninterrupted[1]
    assert head.metadata["train_seconds"] > 0


@pytest.mark.parametrize("damage", ["other kind", "damaged plan", "damaged chunk", "short chunk"])
def test_features_it_cannot_trust_are_said_and_extracted_again(smollm, data, uninterrupted, tmp_path, monkeypatch,
                                                               capsys, damage):
    folder = features_folder(tmp_path / "head.safetensors")
    counting(monkeypatch, stop_at=3)
    with pytest.raises(KeyboardInterrupt):
        train_judge(smollm, data, kind="hidden" if damage == "other kind" else "hidden+logprob", progress=False,
                    features=folder)
    chunk = folder / "chunk-00001.safetensors"
    if damage == "damaged plan":
        (folder / "plan.json").write_text("{")
    elif damage == "damaged chunk":
        chunk.write_bytes(chunk.read_bytes()[:100])
    elif damage == "short chunk":
        from safetensors import safe_open
        from safetensors.torch import save_file

        with safe_open(str(chunk), "pt") as handle:
            meta, tensors = handle.metadata(), {k: handle.get_tensor(k) for k in handle.keys()}
        save_file({**tensors, "labels": tensors["labels"][:-1]}, str(chunk), metadata=meta)
    capsys.readouterr()
    calls = counting(monkeypatch)
    head, _ = train_judge(smollm, data, progress=False, features=folder)
    err = capsys.readouterr().err
    if damage in ("other kind", "damaged plan"):
        assert len(calls) == 3 and "the extraction starts over" in err
        assert ("other data, model or kind" in err) == (damage == "other kind")
    else:
        assert len(calls) == 2 and "chunk-00001.safetensors: damaged" in err and "extracted again" in err
    assert same_head(head, uninterrupted[0])


def test_the_command_saves_the_head_and_removes_its_features(smollm, data, tmp_path, capsys):
    from tierspec.cli import main
    from tierspec.heads.judge import JudgeHead

    out = tmp_path / "head.safetensors"
    assert main(["judge", "train", "--data", str(data), "--out", str(out), "--no-progress"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["out"] == str(out) and report["matched_pairs"] == 2
    assert JudgeHead.load(out, smollm.identity).threshold == report["threshold"]
    assert not features_folder(out).exists()
