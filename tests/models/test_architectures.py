"""Every covered architecture × block type, read from tiny random GGUF files (tests/arch_models.py)
and run by tierspec's own forward, against transformers' float32 modules on the de-quantised
weights: logits within a stated tolerance and the same greedy tokens; the de-quantised values
equal to gguf-py's exactly; routing masks, rollback, hidden states, token trees and the row
contract on each architecture; what is not covered said in one line."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from arch_models import ARCHS, BLOCK_TYPES, WINDOW, write_arch_gguf
from tierspec import models
from tierspec.architectures import UnsupportedArchitecture, read_architecture
from tierspec.cached_model import CachedModel
from tierspec.gguf_model import NotEnoughMemory, build_gguf_model
from tierspec.quant import QuantLinear, numerics_for, read_gguf_tensors

# 20 tokens: past the sliding window (8) of the mistral and gemma3 files
PROMPT = torch.tensor([3, 17, 99, 4, 250, 8, 8, 41, 77, 12, 5, 190, 33, 2, 91, 14, 60, 61, 7, 100])
# float32 everywhere; torch's operators agree with transformers' to float32 rounding (measured ≤ 1e-6 of
# the largest logit); the engine's fused layer sums in its own order (measured ≤ 1.9e-6, every architecture)
TOLERANCE = {"torch": 1e-5, "engine": 1e-5}
# Q5_0 as exact Q8_0 blocks (gguf_model.q8_0_rows_of_q5_0); Q4_K_M's layers mix Q4_K and Q6_K parts
ENGINE_TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q8_0", "Q4_K", "Q5_K", "Q6_K", "Q4_K_M")


def _build(tiny, numerics=True, dtype=torch.float32):
    tensors, fields = read_gguf_tensors(tiny.gguf)
    return build_gguf_model(tiny.gguf, tensors, fields, numerics_for(torch.float32) if numerics else None, dtype,
                            quiet=True)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("arch-gguf")
    cache = {}

    def get(arch: str, block_type: str):
        if (arch, block_type) not in cache:
            cache[(arch, block_type)] = write_arch_gguf(folder, arch, block_type, seed=ARCHS.index(arch))
        return cache[(arch, block_type)]

    return get


EXPECTED_FEATURES = {
    "llama3": [], "mistral": ["sliding_window"], "qwen2": ["qkv_bias"], "qwen3": ["qk_norm"],
    "gemma3": ["qk_norm", "post_norms", "gelu_tanh", "sliding_window", "layer_rope", "embedding_scale"],
    "phi3": ["partial_rotary"],
}


@pytest.mark.parametrize("arch", ARCHS)
def test_the_architecture_is_read_from_the_header_and_tensor_names(files, arch):
    tensors, fields = read_gguf_tensors(files(arch, "Q8_0").gguf)
    found = read_architecture(fields, tensors)
    assert found.features == EXPECTED_FEATURES[arch]
    assert found.engine_gaps() == []  # the engine's layer computes every covered architecture's features
    if arch == "gemma3":  # every sixth layer global, with the file's base and scaling; the others local
        assert found.windows == (WINDOW,) * 5 + (None,)
        assert found.layer_kinds == ("local",) * 5 + ("global",)
        assert found.rotaries["local"].theta == 10000.0 and found.rotaries["global"].linear == 2.0
        assert found.attention_scale == pytest.approx(64 ** -0.5) and found.embedding_scale == pytest.approx(16.0)
    if arch == "llama3":
        assert found.rotaries["global"].frequency_factors is not None and found.permuted_qk
    if arch == "phi3":
        assert found.fused_qkv and found.fused_gate_up and found.rotary_dims == 32 and not found.tied_embeddings


@pytest.mark.parametrize("block_type", BLOCK_TYPES)
@pytest.mark.parametrize("arch", ARCHS)
def test_logits_and_greedy_tokens_match_transformers(files, arch, block_type):
    tiny = files(arch, block_type)
    ours, reference = _build(tiny), tiny.reference()
    on_engine = ours.model.engine_stack is not None
    assert on_engine == (block_type in ENGINE_TYPES)  # every architecture, where its matrices are engine blocks
    with torch.inference_mode():
        runner = CachedModel(ours)
        logits = runner.forward(PROMPT).logits
        tokens = []
        for _ in range(6):  # cached one-token passes, greedy
            tokens.append(int(logits[-1].argmax()))
            logits = torch.cat((logits, runner.forward(torch.tensor(tokens[-1:])).logits))
        sequence = torch.cat((PROMPT, torch.tensor(tokens))).unsqueeze(0)
        expected = reference(sequence).logits[0]  # every row of the prompt and the greedy tokens
    scale = expected.abs().max()
    assert (logits - expected).abs().max() <= TOLERANCE["engine" if on_engine else "torch"] * scale
    assert logits[len(PROMPT) - 1 :].argmax(-1).tolist() == expected[len(PROMPT) - 1 :].argmax(-1).tolist()


@pytest.mark.parametrize("block_type", ["Q8_0", "Q4_0"])
@pytest.mark.parametrize("arch", ["gemma3", "qwen3", "llama3"])
def test_heads_of_256_match_transformers_on_the_engine(tmp_path, arch, block_type):
    """Gemma 3's head width (270M to 27B: 256) through the engine's vector attention."""
    tiny = write_arch_gguf(tmp_path, arch, block_type, seed=7, head_dim=256)
    ours, reference = _build(tiny), tiny.reference()
    assert ours.model.engine_stack is not None
    with torch.inference_mode():
        logits = CachedModel(ours).forward(PROMPT).logits
        expected = reference(PROMPT[None]).logits[0]
    assert (logits - expected).abs().max() <= TOLERANCE["engine"] * expected.abs().max()
    assert torch.equal(logits.argmax(-1), expected.argmax(-1))


@pytest.mark.parametrize("arch", ARCHS)
def test_a_batched_pass_gives_each_sequence_its_own_pass_bitwise(files, arch):
    """Sequences of several lengths in one engine pass (``cached_model.batched_pass``: each kind's
    rotary table over all rows, each sequence's window and tree by its own positions): every sequence
    gets its solo pass's logits and hidden states bitwise."""
    from tierspec.cached_model import BatchItem, batched_pass
    from tierspec.sampling import first_maxima
    from tierspec.tree import TokenTree, tree_pass

    model = _build(files(arch, "Q8_0"))
    prompts = [PROMPT, PROMPT[:5], PROMPT[3:15]]
    solo, shared = [CachedModel(model) for _ in prompts], [CachedModel(model) for _ in prompts]
    layout = tree_pass(torch.tensor([4]), TokenTree.from_paths([[5, 6, 7, 8, 9, 10, 11, 12, 13], [5, 7], [8]]))
    with torch.inference_mode():
        expected = [runner.forward(p).logits for runner, p in zip(solo, prompts)]
        got = batched_pass(model, [BatchItem(runner, p) for runner, p in zip(shared, prompts)])
        assert all(torch.equal(g.logits, e) for g, e in zip(got, expected))
        steps = [BatchItem(shared[0], layout.tokens, offsets=layout.offsets, attends=layout.attends),
                 BatchItem(shared[1], torch.tensor([3, 1, 4]), logits_for=2), BatchItem(shared[2], torch.tensor([7]))]
        expected = [solo[0].forward(layout.tokens, offsets=layout.offsets, attends=layout.attends, with_hidden=True,
                                    hidden_layers=(1,)),
                    solo[1].forward(torch.tensor([3, 1, 4]), logits_for=2, with_hidden=True, hidden_layers=(1,)),
                    solo[2].forward(torch.tensor([7]), with_hidden=True, hidden_layers=(1,))]
        got = batched_pass(model, steps, hidden_layers=(1,))
    for g, e in zip(got, expected):
        assert torch.equal(g.logits, e.logits) and torch.equal(g.hidden, e.hidden)
        direct = type(model.lm_head) is QuantLinear  # the product's maxima come with the engine's own head
        assert g.first_maxima == (first_maxima(g.logits) if direct else None)


def test_a_batched_pass_writes_hidden_states_where_a_sequence_asks_and_refuses_a_wrong_place(files):
    """``BatchItem.hidden_into`` (a generation's feature-log rows): the sequence's hidden states are
    written there, bitwise those a pass makes of its own, and its result's ``hidden`` is that tensor;
    the other sequence's are its own tensor. A place of the wrong shape or type is refused before the
    pass: no cache moves."""
    from tierspec.cached_model import BatchItem, batched_pass

    model = _build(files("llama3", "Q8_0"))
    width = int(model.config.hidden_size) * 2  # the final states and layer 1's
    with torch.inference_mode():
        plain = [CachedModel(model), CachedModel(model)]
        expected = batched_pass(model, [BatchItem(plain[0], PROMPT[:7]), BatchItem(plain[1], PROMPT[:4])], hidden_layers=(1,))
        log = torch.full((12, width), float("nan"))
        placed = [CachedModel(model), CachedModel(model)]
        got = batched_pass(model, [BatchItem(placed[0], PROMPT[:7], hidden_into=log[2:9]), BatchItem(placed[1], PROMPT[:4])],
                           hidden_layers=(1,))
        assert torch.equal(log[2:9], expected[0].hidden) and got[0].hidden.data_ptr() == log[2].data_ptr()
        assert torch.isnan(log[:2]).all() and torch.isnan(log[9:]).all()
        assert torch.equal(got[1].hidden, expected[1].hidden) and torch.equal(got[0].logits, expected[0].logits)
        across = torch.empty(width, 7).t()  # the right shape, not contiguous
        for wrong, layers in ((log[2:8], (1,)), (log[2:9, :-1], (1,)), (log[2:9].double(), (1,)), (across, (1,)),
                              (log[2:9], None)):
            fresh = CachedModel(model)
            with pytest.raises(ValueError, match="hidden states"):
                batched_pass(model, [BatchItem(fresh, PROMPT[:7], hidden_into=wrong)], hidden_layers=layers)
            assert fresh.length == 0 and fresh.cache.get_seq_length() == 0


@pytest.mark.parametrize("block_type", BLOCK_TYPES)
@pytest.mark.parametrize("numerics", [True, False])
def test_the_weights_are_gguf_pys_dequantised_values_exactly(files, block_type, numerics):
    tiny = files("qwen3", block_type)  # no row permutation: each projection is its tensors stacked
    model = _build(tiny, numerics)
    layer = model.model.layers[1]
    stored = tiny.stored
    np.testing.assert_array_equal(layer.self_attn.qkv_proj.weight.detach().numpy(),
                                  np.concatenate([stored[f"blk.1.attn_{p}.weight"] for p in "qkv"]))
    np.testing.assert_array_equal(layer.mlp.gate_up_proj.weight.detach().numpy(),
                                  np.concatenate([stored["blk.1.ffn_gate.weight"], stored["blk.1.ffn_up.weight"]]))
    np.testing.assert_array_equal(layer.mlp.down_proj.weight.detach().numpy(), stored["blk.1.ffn_down.weight"])
    np.testing.assert_array_equal(model.model.embed_tokens.weight.detach().numpy(), stored["token_embd.weight"])
    assert isinstance(layer.mlp.down_proj, QuantLinear) == (numerics and block_type in ENGINE_TYPES)


def test_llama_rows_are_put_back_in_transformers_order(files):
    tiny = files("llama3", "Q4_K")
    model = _build(tiny)
    reference = tiny.reference_weights
    q, k, v = model.model.layers[0].self_attn.qkv_proj.weight.detach().split([256, 128, 128])
    assert torch.equal(q, reference["model.layers.0.self_attn.q_proj.weight"])
    assert torch.equal(k, reference["model.layers.0.self_attn.k_proj.weight"])
    assert not torch.equal(q, torch.from_numpy(tiny.stored["blk.0.attn_q.weight"]))  # the file's order differs


def _loaded(tiny):
    """The model as ``load_model`` gives it (routing, packed kernels), float32."""
    return models.load_model(tiny.gguf, dtype=torch.float32).model


def test_a_q4_k_m_file_runs_every_matrix_on_the_engine(files, tmp_path, monkeypatch):
    """llama.cpp's Q4_K_M mix (q/k Q4_K beside v Q6_K in one layer, the tied head Q6_K): every
    projection and the head the file's blocks, each layer one engine call, the values exactly
    gguf-py's (a fused projection stacks its parts of different types)."""
    monkeypatch.setenv("TIERSPEC_CACHE", str(tmp_path / "cache"))
    tiny = files("llama3", "Q4_K_M")
    model = models.load_model(tiny.gguf, dtype=torch.float32).model
    decoder = model.model
    assert decoder.engine_stack is not None and all(layer.fused is not None for layer in decoder.layers)
    projections = [module for layer in decoder.layers for module in
                   (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)]
    assert all(isinstance(p, QuantLinear) for p in projections) and isinstance(model.lm_head, QuantLinear)
    assert model.lm_head.qweight.type_name == "Q6_K"
    types = [layer.self_attn.qkv_proj.qweight.type_name for layer in decoder.layers]
    assert types == ["Q4_K", "Q4_K", "Q4_K+Q6_K"]  # of 3 layers the last gets more bits
    assert [layer.mlp.down_proj.qweight.type_name for layer in decoder.layers] == ["Q4_K", "Q4_K", "Q6_K"]
    reference = tiny.reference_weights
    for i in (1, 2):
        stacked = torch.cat([reference[f"model.layers.{i}.self_attn.{p}_proj.weight"] for p in "qkv"])
        assert torch.equal(decoder.layers[i].self_attn.qkv_proj.weight, stacked)


@pytest.fixture(scope="module", params=[(a, b) for a in ARCHS for b in ("Q8_0", "Q4_K")] + [("llama3", "Q4_K_M")],
                ids=lambda p: "-".join(p))
def loaded(request, files, tmp_path_factory):
    import os

    previous = os.environ.get("TIERSPEC_CACHE")
    os.environ["TIERSPEC_CACHE"] = str(tmp_path_factory.mktemp("cache"))
    try:
        tiny = files(*request.param)
        yield tiny, _loaded(tiny)
    finally:
        if previous is None:
            os.environ.pop("TIERSPEC_CACHE")
        else:
            os.environ["TIERSPEC_CACHE"] = previous


def test_a_tokens_logits_do_not_depend_on_its_pass(loaded):
    _, model = loaded
    runner = CachedModel(model)
    with torch.inference_mode():
        whole = runner.forward(PROMPT).logits
        runner.rollback(0)
        pieces = torch.cat([runner.forward(PROMPT[i : i + 1]).logits for i in range(len(PROMPT))])
        runner.rollback(9)
        middle = runner.forward(PROMPT[9:14]).logits
    assert torch.equal(whole, pieces)
    assert torch.equal(middle, whole[9:14])


def test_rollback_and_hidden_states(loaded):
    tiny, model = loaded
    reference = tiny.reference()
    with torch.inference_mode():
        ours = CachedModel(model).forward(PROMPT, with_hidden=True, hidden_layers=(1,)).hidden
        theirs = CachedModel(reference).forward(PROMPT, with_hidden=True, hidden_layers=(1,)).hidden
        assert (ours - theirs).abs().max() <= 1e-4 * theirs.abs().max()
        runner = CachedModel(model)
        runner.forward(PROMPT)
        runner.rollback(11)
        assert set(runner.layer_lengths()) == {11}
        again = runner.forward(PROMPT[11:]).logits
        assert torch.equal(again, CachedModel(model).forward(PROMPT).logits[11:])


@pytest.mark.parametrize("units", [[("attn", 1)], [("mlp", 1)], [("layer", 1)]])
def test_a_bypassed_unit_is_skipped_as_on_transformers(loaded, units):
    from tierspec.layerskip.masks import RoutingMask

    tiny, model = loaded
    reference = tiny.reference()
    mask = RoutingMask.from_units(tiny.layers, "layer" if units[0][0] == "layer" else "sublayer", units)
    with torch.inference_mode():
        ours = CachedModel(model).forward(PROMPT, mask=mask).logits
        theirs = CachedModel(reference).forward(PROMPT, mask=mask).logits
        full = CachedModel(model).forward(PROMPT).logits
    assert (ours - theirs).abs().max() <= 1e-4 * theirs.abs().max()
    assert (ours - full).abs().max() > 1e-3  # the mask changed something


def test_a_tree_node_gets_its_chains_logits_bitwise(loaded):
    from tierspec.tree import TokenTree, tree_pass

    _, model = loaded
    runner = CachedModel(model)
    paths = [[11, 12, 13], [11, 40], [60, 61, 62, 63], [11, 12, 99]]
    tree = TokenTree.from_paths(paths)

    def node_row(prefix):  # the pass row of the node reached by ``prefix`` (after the one pending row)
        node = -1
        for token in prefix:
            node = next(i for i in range(len(tree)) if int(tree.parents[i]) == node and int(tree.tokens[i]) == token)
        return 1 + node

    with torch.inference_mode():
        runner.forward(PROMPT)  # past the sliding window: the tree's rows see windows of their own position
        layout = tree_pass(torch.tensor([5]), tree)
        tree_logits = runner.forward(layout.tokens, offsets=layout.offsets, attends=layout.attends).logits
        runner.rollback(len(PROMPT))
        for path in paths:
            chain = runner.forward(torch.tensor([5] + path)).logits
            runner.rollback(len(PROMPT))
            rows = [node_row(path[: depth + 1]) for depth in range(len(path))]
            assert torch.equal(tree_logits[rows], chain[1:])
            assert torch.equal(tree_logits[0], chain[0])


def test_an_uncached_batch_equals_cached_passes(loaded):
    """The mask search runs uncached batches: each row's causal (and windowed) mask as in a cached pass."""
    _, model = loaded
    with torch.inference_mode():
        batch = model(PROMPT.repeat(2, 1), use_cache=False).logits
        cached = CachedModel(model).forward(PROMPT).logits
    assert (batch[1] - cached).abs().max() <= 1e-5 * cached.abs().max()


def test_an_uncovered_architecture_goes_to_transformers_with_a_note(files, tmp_path, capsys):
    from gguf import GGUFWriter

    path = tmp_path / "falcon.gguf"
    writer = GGUFWriter(str(path), "falcon")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((8, 32), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tensors, fields = read_gguf_tensors(path)
    with pytest.raises(UnsupportedArchitecture, match="architecture 'falcon' is not one of tierspec's"):
        read_architecture(fields, tensors)
    parsed: list = []
    assert models._load_gguf_architecture(path, "falcon", torch.float32, "auto", "auto", torch.device("cpu"),
                                          parsed) is None
    note = capsys.readouterr().err.strip()
    assert note == ("tierspec: falcon.gguf runs on transformers' modules, not tierspec's forward or the pass engine: "
                    "architecture 'falcon' is not one of tierspec's (llama, qwen2, qwen3, gemma3, phi3)")
    assert parsed  # the header read is handed on, not read again
    with pytest.raises(models.ImplementationError, match="--implementation tierspec cannot run falcon.gguf"):
        models._load_gguf_architecture(path, "falcon", torch.float32, "tierspec", "auto", torch.device("cpu"), [])


def test_gemma3_runs_on_the_engine_and_a_feature_it_lacked_would_be_said(files, tmp_path, monkeypatch, capsys):
    from tierspec import architectures

    monkeypatch.setenv("TIERSPEC_CACHE", str(tmp_path / "cache"))
    loaded = models.load_model(files("gemma3", "Q8_0").gguf, dtype=torch.float32)
    assert type(loaded.model.model).__name__ == "ArchDecoder" and loaded.tokenizer is None
    assert loaded.model.model.engine_stack is not None
    assert "pass engine" not in capsys.readouterr().err
    # the layers stay on torch's operators where the engine's layer lacks a feature, said in one line
    monkeypatch.setattr(architectures, "ENGINE_FEATURES", architectures.ENGINE_FEATURES - {"post_norms", "layer_rope"})
    loaded = models.load_model(files("gemma3", "Q8_0").gguf, dtype=torch.float32)
    assert loaded.model.model.engine_stack is None
    assert ("tierspec: gemma3 layers run on torch's operators, not the pass engine: the engine's layer lacks "
            "post_norms, layer_rope (docs/models.md)") in capsys.readouterr().err


def test_a_model_larger_than_the_memory_is_refused_before_loading(files, monkeypatch):
    from tierspec import gguf_model

    tiny = files("qwen2", "F16")
    monkeypatch.setattr(gguf_model, "available_memory", lambda: 1_000_000)
    tensors, fields = read_gguf_tensors(tiny.gguf)
    with pytest.raises(NotEnoughMemory) as error:
        build_gguf_model(tiny.gguf, tensors, fields, numerics_for(torch.float32), torch.float32, quiet=True)
    message = str(error.value)
    assert "\n" not in message
    # F16 matrices de-quantised to float32: 3 layers of 589,824 weights, the 65,536-value table and
    # 3,328 norm and bias values, 4 bytes each: 7.35 MB
    assert message == ("qwen2-F16.gguf needs about 7.4 MB of memory (0.0 MB of blocks kept, 7.4 MB de-quantised "
                       "to float32), and this machine has 1.0 MB available")
    # Q4_K kept as blocks: 144 bytes per 256 weights (the cells 2368 per 4096, about the same)
    kept, dequantised = gguf_model.memory_needed(read_gguf_tensors(files("qwen2", "Q4_K").gguf)[0],
                                                 numerics_for(torch.float32), torch.float32)
    assert kept == (3 * 589_824 + 65_536) // 256 * 144 and dequantised == 3_328 * 4


def test_a_tensor_of_the_wrong_shape_is_a_clear_error(files, tmp_path):
    tiny = files("qwen3", "Q8_0")
    tensors, fields = read_gguf_tensors(tiny.gguf)
    fields = dict(fields, **{"qwen3.feed_forward_length": 256})
    with pytest.raises(models.ModelLoadError, match=r"tensor 'blk.0.ffn_gate.weight' has shape \[512, 256\], "
                                                    r"its architecture implies \[256, 256\]"):
        build_gguf_model(tiny.gguf, tensors, fields, numerics_for(torch.float32), torch.float32, quiet=True)


def test_the_load_names_the_types_it_dequantises(files):
    from tierspec.gguf_model import dequantised_note

    tiny = files("llama3", "F16")
    tensors, _ = read_gguf_tensors(tiny.gguf)
    assert dequantised_note(tiny.gguf, tensors, numerics_for(torch.float32), torch.float32) == (
        "tierspec: llama3-F16.gguf: 22 of 22 matrices de-quantised at load to float32 (22 F16; the embedding table "
        "F16 de-quantised to float32): the engine multiplies Q4_0, Q4_1, Q4_K, Q5_K, Q6_K, Q8_0 (and Q5_0 as "
        "Q8_0) blocks only")
    for block_type in ("Q5_0", "Q4_K_M"):
        tensors = read_gguf_tensors(files("llama3", block_type).gguf)[0]
        assert dequantised_note(files("llama3", block_type).gguf, tensors, numerics_for(torch.float32),
                                torch.float32) is None
