"""Judge decoding: labels, training, the head file, and the κ = max(κ_SD, κ_J) rule."""

import random

import pytest
import torch

from tierspec.decode import DecodeConfig, decode
from tierspec.drafters import ModelDrafter
from tierspec.proposal import Proposal, Scores
from tierspec.rules.judge import JudgeBlock
from tierspec.identity import ModelIdentity
from tierspec.training.judge_data import (
    JudgeDataError,
    build_gsm8k_judge_data,
    clean_solution,
    plant_copy_error,
    plant_error,
    token_labels,
)
from tierspec.heads.judge import JudgeHead, JudgeHeadError
from tierspec.training.judge_train import LabelledTokens, auroc, choose_threshold, matched_pairs, train_head
from tierspec.rules import ExactRule
from tierspec.rules.judge import JudgeRule, judge_block
from tierspec.sampling import SamplingConfig

# ---- data and labels -------------------------------------------------------------------------

def test_labels_on_a_hand_made_example():
    # response "5 + 7 = 13\nso 13 apples"; a wrong copy says 14: the first wrong character is the "4" at offset 9
    offsets = [(0, 1), (1, 3), (3, 5), (5, 7), (7, 8), (8, 9), (9, 10), (10, 11), (11, 13), (13, 16)]
    assert token_labels(offsets, 9) == [1, 1, 1, 1, 1, 1, 0, None, None, None]
    assert token_labels(offsets, None) == [1] * 10
    assert token_labels(offsets, 0) == [0] + [None] * 9


def test_planted_error_changes_a_reused_result_and_points_at_the_first_wrong_character():
    solution = clean_solution("He has 3 * 4 = <<3*4=12>>12 eggs.\nThen 12 + 5 = <<12+5=17>>17.\n#### 17")
    assert solution == "He has 3 * 4 = 12 eggs.\nThen 12 + 5 = 17.\nThe answer is 17."
    wrong, offset = plant_error(solution, random.Random(0))
    assert wrong != solution
    assert wrong[:offset] == solution[:offset] and wrong[offset] != solution[offset]
    # an intermediate result that a later line reuses was changed; the later lines were not
    assert wrong.endswith("The answer is 17.")
    for seed in range(20):
        wrong, offset = plant_error(solution, random.Random(seed))
        changed_line = wrong[: wrong.index("\n", offset)].split("\n")[-1]
        assert changed_line in ("He has 3 * 4 = " + changed_line.split("= ")[-1], "Then 12 + 5 = " + changed_line.split("= ")[-1])


def test_copy_error_is_the_continuation_of_the_latest_earlier_occurrence():
    # Only one word of the solution has an earlier occurrence of its predecessor: "z" after "a"
    # (question "a b c d"); the copying drafter continues with "b c ..." where the truth is "z".
    for seed in range(10):
        wrong, offset = plant_copy_error("x a z q", "a b c d", random.Random(seed))
        assert offset == 4 and wrong[:offset] == "x a " and wrong[offset] == "b"
        assert "b c d x".startswith(wrong[offset:])
    # A copy that agrees with the truth is no mistake.
    assert plant_copy_error("x a b c", "a b c", random.Random(0)) is None


def test_builder_writes_both_error_kinds_and_refuses_unknown_ones(tmp_path):
    import json

    rows = [{"question": "Tom has 3 apples and buys 4 more apples.", "answer": "Tom has 3 + 4 = <<3+4=7>>7 apples.\nSo he has 7 apples.\n#### 7"},
            {"question": "A box holds 5 pens and 2 pens more.", "answer": "The box holds 5 + 2 = <<5+2=7>>7 pens.\nIt has 7 pens.\n#### 7"}]
    train = tmp_path / "train.jsonl"
    train.write_text("\n".join(json.dumps(r) for r in rows))
    build_gsm8k_judge_data(train, tmp_path / "judge.jsonl", count=2, val_fraction=0.5)
    kinds = sorted(json.loads(line)["id"].rpartition("-")[2] for line in (tmp_path / "judge.jsonl").read_text().splitlines())
    assert kinds == ["copy", "copy", "correct", "correct", "wrong", "wrong"]
    with pytest.raises(JudgeDataError, match="error kinds"):
        build_gsm8k_judge_data(train, tmp_path / "other.jsonl", errors=("typo",))
    assert not (tmp_path / "other.jsonl").exists()


def test_matched_pairs_pair_each_kind_with_the_correct_twin():
    example = ["p-correct", "p-correct", "p-wrong", "p-copy", "q-copy"]
    tokens = LabelledTokens(torch.zeros(5, 2), torch.tensor([1.0, 1.0, 0.0, 0.0, 0.0]), example, [0, 4, 4, 0, 0], ["val"] * 5)
    scores = torch.tensor([0.9, 0.8, 0.1, 0.2, 0.3])
    assert matched_pairs(tokens, scores) == [(pytest.approx(0.1), pytest.approx(0.8)), (pytest.approx(0.2), pytest.approx(0.9))]
    assert matched_pairs(tokens, scores, kind="copy") == [(pytest.approx(0.2), pytest.approx(0.9))]  # q has no correct twin


