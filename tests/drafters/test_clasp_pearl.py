"""CLaSP (layer selection by dynamic programming, in context) and PEARL (drafting during the
target's pass, in a thread), with VIA-SD + PEARL: docs/algorithms.md §CLaSP, §PEARL."""

import pytest
import torch
from conftest import as_method, run_ids, tiny_llama
from transformers import LlamaConfig, LlamaForCausalLM

from tierspec.layerskip.clasp import select_in_context, select_skips
from tierspec.decode import DecodeConfig, decode
from tierspec.drafters import ModelDrafter, NoDrafter
from tierspec.drafters.pearl import PearlDrafter
from tierspec.errors import TierspecError
from tierspec.methods import MethodOptionError, MethodOptions, build_method
from tierspec.cached_model import CachedModel
from tierspec.models import load_model
from tierspec.policies import FixedLength
from tierspec.layerskip.masks import RoutingMask, masked_copy
from tierspec.rules import ExactRule
from tierspec.rules.via import ViaRule
from tierspec.sampling import SamplingConfig, logits_to_probs

PROMPT = torch.tensor([5, 9, 13, 5, 9, 13, 7, 21, 5, 9, 13, 7, 3, 30, 41])


def own_llama(tmp_path_factory, layers: int, seed: int, identity_attention=(), identity_mlp=(), sharpness=20.0):
    """A random Llama on tierspec's own forward (float64), with the attention blocks of layers
    ``identity_attention`` and the MLP blocks of ``identity_mlp`` made identities (their output
    projections zero: they add nothing to the residual stream)."""
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         tie_word_embeddings=False, bos_token_id=0, eos_token_id=None, pad_token_id=None)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(sharpness)
        for i in identity_attention:
            model.model.layers[i].self_attn.o_proj.weight.zero_()
        for i in identity_mlp:
            model.model.layers[i].mlp.down_proj.weight.zero_()
    folder = tmp_path_factory.mktemp("clasp-llama") / "m"
    model.save_pretrained(folder)
    return load_model(folder, dtype="float64", implementation="tierspec")


# ---- CLaSP's dynamic programme ---------------------------------------------------------------

def test_the_programme_bypasses_exactly_the_identity_units_of_a_chain():
    """Residual units h ← h + W_u h with W_u = 0 for the planted units: with a budget of as many
    skips, the selected path reaches the full model's final state exactly (cosine 1)."""
    torch.manual_seed(0)
    weights = [torch.randn(16, 16, dtype=torch.float64) * 0.3 for _ in range(10)]
    planted = {2, 5, 6}
    for u in planted:
        weights[u].zero_()
    apply = lambda u, states: states + states @ weights[u].T  # noqa: E731
    skipped, score = select_skips(apply, torch.randn(16, dtype=torch.float64), 10, set(range(1, 9)), budget=3)
    assert skipped == [2, 5, 6] and score == pytest.approx(1.0, abs=1e-12)
    # one skip more must cost something, and one fewer is still exact
    more, more_score = select_skips(apply, torch.randn(16, dtype=torch.float64), 10, set(range(1, 9)), budget=4)
    assert set(more) > planted and more_score < 1.0 - 1e-6
    fewer, fewer_score = select_skips(apply, torch.randn(16, dtype=torch.float64), 10, set(range(1, 9)), budget=2)
    assert set(fewer) < planted and fewer_score == pytest.approx(1.0, abs=1e-12)


def test_the_programme_never_bypasses_a_unit_outside_the_skippable_set():
    weights = [torch.zeros(4, 4, dtype=torch.float64) for _ in range(4)]  # every unit an identity
    apply = lambda u, states: states + states @ weights[u].T  # noqa: E731
    skipped, _ = select_skips(apply, torch.ones(4, dtype=torch.float64), 4, {1, 2}, budget=2)
    assert skipped == [1, 2]
    with pytest.raises(TierspecError, match="cannot bypass 3 units"):
        select_skips(apply, torch.ones(4, dtype=torch.float64), 4, {1, 2}, budget=3)


