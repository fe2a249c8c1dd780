"""Encoder–decoder (T5-style) models in the one decode loop (docs/algorithms.md §Encoder-decoder
models), on tiny random T5 models built in the test: the decoder cache and its rollback, the
kept cross-attention cache, every lossless method's greedy output against ``ar``'s, the sampling
exactness tests, decoder-unit routing masks and DIMR, and a pair saved to folders run through
the CLI and ``tierspec bench``."""

from __future__ import annotations

import json

import pytest
import numpy as np
import torch
from conftest import as_method, char_tokenizer, draft_request, run_ids
from distributions import chi_square_p_value, pooled_chi_square_p_value
from transformers import T5Config, T5ForConditionalGeneration

from tierspec.decode import DecodeConfig, decode
from tierspec.drafters import NgramDrafter
from tierspec.methods import MethodOptions, build_method
from tierspec.models import wrap_model
from tierspec.layerskip.masks import RoutingMask, RoutingMaskError, apply_mask
from tierspec.rules import ExactRule
from tierspec.sampling import SamplingConfig, logits_to_probs
from tierspec.layerskip.masks import decoder_blocks
from tierspec.drafters.model import Seq2SeqModelDrafter
from tierspec.seq2seq import Seq2SeqCachedModel, Seq2SeqError


def t5_model(seed: int, vocab_size: int = 64, layers: int = 3, decoder_layers: int = 4, hidden: int = 32,
             sharpness: float = 20.0, untie: bool = True) -> T5ForConditionalGeneration:
    """A random T5 (float64, no dropout). Weights are drawn wider than T5's initialisation and the
    LM head is given its own random rows scaled by ``sharpness``: a random T5 with its tied head
    only copies its last input token, and its distributions are near uniform."""
    torch.manual_seed(seed)
    config = T5Config(vocab_size=vocab_size, d_model=hidden, d_kv=8, d_ff=2 * hidden, num_layers=layers,
                      num_decoder_layers=decoder_layers, num_heads=4, decoder_start_token_id=0, eos_token_id=1,
                      pad_token_id=0, dropout_rate=0.0)
    model = T5ForConditionalGeneration(config).to(torch.float64).eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "layer_norm" not in name:
                parameter.normal_(0.0, 0.5)
        if untie:
            model.lm_head.weight = torch.nn.Parameter(torch.randn(vocab_size, hidden, dtype=torch.float64) * sharpness)
    return model


def tiny_t5(seed: int, **kwargs):
    return wrap_model(t5_model(seed, **kwargs), name=f"tiny-t5-{seed}")


@pytest.fixture(scope="module")
def target():
    return tiny_t5(1)


@pytest.fixture(scope="module")
def drafter():
    return tiny_t5(2, layers=2, decoder_layers=2)


SOURCE = torch.tensor([5, 9, 13, 5, 9, 13, 7, 21, 5, 9, 13, 7, 3, 30, 41])
SMALL_SOURCE = torch.tensor([3, 5, 2, 7, 4, 6, 2, 5])  # for the 8- and 12-token models


def greedy_reference(model, source: torch.Tensor, count: int) -> list[int]:
    """Greedy decoding with full, cache-free forwards of the transformers model."""
    decoded = [model.config.decoder_start_token_id]
    with torch.inference_mode():
        for _ in range(count):
            logits = model(input_ids=source[None], decoder_input_ids=torch.tensor([decoded])).logits[0, -1]
            decoded.append(int(logits.argmax()))
    return decoded[1:]


# ---- the cached decoder ---------------------------------------------------------------------