# ---- training -----------------------------------------------------------------------------------

def imbalanced(seed, n_pos=2000, n_neg=100, dim=8, shift=1.5):
    g = torch.Generator().manual_seed(seed)
    direction = torch.zeros(dim)
    direction[0] = 1.0
    pos = torch.randn(n_pos, dim, generator=g) + shift * direction
    neg = torch.randn(n_neg, dim, generator=g) - shift * direction
    x = torch.cat([pos, neg])
    y = torch.cat([torch.ones(n_pos), torch.zeros(n_neg)])
    return x, y


def test_training_recovers_a_planted_separator():
    x, y = imbalanced(0)
    vx, vy = imbalanced(1)
    weight, bias, mean, std, _ = train_head(x, y, vx, vy, lr=1e-2, max_epochs=30)
    head = JudgeHead(weight, bias, mean, std, "hidden", 0.5)
    assert auroc(vy.numpy(), head.probability(vx).numpy()) > 0.95
    assert weight[0] > 5 * weight[1:].abs().max()  # the planted direction carries the weight


def test_class_weights_matter_on_a_20_to_1_imbalance():
    x, y = imbalanced(2, shift=0.8)
    vx, vy = imbalanced(3, shift=0.8)

    def negative_recall(weighted):
        weight, bias, mean, std, _ = train_head(x, y, vx, vy, weighted=weighted, lr=1e-2, max_epochs=30)
        head = JudgeHead(weight, bias, mean, std, "hidden", 0.5)
        return float((head.probability(vx[vy == 0]) < 0.5).float().mean())

    assert negative_recall(True) > 0.7
    assert negative_recall(False) < 0.3


def test_threshold_caps_the_share_of_accepted_mistakes():
    scores = [0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3, 0.2, 0.1, 0.05]
    threshold = choose_threshold(scores, 0.2)
    assert sum(s >= threshold for s in scores) == 2


# ---- the head file ------------------------------------------------------------------------------

def test_head_round_trip_and_refusal_on_another_model(tmp_path):
    identity = ModelIdentity("tiny", 4, 32, 64, "a" * 64)
    head = JudgeHead(torch.randn(34), 0.3, torch.zeros(34), torch.ones(34), "hidden+logprob", 0.7, identity, {"validation": {"auroc_all": 0.9}})
    head.save(tmp_path / "head.safetensors")
    loaded = JudgeHead.load(tmp_path / "head.safetensors", identity)
    assert torch.equal(loaded.weight, head.weight) and loaded.threshold == 0.7 and loaded.kind == "hidden+logprob"
    with pytest.raises(JudgeHeadError, match="trained on 'tiny' \\(hidden 32\\), not on 'smollm2-135m' \\(hidden 576\\)"):
        JudgeHead.load(tmp_path / "head.safetensors", ModelIdentity("smollm2-135m", 30, 576, 49152, "b" * 64))
    (tmp_path / "bad.safetensors").write_bytes(b"garbage")
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(JudgeHeadError, match="cannot read judge head"):
        JudgeHead.load(tmp_path / "bad.safetensors")


# ---- the rule -----------------------------------------------------------------------------------

@pytest.mark.parametrize(
    "sd, judge, expected",
    [
        ([1, 1, 0, 1], [0, 0, 0, 0], (2, 0, 2)),  # plain SD
        ([1, 0, 0, 0], [1, 1, 1, 0], (1, 3, 3)),  # judge rescues two more
        ([1, 1, 1, 1], [0, 1, 1, 1], (4, 0, 4)),
        ([0, 1, 1, 1], [0, 1, 1, 1], (0, 0, 0)),  # neither accepts the first: nothing kept
    ],
)
def test_kappa_is_the_longer_leading_run(sd, judge, expected):
    block = judge_block(torch.tensor(sd, dtype=torch.bool), torch.tensor(judge, dtype=torch.bool))
    assert block == JudgeBlock(*expected[:2]) and block.kept == expected[2]


def sign_head(threshold=0.5):
    """Judge probability = sigmoid(h[0]): accepts where the planted hidden value is positive."""
    return JudgeHead(torch.tensor([1.0, 0.0]), 0.0, torch.zeros(2), torch.ones(2), "hidden", threshold)


def greedy_block(draft, argmax, judge_signs):
    vocab = 6
    logits = torch.full((len(draft) + 1, vocab), -5.0)
    logits[torch.arange(len(draft) + 1), torch.tensor(argmax)] = 5.0
    hidden = torch.zeros(len(draft) + 1, 2)
    hidden[1:, 0] = torch.tensor(judge_signs, dtype=torch.float)  # row i+1 is draft token i's position
    rule = JudgeRule(sign_head())
    assert rule.reads_hidden  # the loop's pass returns the hidden states it reads
    verdict = rule.decide(Proposal.chain(torch.tensor(draft)), Scores(logits, hidden), SamplingConfig(), None)
    return verdict.accepted, verdict.next_token