@pytest.mark.parametrize("unit, planted", [
    ("sublayer", [("attn", 2), ("attn", 3), ("mlp", 1), ("mlp", 4)]),
    ("layer", [("layer", 2), ("layer", 3)]),
])
def test_in_context_selection_skips_the_models_identity_units_and_restores_the_cache(tmp_path_factory, unit, planted):
    attention = [i for kind, i in planted if kind in ("attn", "layer")]
    mlp = [i for kind, i in planted if kind in ("mlp", "layer")]
    target = own_llama(tmp_path_factory, 6, seed=4, identity_attention=attention, identity_mlp=mlp)
    runner = CachedModel(target.model)
    tokens = torch.randint(0, 64, (12,), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        runner.forward(tokens)
        before = [(layer.keys.clone(), layer.values.clone()) for layer in runner.cache.layers]
        mask, score = select_in_context(runner, 11, int(tokens[11]), unit, len(planted))
    assert mask.bypassed_units() == planted and score == pytest.approx(1.0, abs=1e-9)
    assert runner.length == 12
    for (keys, values), layer in zip(before, runner.cache.layers):
        assert torch.equal(keys, layer.keys) and torch.equal(values, layer.values)


def test_the_selected_cosine_is_the_masked_pass_state_on_the_full_models_prefix(tmp_path_factory):
    """The programme's candidate for the chosen set is what a masked pass of the token computes
    on top of the full model's cached prefix (the paper's approximation, made exactly)."""
    target = own_llama(tmp_path_factory, 5, seed=6)
    runner = CachedModel(target.model)
    tokens = torch.randint(0, 64, (9,), generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        runner.forward(tokens)
        mask, score = select_in_context(runner, 8, int(tokens[8]), "sublayer", 3)
        final = {}
        decoder = target.model.get_decoder()

        def keep(module, args, out):  # the last layer's output: the state the programme compares
            final["h"] = out[0, -1].clone()

        hook = decoder.layers[-1].register_forward_hook(keep)
        with runner.set_aside(8):
            runner.forward(tokens[8:9], mask=mask)
            masked = final.pop("h")
            runner.rollback(8)
            runner.forward(tokens[8:9])
            full = final.pop("h")
        hook.remove()
    assert float(torch.nn.functional.cosine_similarity(masked, full, dim=0)) == pytest.approx(score, abs=1e-9)


def test_clasp_greedy_equals_ar_and_keeps_the_cache_invariant(tmp_path_factory):
    target = own_llama(tmp_path_factory, 4, seed=5)
    reference = run_ids(target, as_method(NoDrafter()), PROMPT, 40)
    method = build_method("clasp", target, options=MethodOptions(clasp_interval=2, confidence_threshold=0.0, num_draft=3))

    drafters = set()

    def inspect(verifiers, drafter):
        assert verifiers.runner.layer_lengths() == [len(verifiers.context) - 1] * 4
        drafters.add(drafter)

    assert run_ids(target, method, PROMPT, 40, inspect=inspect) == reference
    (drafter,) = drafters  # the generation's own
    assert drafter.selections > 3 and not drafter.mask.empty


def test_clasp_refuses_a_model_on_transformers_modules(tiny_target):
    method = build_method("clasp", tiny_target, options=MethodOptions(num_draft=2))
    with pytest.raises(TierspecError, match="implementation='tierspec'"):
        run_ids(tiny_target, method, PROMPT, 8)


# ---- the shared-weight masked copy PEARL drafts with -----------------------------------------

def test_a_masked_copy_shares_every_weight_and_computes_the_masked_pass(tiny_target):
    mask = RoutingMask.from_units(4, "sublayer", [("mlp", 1), ("attn", 2)])
    twin = masked_copy(tiny_target.model, mask)
    assert {p.data_ptr() for p in twin.parameters()} <= {p.data_ptr() for p in tiny_target.model.parameters()}
    tokens = torch.tensor([3, 17, 42, 8, 8, 19])
    with torch.inference_mode():
        expected = CachedModel(tiny_target.model).forward(tokens, mask=mask).logits
        assert torch.equal(CachedModel(twin).forward(tokens).logits, expected)
        # the original keeps every module: its unmasked pass differs from the masked one
        assert not torch.allclose(CachedModel(tiny_target.model).forward(tokens).logits, expected)


# ---- PEARL -----------------------------------------------------------------------------------

MASK = RoutingMask.from_units(4, "sublayer", [("mlp", 1)])


@pytest.mark.parametrize("gamma", [1, 2, 3, 5])
@pytest.mark.parametrize("threads", [0, 1])
def test_pearl_greedy_equals_ar(tiny_target, gamma, threads):
    reference = run_ids(tiny_target, as_method(NoDrafter()), PROMPT, 50)
    method = build_method("pearl", tiny_target, options=MethodOptions(mask=MASK, pearl_gamma=gamma, pearl_threads=threads))
    steps, drafters = [], set()
    assert run_ids(tiny_target, method, PROMPT, 50, on_step=steps.append,
                   inspect=lambda verifiers, drafter: drafters.add(drafter)) == reference
    (drafter,) = drafters  # the generation's own
    assert drafter.kept_ahead > 3  # blocks drafted during the previous pass were used
    assert max(step.cycle.accepted for step in steps) == gamma


def test_pearl_puts_the_loops_thread_count_back(tiny_target):
    before = torch.get_num_threads()
    method = build_method("pearl", tiny_target, options=MethodOptions(mask=MASK, pearl_gamma=3, pearl_threads=1))
    run_ids(tiny_target, method, PROMPT, 20)
    assert torch.get_num_threads() == before


def test_pearl_with_an_independent_drafter_model_equals_ar(tiny_target, tiny_drafter):
    reference = run_ids(tiny_target, as_method(NoDrafter()), PROMPT, 40)
    method = build_method("pearl", tiny_target, tiny_drafter, MethodOptions(pearl_gamma=3))
    assert run_ids(tiny_target, method, PROMPT, 40) == reference


@pytest.mark.parametrize("sampling_rule", ["coupled", "residual"])
def test_pearl_same_seed_same_text_whatever_the_timing(tiny_target, sampling_rule):
    """The drafts do not depend on the threads' timing: overlapped, sequential and repeated runs
    give one text per seed (and under the coupled rule, ar's text for that seed)."""
    sampling = SamplingConfig(1.0)
    texts = []
    for threads in (1, 0, 1):
        method = build_method("pearl", tiny_target, options=MethodOptions(mask=MASK, pearl_gamma=3, pearl_threads=threads,
                                                                          sampling_rule=sampling_rule))
        texts.append(run_ids(tiny_target, method, PROMPT, 40, sampling=sampling, generator=11))
    assert texts[0] == texts[1] == texts[2]
    if sampling_rule == "coupled":
        assert texts[0] == run_ids(tiny_target, as_method(NoDrafter()), PROMPT, 40, sampling=sampling, generator=11)


def test_pearl_tokens_have_the_targets_joint_distribution():
    """Residual rule (the drafts matter): the first three tokens over seeds, the third often a
    draft made during the pass that verified the first (post-verify), against
    q(y1)·q(y2|y1)·q(y3|y1,y2). The drafter runs without the thread (``threads=0``: the same
    drafts and kept blocks, made before the pass): 5000 generations with a thread handing over
    each block take minutes on a busy machine, and that the thread changes no draft is
    ``test_pearl_same_seed_same_text_whatever_the_timing``'s check."""
    from distributions import pooled_chi_square_p_value

    target = tiny_llama(seed=11, vocab_size=5, layers=2, hidden=16, sharpness=4.0)
    drafter = tiny_llama(seed=12, vocab_size=5, layers=1, hidden=16, sharpness=4.0)
    prompt = torch.tensor([1, 2, 3, 4])
    sampling = SamplingConfig(1.0)

    def q(prefix):
        with torch.inference_mode():
            return logits_to_probs(target.model(torch.tensor(prefix)[None]).logits[0, -1], sampling).double()

    base = prompt.tolist()
    joint = torch.zeros(125, dtype=torch.float64)
    first = q(base)
    for a in range(5):
        second = q(base + [a])
        for b in range(5):
            joint[a * 25 + b * 5: a * 25 + b * 5 + 5] = first[a] * second[b] * q(base + [a, b])
    pearl = PearlDrafter(ModelDrafter(drafter.model), gamma=2, threads=0)
    method = as_method(pearl, ExactRule("residual"), FixedLength(3))
    counts = torch.zeros(125)
    ahead = 0
    for seed in range(5000):
        out = []
        for step in decode(target, method, prompt, DecodeConfig(max_new_tokens=4, sampling=sampling), seed):
            out.extend(step.new_tokens)
        counts[out[0] * 25 + out[1] * 5 + out[2]] += 1
        ahead += pearl.kept_ahead
    assert ahead > 500  # post-verified blocks were part of the runs
    assert pooled_chi_square_p_value(counts, joint) > 1e-3


def test_via_pearl_with_the_full_target_deciding_everything_equals_ar(tiny_target):
    """VIA-SD + PEARL: PEARL's drafter under the VIA rule; with α1 = α2 = 0 and δ2 forced to 1
    the VIA rule is exact speculative decoding, so the text is ar's."""
    reference = run_ids(tiny_target, as_method(NoDrafter()), PROMPT, 40)
    slim = RoutingMask.from_units(4, "sublayer", [("attn", 2)])
    drafter = PearlDrafter(ModelDrafter(masked_copy(tiny_target.model, MASK), tiny_target.vocab_size), gamma=3)
    method = as_method(drafter, ViaRule(0.0, 0.0, 12, force_full=True), FixedLength(4), slim_mask=slim)
    assert run_ids(tiny_target, method, PROMPT, 40) == reference
    assert drafter.kept_ahead > 0


def test_via_pearl_method_runs_its_three_tiers(tiny_target):
    slim = RoutingMask.from_units(4, "sublayer", [("attn", 2)])
    method = build_method("via-pearl", tiny_target, options=MethodOptions(mask=slim, draft_mask=MASK, pearl_gamma=3,
                                                                          alpha2=0.9))
    steps = []
    run_ids(tiny_target, method, PROMPT, 40, on_step=steps.append)
    assert sum(step.cycle.slim_calls for step in steps) > 0 and sum(step.cycle.target_calls for step in steps) > 0
    assert method.rule.name == "via" and method.slim_mask == slim


def test_pearl_methods_refuse_missing_masks_and_bad_options(tiny_target):
    from tierspec.methods import MissingMaskError

    with pytest.raises(MissingMaskError, match="--draft-mask"):
        build_method("pearl", tiny_target)
    with pytest.raises(MissingMaskError, match="--draft-mask"):
        build_method("via-pearl", tiny_target, options=MethodOptions(mask=MASK))
    with pytest.raises(MethodOptionError, match="pearl_gamma"):
        MethodOptions(pearl_gamma=0)
    with pytest.raises(MethodOptionError, match="clasp_ratio"):
        MethodOptions(clasp_ratio=1.0)
    with pytest.raises(TierspecError, match="own"):
        from tierspec.drafters.self_spec import SelfSpeculativeDrafter

        PearlDrafter(SelfSpeculativeDrafter(MASK), gamma=2)
