"""`judge build-mismatch-data` on the real default model and its shipped head: a killed build
resumes after the prompts it finished and writes what one uninterrupted build writes."""

import json

import pytest

import tierspec
from tierspec.methods import MethodOptions, draft_head_for
from tierspec.training import judge_mismatches
from tierspec.training.judge_mismatches import MismatchConfig, build_mismatch_data, progress_path

pytestmark = pytest.mark.real_model

PROMPTS = ["Write a short poem about the sea.", "What is 17 times 23? Explain step by step.",
           "Summarise: The city council met on Monday to discuss the new park.", "Name three primary colours."]
CONFIG = MismatchConfig(answer_tokens=24, window=4, match=2, per_prompt=2, val_fraction=0.5)


@pytest.fixture(scope="module")
def model_and_head():
    target = tierspec.load_model("smollm2-135m")
    return target, draft_head_for(target, MethodOptions())


@pytest.fixture(scope="module")
def uninterrupted(model_and_head, tmp_path_factory):
    target, head = model_and_head
    out = tmp_path_factory.mktemp("whole") / "m.jsonl"
    info = build_mismatch_data(target, head, PROMPTS, out, CONFIG, progress=False)
    assert not progress_path(out).exists()  # kept only until the build ends
    return out.read_text(), info


def counting(monkeypatch, stop_at=None):
    """Counts the prompts the build works on (find_mismatches calls); a KeyboardInterrupt at call ``stop_at``."""
    calls = []
    original = judge_mismatches.find_mismatches

    def find(target, head, prompt_ids, config, eos):
        calls.append(len(prompt_ids))
        if stop_at is not None and len(calls) == stop_at:
            raise KeyboardInterrupt
        return original(target, head, prompt_ids, config, eos)

    monkeypatch.setattr(judge_mismatches, "find_mismatches", find)
    return calls


def killed_build(model_and_head, out, monkeypatch, config=CONFIG, prompts_done=2):
    """A build into ``out`` killed as it starts prompt ``prompts_done`` + 1; its progress file's lines."""
    target, head = model_and_head
    counting(monkeypatch, stop_at=prompts_done + 1)
    with pytest.raises(KeyboardInterrupt):
        build_mismatch_data(target, head, PROMPTS, out, config, progress=False)
    return progress_path(out).read_text().splitlines()


def test_the_build_labels_each_mismatch_at_its_draft_tokens_offset(uninterrupted):
    text, info = uninterrupted
    examples = [json.loads(line) for line in text.splitlines()]
    assert len(examples) == info["examples"] > 0
    assert info["harmless"] + info["harmful"] >= info["examples"]
    assert {e["split"] for e in examples} == {"train", "val"}
    for example in examples:  # the id carries the draft token's offset; a harmful one is labelled there
        offset = int(example["id"].rpartition("@")[2])
        assert 0 < offset < len(example["response"])
        assert example["mistake_offset"] in (None, offset)
    assert info["seconds_total"] > 0


def test_a_killed_build_resumes_after_its_finished_prompts_and_writes_the_same_file(model_and_head, uninterrupted,
                                                                                    tmp_path, monkeypatch, capsys):
    target, head = model_and_head
    out = tmp_path / "m.jsonl"
    assert len(killed_build(model_and_head, out, monkeypatch)) == 1 + 2  # the header and two prompts
    assert not out.exists()
    calls = counting(monkeypatch)
    info = build_mismatch_data(target, head, PROMPTS, out, CONFIG, progress=False)
    assert len(calls) == 2  # prompts 3 and 4 only
    assert "2 of 4 prompts done" in capsys.readouterr().err
    assert out.read_text() == uninterrupted[0]
    assert {k: info[k] for k in ("examples", "harmless", "harmful")} == \
        {k: uninterrupted[1][k] for k in ("examples", "harmless", "harmful")}
    assert not progress_path(out).exists()


def test_a_line_torn_by_the_kill_is_done_again(model_and_head, uninterrupted, tmp_path, monkeypatch):
    target, head = model_and_head
    out = tmp_path / "m.jsonl"
    lines = killed_build(model_and_head, out, monkeypatch)
    log = progress_path(out)
    log.write_text("\n".join(lines[:2]) + "\n" + lines[2][: len(lines[2]) // 2])  # the second prompt's line, half
    counting(monkeypatch, stop_at=2)  # killed again, a prompt later: the torn line was cut, not glued to
    with pytest.raises(KeyboardInterrupt):  # the next one (the rerun after found the file damaged)
        build_mismatch_data(target, head, PROMPTS, out, CONFIG, progress=False)
    assert len(log.read_text().splitlines()) == 1 + 2
    calls = counting(monkeypatch)
    build_mismatch_data(target, head, PROMPTS, out, CONFIG, progress=False)
    assert len(calls) == 2
    assert out.read_text() == uninterrupted[0]


@pytest.mark.parametrize("damage", ["other settings", "damaged header", "damaged line", "empty"])
def test_a_progress_file_it_cannot_trust_is_said_and_the_build_starts_over(model_and_head, uninterrupted, tmp_path,
                                                                           monkeypatch, capsys, damage):
    target, head = model_and_head
    out = tmp_path / "m.jsonl"
    other = CONFIG if damage != "other settings" else MismatchConfig(**{**CONFIG.__dict__, "window": 5})
    lines = killed_build(model_and_head, out, monkeypatch, other)
    log = progress_path(out)
    if damage == "damaged header":
        log.write_text("[1]\n" + "\n".join(lines[1:]) + "\n")
    elif damage == "damaged line":
        log.write_text("\n".join([lines[0], '{"index": 9, "examples": [], "harmless": 0, "harmful": 0, "seconds": 1}',
                                  lines[2]]) + "\n")
    elif damage == "empty":
        log.write_text("")
    capsys.readouterr()
    calls = counting(monkeypatch)
    build_mismatch_data(target, head, PROMPTS, out, CONFIG, progress=False)
    assert len(calls) == 4
    err = capsys.readouterr().err
    assert "the build starts over" in err
    assert ("another model, head, prompt list or settings" in err) == (damage == "other settings")
    assert out.read_text() == uninterrupted[0]


def test_another_head_is_another_build(model_and_head, tmp_path, monkeypatch, capsys):
    target, head = model_and_head
    out = tmp_path / "m.jsonl"
    killed_build(model_and_head, out, monkeypatch, prompts_done=1)
    weights = head.state_dict()
    monkeypatch.setattr(head, "state_dict", lambda: {**weights, "fc.bias": weights["fc.bias"] + 1e-3})  # retrained
    monkeypatch.setattr(judge_mismatches, "find_mismatches", lambda *a: (_ for _ in ()).throw(KeyboardInterrupt))
    with pytest.raises(KeyboardInterrupt):
        build_mismatch_data(target, head, PROMPTS, out, CONFIG, progress=False)
    assert "another model, head, prompt list or settings" in capsys.readouterr().err