def test_greedy_judge_blocks_and_correction_token():
    # argmax q per position: 1, 2, 3, 4 (the last is the bonus position)
    assert greedy_block([1, 5, 3], [1, 2, 3, 4], [-1, -1, -1]) == (1, 2)  # SD only: correction argmax
    assert greedy_block([1, 5, 3], [1, 2, 3, 4], [1, 1, -1]) == (2, 3)  # judge keeps 5; x3 = argmax → emitted
    assert greedy_block([1, 5, 5], [1, 2, 3, 4], [1, 1, -1]) == (2, 3)  # x3 rejected by both: argmax q there
    assert greedy_block([0, 5, 5], [1, 2, 3, 4], [1, 1, 1]) == (3, 4)  # judge keeps all: bonus
    assert greedy_block([1, 2, 3], [1, 2, 3, 4], [-1, -1, -1]) == (3, 4)


def run(target, drafter_model, rule, prompt, temperature, seed):
    from conftest import as_method, run_ids

    method = as_method(ModelDrafter(drafter_model.model), rule, num_draft=4)
    return run_ids(target, method, prompt, 30, SamplingConfig(temperature), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_threshold_one_reproduces_sd_exactly(tiny_target, tiny_drafter, prompt_ids, temperature):
    head = JudgeHead(torch.randn(32, generator=torch.Generator().manual_seed(0)), 5.0, torch.zeros(32), torch.ones(32), "hidden", 1.0)
    judged = run(tiny_target, tiny_drafter, JudgeRule(head, 1.0), prompt_ids, temperature, seed=3)
    # δ = 1 leaves rule 3.1 with its own coins: the residual rule, draw for draw (same keyed noise)
    assert judged == run(tiny_target, tiny_drafter, ExactRule("residual"), prompt_ids, temperature, seed=3)


def test_a_judge_that_accepts_everything_keeps_every_draft(tiny_target, tiny_drafter, prompt_ids):
    head = JudgeHead(torch.zeros(32), 10.0, torch.zeros(32), torch.ones(32), "hidden", 0.5)
    from conftest import as_method

    method = as_method(ModelDrafter(tiny_drafter.model), JudgeRule(head), num_draft=4)
    for step in decode(tiny_target, method, prompt_ids, DecodeConfig(max_new_tokens=20)):
        assert step.cycle.accepted == step.cycle.drafted


# ---- judge data from the draft head's mismatches ---------------------------------------------

@pytest.mark.parametrize("original, alternative, expected", [
    ([5, 6, 7, 8, 9], [5, 6, 7, 8], True),          # the same text right away
    ([5, 6, 7, 8, 9], [40, 6, 7, 8], True),         # one token apart, then back on the target's text
    ([5, 6, 7, 8, 9], [40, 41, 7, 8, 9], True),     # two tokens, then three in a row rejoin
    ([5, 6, 7, 8, 9], [40, 6, 41, 8, 42], False),   # shared tokens, never three in a row
    ([5, 6, 7, 8, 9], [40, 41, 42, 43], False),     # somewhere else entirely
])
def test_a_mismatch_is_harmless_when_the_target_rejoins_its_own_text(original, alternative, expected):
    from tierspec.training.judge_mismatches import rejoins

    assert rejoins(original, alternative, window=8, match=3) is expected


def test_rejoining_must_happen_within_the_window():
    from tierspec.training.judge_mismatches import rejoins

    late = [40, 41, 42, 43, 44, 5, 6, 7]
    assert rejoins([5, 6, 7, 8], late, window=8, match=3)
    assert not rejoins([5, 6, 7, 8], late, window=4, match=3)


def test_the_operating_point_caps_harmful_acceptance_on_validation():
    from tierspec.training.judge_mismatches import choose_operating_point, operating_curve

    harmless = [0.9, 0.8, 0.7, 0.6, 0.3]
    harmful = [0.85, 0.4, 0.2, 0.1, 0.05, 0.05, 0.05, 0.05, 0.05, 0.05]
    curve = operating_curve(harmless, harmful, thresholds=[0.1, 0.3, 0.5, 0.9])
    assert [(r["harmless_accepted"], r["harmful_accepted"]) for r in curve] == [(1.0, 0.4), (1.0, 0.2), (0.8, 0.1), (0.2, 0.0)]
    assert choose_operating_point(curve, max_harmful=0.1)["threshold"] == 0.5
    assert choose_operating_point(curve, max_harmful=0.0)["threshold"] == 0.9
    assert choose_operating_point(curve, max_harmful=-1)["threshold"] == 0.9  # none qualifies: the strictest