def test_cached_decoder_passes_equal_a_cache_free_forward_and_roll_back(target):
    model = target.model
    decoder = torch.tensor([0, 4, 7, 9, 3, 11])
    with torch.inference_mode():
        full = model(input_ids=SOURCE[None], decoder_input_ids=decoder[None]).logits[0]
        runner = Seq2SeqCachedModel(model, SOURCE)
        pieces = torch.cat([runner.forward(decoder[:2]).logits, runner.forward(decoder[2:5]).logits,
                            runner.forward(decoder[5:]).logits])
        assert torch.allclose(pieces, full.float(), atol=1e-5)
        assert runner.length == 6 and runner.layer_lengths() == [6] * 4
        runner.rollback(3)  # the invariant: every self-attention layer holds exactly the kept positions
        assert runner.layer_lengths() == [3] * 4
        assert torch.allclose(runner.forward(decoder[3:]).logits, full[3:].float(), atol=1e-5)
        # the cross-attention KV stays: one source-length entry per decoder layer
        assert [layer.keys.shape[-2] for layer in runner.cross_cache.layers] == [len(SOURCE)] * 4


def test_the_encoder_runs_once_and_cross_attention_kv_is_computed_once_per_generation(target, drafter):
    model = target.model
    encoder_calls, cross_projections = [], []
    hooks = [model.get_encoder().register_forward_hook(lambda *args: encoder_calls.append(1)),
             model.decoder.block[1].layer[1].EncDecAttention.k.register_forward_hook(lambda *args: cross_projections.append(1))]
    try:
        steps = []
        run_ids(target, build_method("sd", target, drafter), SOURCE, 20, on_step=steps.append)
    finally:
        for hook in hooks:
            hook.remove()
    assert len(steps) > 1
    assert len(encoder_calls) == 1 and len(cross_projections) == 1


def test_a_bypassed_self_attention_writes_no_kv_and_rollback_trims_each_layer(target):
    mask = RoutingMask(4, "sublayer", frozenset({1}), frozenset({2}))
    runner = Seq2SeqCachedModel(target.model, SOURCE)
    with torch.inference_mode():
        runner.forward(torch.tensor([0, 4, 7]))
        masked = runner.forward(torch.tensor([9, 3]), mask=mask).logits
        assert runner.layer_lengths() == [5, 3, 5, 5]
        runner.rollback(3)
        assert runner.layer_lengths() == [3] * 4
        full = runner.forward(torch.tensor([9, 3])).logits
    assert not torch.allclose(masked, full)  # the mask changed the pass
    blocks = decoder_blocks(target.model)
    assert all(type(block).__name__ == "T5Block" for block in blocks)  # every stand-in was put back
    assert [type(sub).__name__ for sub in blocks[1].layer] == ["T5LayerSelfAttention", "T5LayerCrossAttention", "T5LayerFF"]


def test_a_decoder_runner_without_a_source_is_refused(target):
    with pytest.raises(Seq2SeqError, match="no source is encoded"):
        Seq2SeqCachedModel(target.model).forward(torch.tensor([0]))


# ---- the decode loop: lossless methods equal ar ----------------------------------------------

def test_ar_through_the_loop_equals_cache_free_greedy_decoding(target):
    assert run_ids(target, build_method("ar", target), SOURCE, 24) == greedy_reference(target.model, SOURCE, 24)


def _invariant(verifiers, drafter):
    """After every commit: each self-attention layer holds at most the committed decoder tokens
    less the pending last one, and the drafter model's cache likewise."""
    committed = len(verifiers.context)
    assert max(verifiers.runner.layer_lengths()) == verifiers.runner.length <= committed - 1
    runner = getattr(drafter, "runner", None)
    if runner is not None:
        assert max(runner.layer_lengths()) == runner.length <= committed - 1


@pytest.mark.parametrize("name, with_drafter", [
    ("sd", True),  # a drafter that often disagrees
    ("sd", False),  # the target drafting for itself: always agrees
    ("adaptive-sd", True),
    ("pld", False),
    ("adaptive-pld", False),
    ("self", False),
    ("swift", False),
    ("lossy", True),  # α = 0, β = 1: exactly the exact rule
])
def test_every_lossless_method_gives_ars_greedy_output(target, drafter, name, with_drafter):
    mask = RoutingMask(4, "sublayer", frozenset({1}), frozenset({2}), model=target.identity)
    # each method gets the options it reads (build_method refuses the ones it would not use)
    options = {"self": MethodOptions(mask=mask),
               "lossy": MethodOptions(alpha=0.0, beta=1.0)}.get(name, MethodOptions())
    reference = run_ids(target, build_method("ar", target), SOURCE, 30)
    steps = []
    out = run_ids(target, build_method(name, target, drafter if with_drafter else None, options), SOURCE, 30,
                  inspect=_invariant, on_step=steps.append)
    assert out == reference
    assert sum(step.cycle.drafted for step in steps) > 0


@pytest.mark.parametrize("name", ["lossy", "bild", "cascade", "via"])
def test_lossy_rules_run_with_a_same_family_drafter(target, drafter, name):
    mask = RoutingMask(4, "layer", frozenset({2}), frozenset({2}), model=target.identity)
    steps = []
    options = MethodOptions(mask=mask) if name == "via" else MethodOptions()
    out = run_ids(target, build_method(name, target, drafter, options), SOURCE, 24,
                  inspect=_invariant, on_step=steps.append)
    assert len(out) == 24 and all(0 <= token < target.vocab_size for token in out)
    assert sum(step.cycle.drafter_calls for step in steps) > 0
    if name == "via":
        assert sum(step.cycle.slim_calls for step in steps) > 0


def test_prompt_lookup_drafts_from_the_source():
    drafter = NgramDrafter(3)
    drafter.set_source(torch.tensor([8, 2, 6, 4, 7, 5, 1]))
    context = np.array([0, 3, 6, 4])  # decoder start, then a suffix [6, 4] that only the source holds
    proposal = drafter.propose(context, draft_request(3))
    assert proposal.tokens.tolist() == [7, 5, 1] and proposal.match_sizes == [2, 2, 2]
    drafter.set_source(None)  # a decoder-only generation: the context alone
    assert len(drafter.propose(context, draft_request(3))) == 0


def test_unsupported_methods_and_mixed_families_are_refused(target, drafter):
    from conftest import tiny_llama

    from tierspec.drafters import DrafterMismatchError

    with pytest.raises(Seq2SeqError, match="method 'csd' does not run on an encoder–decoder target"):
        build_method("csd", target, drafter)
    with pytest.raises(Seq2SeqError, match="draft-with eagle"):
        build_method("lossy", target, drafter, MethodOptions(drafter_kind="eagle"))
    with pytest.raises(DrafterMismatchError, match="use a drafter of the target's kind"):
        build_method("sd", target, tiny_llama(seed=3))


# ---- sampling: the output distribution is the target's ---------------------------------------

def _first_decoder_distribution(model, prefix: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        logits = model(input_ids=SMALL_SOURCE[None], decoder_input_ids=torch.tensor([prefix])).logits[0, -1]
    return logits_to_probs(logits, SamplingConfig(1.0)).double()


@pytest.mark.parametrize("sampling_rule", ["coupled", "residual"])
def test_sampling_on_the_seq2seq_path_matches_the_targets_first_token_distribution(sampling_rule):
    from tierspec.walks import acceptance_probability

    target = tiny_t5(11, vocab_size=12, layers=2, decoder_layers=2, hidden=16, sharpness=3.0)
    drafter = tiny_t5(12, vocab_size=12, layers=1, decoder_layers=1, hidden=16, sharpness=3.0)
    q = _first_decoder_distribution(target.model, [0])
    p = _first_decoder_distribution(drafter.model, [0])
    rejected_mass = float((p * (1 - acceptance_probability(p, q))).sum())
    assert rejected_mass > 0.2, "the test needs a drafter that disagrees often"
    method = as_method(Seq2SeqModelDrafter(drafter.model), ExactRule(sampling_rule), num_draft=1)
    config = DecodeConfig(max_new_tokens=2, sampling=SamplingConfig(temperature=1.0))
    counts = torch.zeros(12)
    for seed in range(3000):
        counts[next(decode(target, method, SMALL_SOURCE, config, seed)).new_tokens[0]] += 1
    assert chi_square_p_value(counts, q) > 1e-3
    wrong = p * acceptance_probability(p, q) + rejected_mass * q  # a residual drawn from q itself
    assert chi_square_p_value(counts, wrong) < 1e-6


def test_two_tokens_of_the_coupled_seq2seq_loop_have_the_targets_joint_distribution():
    target = tiny_t5(11, vocab_size=8, layers=2, decoder_layers=2, hidden=16, sharpness=2.0)
    drafter = tiny_t5(12, vocab_size=8, layers=1, decoder_layers=1, hidden=16, sharpness=2.0)
    first = _first_decoder_distribution(target.model, [0])
    second = torch.stack([_first_decoder_distribution(target.model, [0, y]) for y in range(8)])
    joint = (first[:, None] * second).flatten()  # [64]
    method = as_method(Seq2SeqModelDrafter(drafter.model), ExactRule("coupled"), num_draft=2)
    counts, accepted = torch.zeros(64), 0
    for seed in range(3000):
        out = []
        for step in decode(target, method, SMALL_SOURCE, DecodeConfig(max_new_tokens=2, sampling=SamplingConfig(1.0)), seed):
            out.extend(step.new_tokens)
            accepted += step.cycle.accepted
        counts[out[0] * 8 + out[1]] += 1
    assert accepted > 300
    assert pooled_chi_square_p_value(counts, joint) > 1e-3


# ---- routing masks and DIMR over the decoder ---------------------------------------------------

def test_a_mask_covers_the_decoders_layers_round_trips_and_refuses_another_model(target, tmp_path):
    assert target.identity.num_layers == 4  # the decoder's 4 blocks, not the encoder's 3
    mask = RoutingMask.from_units(4, "sublayer", [("attn", 1), ("mlp", 2)], model=target.identity)
    path = tmp_path / "mask.json"
    mask.save(path)
    loaded = RoutingMask.load(path, target.identity)
    assert loaded == mask
    with pytest.raises(RoutingMaskError, match="layers"):
        RoutingMask.load(path, tiny_t5(5, decoder_layers=6).identity)
    with pytest.raises(RoutingMaskError, match="was made for model 'tiny-t5-1', not for 'tiny-t5-6'"):
        RoutingMask.load(path, tiny_t5(6).identity)  # same shape, another model
    with pytest.raises(RoutingMaskError, match="mask is for 3 layers, the decoder has 4"):
        with apply_mask(target.model, RoutingMask(3, "layer", frozenset({1}), frozenset({1}))):
            pass


def test_dimr_searches_a_decoder_mask_on_seq2seq_calibration(target):
    from tierspec.layerskip.search import Calibration, SearchConfig, search_mask, with_target_scores

    reference = run_ids(target, build_method("ar", target), SOURCE, 6)
    sequences = torch.tensor([[0] + reference])
    calibration = with_target_scores(target.model, Calibration(sequences, 6, sources=[SOURCE]))
    assert calibration.target_logprobs.shape == (6, 64)
    assert calibration.target_argmax.tolist() == reference  # teacher-forced greedy text: the target agrees
    result = search_mask(target, calibration, SearchConfig(ratio=0.25, unit="sublayer", budget=4, bo_every=2,
                                                           initial_random=2), progress=False)
    assert result.mask.num_layers == 4 and len(result.mask.bypassed_units()) == 2  # round(0.25 · 8)
    assert result.best.cost > 0


# ---- a pair saved to folders, by path through the CLI and the bench ----------------------------

@pytest.fixture(scope="module")
def t5_folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("t5")
    folders = {}
    for name, seed, layers in (("target", 21, 3), ("drafter", 22, 1)):
        model = t5_model(seed, vocab_size=58, layers=layers, decoder_layers=layers, untie=False)
        folders[name] = root / name
        model.save_pretrained(folders[name])
        char_tokenizer().save_pretrained(folders[name])
    return folders


def test_cli_generate_loads_a_t5_pair_by_path(t5_folders, capsys):
    from tierspec.cli import main

    outputs = {}
    for method in ("ar", "sd", "pld"):
        drafter = ["--drafter", str(t5_folders["drafter"])] if method == "sd" else []  # the others draft without it
        code = main(["generate", "--target", str(t5_folders["target"]), *drafter, "--method", method, "--max-new-tokens", "8", "--dtype", "float32", "--stats",
                     "translate english to german: the house is small."])
        captured = capsys.readouterr()
        assert code == 0, captured.err
        outputs[method] = captured.out
        assert json.loads(captured.err.strip().splitlines()[-1])["method"] == method
    assert outputs["sd"] == outputs["ar"] == outputs["pld"]


@pytest.mark.parametrize("dataset", ["xsum", "cnn_dailymail", "wmt14"])
def test_bench_runs_a_t5_pair_by_path(t5_folders, dataset, tmp_path, capsys):
    from tierspec.cli import main

    out = tmp_path / "out"
    code = main(["bench", "--target", str(t5_folders["target"]), "--drafter", str(t5_folders["drafter"]),
                 "--methods", "ar,sd,pld", "--dataset", dataset, "--limit", "1", "--max-new-tokens", "6",
                 "--dtype", "float32", "--out", str(out), "--no-progress"])
    assert code == 0, capsys.readouterr().err
    records = [json.loads(line) for line in (out / "records.jsonl").read_text().splitlines()]
    assert sorted(r["method"] for r in records) == ["ar", "pld", "sd"]
    by_method = {r["method"]: r for r in records}
    assert by_method["sd"]["token_ids"] == by_method["ar"]["token_ids"] == by_method["pld"]["token_ids"]
    assert all(r["target_nll"] == r["target_nll"] for r in records)  # computed (not NaN) on the decoder's tokens


def test_the_readme_table_3_methods_run_in_one_bench_on_a_t5_pair(t5_folders, tmp_path, capsys):
    from tierspec.cli import main
    from tierspec.models import load_model

    mask = tmp_path / "mask.json"
    RoutingMask(3, "layer", frozenset({1}), frozenset({1}), model=load_model(t5_folders["target"]).identity).save(mask)
    out = tmp_path / "out"
    code = main(["bench", "--target", str(t5_folders["target"]), "--drafter", str(t5_folders["drafter"]),
                 "--methods", "ar,sd,pld,lossy,bild,cascade,via", "--mask", str(mask), "--dataset", "wmt14",
                 "--limit", "1", "--max-new-tokens", "6", "--dtype", "float32", "--no-nll", "--out", str(out),
                 "--no-progress"])
    assert code == 0, capsys.readouterr().err
    methods = json.loads((out / "summary.json").read_text())["methods"]
    assert {"ar", "sd", "pld", "lossy", "bild", "cascade", "via"} <= set(methods)
    assert all("bleu" in methods[name]["overall"] for name in ("ar", "via"))  # against the German references


def test_route_searches_a_decoder_mask_for_a_t5_folder(t5_folders, tmp_path, capsys):
    from tierspec.cli import main
    from tierspec.models import load_model

    out = tmp_path / "mask.json"
    code = main(["route", "--target", str(t5_folders["target"]), "--ratio", "0.3", "--unit", "layer", "--budget", "2",
                 "--bo-every", "2", "--calibration-prompts", "2", "--window", "4", "--dtype", "float32",
                 "--out", str(out), "--no-progress"])
    assert code == 0, capsys.readouterr().err
    mask = RoutingMask.load(out, load_model(t5_folders["target"]).identity)  # made for this model: accepted
    assert mask.num_layers == 3 and mask.bypassed_units() == [("layer", 1)]  # round(0.3 · 3); only layer 1 may go
    with pytest.raises(RoutingMaskError):
        RoutingMask.load(out, load_model(t5_folders["drafter"]).identity)


def test_bench_refuses_a_dataset_without_a_t5_task_format(t5_folders, tmp_path, capsys):
    from tierspec.cli import main

    code = main(["bench", "--target", str(t5_folders["target"]), "--methods", "ar", "--dataset", "gsm8k", "--limit", "1",
                 "--max-new-tokens", "2", "--out", str(tmp_path / "out"), "--no-progress"])
    assert code == 2
    assert "an encoder–decoder target runs the bench on xsum, cnn_dailymail, wmt14, not on 'gsm8k'" in capsys.readouterr().err
