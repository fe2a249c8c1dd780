"""tierspec's own Llama forward pass (``tierspec.llama``) against transformers' LlamaForCausalLM,
and the tokenizer read straight from tokenizer.json (``tierspec.tokenizer``)."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import char_tokenizer, write_spec_bench
from transformers import LlamaConfig, LlamaForCausalLM

from tierspec.api import generate
from tierspec.cached_model import CachedModel, SlimVocabulary
from tierspec.decode import DecodeConfig, decode
from tierspec.llama import LlamaLM, supports
from tierspec.methods import MethodOptions, build_method
from tierspec.models import ModelLoadError, load_model
from tierspec.layerskip.masks import RoutingMask, apply_mask
from tierspec.sampling import SamplingConfig


def _save_tiny(folder, seed=0, tie=False, **overrides):
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=56, hidden_size=32, intermediate_size=64, num_hidden_layers=5,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         tie_word_embeddings=tie, bos_token_id=0, eos_token_id=None, pad_token_id=None,
                         rope_theta=500.0, **overrides)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(4.0)  # peaked distributions: greedy paths without near-ties
    model.save_pretrained(folder)
    char_tokenizer().save_pretrained(folder)
    return folder


@pytest.fixture(scope="module", params=[False, True], ids=["separate-head", "tied-head"])
def pair(request, tmp_path_factory):
    """The same random model on tierspec's code and on transformers' modules (float64)."""
    folder = _save_tiny(tmp_path_factory.mktemp("llama") / "m", tie=request.param)
    own = load_model(folder, dtype="float64", implementation="tierspec")
    theirs = load_model(folder, dtype="float64", implementation="transformers")
    assert isinstance(own.model, LlamaLM) and isinstance(theirs.model, LlamaForCausalLM)
    return own, theirs


IDS = torch.tensor([3, 9, 17, 4, 22, 8, 31, 5, 12, 40, 2, 7])
# transformers computes RMSNorm in float32 even in a float64 model, and both compute the rotary
# factors in float32 (tierspec once per position, in a table); so float64 logits agree to float32
# rounding (observed 2.4e-7), not to float64's. A real difference (a wrong mask, position,
# rollback or weight) is of order 1e-2 or more.
ATOL = 1e-6


def _passes(loaded, mask=None, vocabulary_ids=None):
    """As a verifier tier uses its cache (every pass under the tier's mask): a prefill, a
    3-token chunk, a rollback, a 2-token chunk with hidden states and two decoder layers'
    outputs, then a replay; every output and the layers' cache lengths."""
    cache = CachedModel(loaded.model)
    vocabulary = SlimVocabulary(loaded.model, vocabulary_ids) if vocabulary_ids is not None else None
    with torch.inference_mode():
        outs = [cache.forward(IDS[:7], mask=mask).logits]
        outs.append(cache.forward(IDS[7:10], mask=mask, vocabulary=vocabulary).logits)
        cache.rollback(8)
        result = cache.forward(IDS[8:10], mask=mask, with_hidden=True, hidden_layers=(1, 3))
        outs += [result.logits, result.hidden, cache.replay(5, IDS[5:9], mask=mask)]
        outs.append(torch.tensor(cache.layer_lengths(), dtype=torch.float64))
    return outs


def _self_draft_passes(loaded, mask):
    """As a self-drafter uses the target's cache: full prefill, two 1-token passes under the mask
    (bypassed layers fall behind), a rollback, a full 2-token pass."""
    cache = CachedModel(loaded.model)
    with torch.inference_mode():
        outs = [cache.forward(IDS[:7]).logits, cache.forward(IDS[7:8], mask=mask).logits, cache.forward(IDS[8:9], mask=mask).logits]
        lengths = cache.layer_lengths()
        cache.rollback(7)
        outs.append(cache.forward(IDS[7:9]).logits)
    return outs + [torch.tensor(lengths + cache.layer_lengths(), dtype=torch.float64)]


@pytest.mark.parametrize("mask", [None, "sublayer", "layer"])
def test_same_logits_hidden_states_masks_and_cache_as_transformers(pair, mask):
    own, theirs = pair
    if mask == "sublayer":
        mask = RoutingMask(5, "sublayer", skip_attention={1, 3}, skip_mlp={2})
    elif mask == "layer":
        mask = RoutingMask(5, "layer", skip_attention={2}, skip_mlp={2})
    for a, b in zip(_passes(own, mask), _passes(theirs, mask), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=ATOL)
    if mask is not None:
        for a, b in zip(_self_draft_passes(own, mask), _self_draft_passes(theirs, mask), strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=ATOL)


def test_same_slim_vocabulary_logits_and_uncached_forward(pair):
    own, theirs = pair
    keep = torch.tensor([0, 3, 5, 9, 22, 40])
    mask = RoutingMask(5, "sublayer", skip_attention={2}, skip_mlp={1, 3})
    for a, b in zip(_passes(own, mask, keep), _passes(theirs, mask, keep), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=ATOL)
    ids = torch.tensor([[1, 4, 9, 16, 25]])
    with torch.inference_mode():
        torch.testing.assert_close(own.model(input_ids=ids, use_cache=False, logits_to_keep=2).logits,
                                   theirs.model(input_ids=ids, use_cache=False, logits_to_keep=2).logits,
                                   rtol=0, atol=ATOL)


def test_masks_fit_both_implementations_and_weights_stay_shared(pair):
    """A bypassed unit changes the output, and applying a mask leaves the model as it was."""
    own, _ = pair
    before = {name: tensor.clone() for name, tensor in own.model.state_dict().items()}
    plain = _passes(own)[1]
    masked = _passes(own, RoutingMask(5, "layer", skip_attention={2}, skip_mlp={2}))[1]
    assert not torch.allclose(plain, masked)
    with apply_mask(own.model, RoutingMask(5, "sublayer", skip_attention={1})):
        pass
    assert all(torch.equal(before[name], tensor) for name, tensor in own.model.state_dict().items())
    assert own.identity == pair[1].identity  # masks and heads made with one fit the other


def test_greedy_generation_equals_transformers_and_speculation_equals_ar(pair):
    own, theirs = pair
    prompt = torch.tensor([5, 9, 2, 5, 9, 2, 5, 9])
    config = DecodeConfig(24, SamplingConfig(0.0))
    outputs = {}
    for label, loaded in (("own", own), ("theirs", theirs)):
        for name in ("ar", "pld"):
            method = build_method(name, loaded, None, MethodOptions())
            outputs[label, name] = [t for step in decode(loaded, method, prompt, config) for t in step.new_tokens]
    assert outputs["own", "ar"] == outputs["theirs", "ar"] == outputs["own", "pld"]
    assert len(outputs["own", "ar"]) == 24


@pytest.mark.parametrize("kernels", ["auto", "stock", "few-row"])
def test_bfloat16_stays_close_to_transformers(tmp_path, kernels):
    """With every kernel kind: the float32 attention output goes back to bfloat16 before o_proj."""
    folder = _save_tiny(tmp_path / "m")
    own = load_model(folder, dtype="bfloat16", implementation="tierspec", kernels=kernels)
    theirs = load_model(folder, dtype="bfloat16", implementation="transformers")
    assert own.model.dtype == torch.bfloat16
    a, b = _passes(own)[0], _passes(theirs)[0]
    torch.testing.assert_close(a, b, rtol=0, atol=0.05 * float(b.abs().max()))


def test_auto_falls_back_to_transformers_and_tierspec_refuses_what_it_does_not_cover(tmp_path):
    folder = _save_tiny(tmp_path / "biased", attention_bias=True)
    assert isinstance(load_model(folder).model, LlamaForCausalLM)
    with pytest.raises(ModelLoadError, match="--implementation tierspec cannot run .*biases"):
        load_model(folder, implementation="tierspec")
    with pytest.raises(ModelLoadError, match="unknown implementation"):
        load_model(folder, implementation="jax")
    assert "not 'llama'" in supports({"model_type": "mistral"})
    assert "rope type 'llama3'" in supports({"model_type": "llama", "rope_parameters": {"rope_type": "llama3"}})
    assert supports({"model_type": "llama", "rope_parameters": {"rope_type": "default", "rope_theta": 1e4}}) is None


def test_weights_that_do_not_fit_the_config_are_a_clear_error(tmp_path):
    from safetensors.torch import load_file, save_file

    folder = _save_tiny(tmp_path / "m")
    weights = load_file(folder / "model.safetensors")
    weights["model.layers.1.mlp.up_proj.weight"] = weights["model.layers.1.mlp.up_proj.weight"][:, :16].contiguous()
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match="up_proj.weight has shape"):
        load_model(folder, implementation="tierspec")
    del weights["model.layers.1.mlp.up_proj.weight"]
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match="missing"):
        load_model(folder, implementation="tierspec")


def test_the_bench_runs_hf_peers_on_a_transformers_twin(tmp_path):
    """tierspec's methods on its own code, hf-* on transformers' modules, in one run: the same
    greedy tokens."""
    from tierspec.bench.runner import BenchConfig, read_records, run_bench

    folder = _save_tiny(tmp_path / "m")
    data = write_spec_bench(tmp_path / "data", {"qa": [f"what is {i} plus {i}?" for i in range(2)]})
    config = BenchConfig(target=str(folder), methods=("ar", "hf-greedy"), per_category=2, max_new_tokens=12,
                         data_dir=str(data), compute_nll=False)
    run_bench(config, tmp_path / "out", progress=False)
    records = read_records(tmp_path / "out" / "records.jsonl")
    by_prompt = {}
    for record in records:
        by_prompt.setdefault(record["prompt_id"], {})[record["method"]] = record["token_ids"]
    assert len(by_prompt) == 2
    assert all(methods["ar"] == methods["hf-greedy"] for methods in by_prompt.values())


def test_own_tokenizer_matches_transformers_on_a_saved_folder(tmp_path):
    from transformers import AutoTokenizer

    from tierspec.tokenizer import FastTokenizer, fits

    folder = tmp_path / "tok"
    char_tokenizer().save_pretrained(folder)
    assert fits(folder) is None
    own, theirs = FastTokenizer(folder), AutoTokenizer.from_pretrained(folder)
    for text in ("hello world", "a=b+c\n(x)", "", "UPPER case?"):
        for special in (True, False):
            assert own(text, add_special_tokens=special)["input_ids"] == list(theirs(text, add_special_tokens=special)["input_ids"])
        ids = theirs(text)["input_ids"] + [1]
        assert own.decode(ids, skip_special_tokens=True) == theirs.decode(ids, skip_special_tokens=True)
        assert own.decode(ids) == theirs.decode(ids)
    assert own.get_vocab() == theirs.get_vocab() and own.eos_token_id == theirs.eos_token_id == 1
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "additional_special_tokens": []}))
    assert fits(folder) is None  # an empty setting changes nothing
    for setting in ({"add_bos_token": True}, {"additional_special_tokens": ["<x>"]},
                    {"chat_template": [{"name": "default", "template": "{{ messages }}"}]}):
        (folder / "tokenizer_config.json").write_text(json.dumps({**config, **setting}))
        assert fits(folder) is not None, setting  # settings it does not reproduce: transformers loads it
    (folder / "tokenizer.json").unlink()
    assert fits(folder) == "no tokenizer.json"


def test_a_model_on_tierspec_code_generates_text_through_the_api(tmp_path):
    folder = _save_tiny(tmp_path / "m")
    loaded = load_model(folder)
    assert type(loaded.tokenizer).__name__ == "FastTokenizer"
    result = generate("abc abc abc", target=loaded, method="pld", max_new_tokens=10)
    reference = generate("abc abc abc", target=load_model(folder, implementation="transformers"), method="ar",
                         max_new_tokens=10)
    assert result.token_ids == reference.token_ids and result.text == reference.text


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_tokens_logits_do_not_depend_on_the_pass_it_is_in(tmp_path, dtype):
    """The exactness the decode loop relies on: logits of a token computed alone (plain
    decoding) and inside 2-16-token passes (verification) are bitwise equal, also when a pass
    crosses a 512-key block, with the CPU kernels ``auto`` picks (packed where available)."""
    torch.manual_seed(3)
    config = LlamaConfig(vocab_size=56, hidden_size=64, intermediate_size=192, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                         tie_word_embeddings=True, bos_token_id=0, eos_token_id=None, pad_token_id=None)
    LlamaForCausalLM(config).save_pretrained(tmp_path / "m")
    loaded = load_model(tmp_path / "m", dtype=dtype, implementation="tierspec")
    ids = (torch.arange(516) * 31 + 7) % 56
    runner = CachedModel(loaded.model)
    with torch.inference_mode():
        runner.forward(ids[:500], logits_for=1)
        alone = torch.cat([runner.forward(ids[500 + i : 501 + i]).logits for i in range(16)])
        assert alone.dtype == torch.float32
        for width in (2, 3, 5, 8, 16):
            runner.rollback(500)
            together = torch.cat([runner.forward(ids[500 + i : 500 + min(i + width, 16)]).logits for i in range(0, 16, width)])
            assert torch.equal(together, alone), f"width {width}"


def test_the_kv_buffer_is_reserved_once_and_rollback_only_moves_the_index(pair):
    own, _ = pair
    runner = CachedModel(own.model)
    runner.reserve(40)
    with torch.inference_mode():
        runner.forward(IDS[:7])
        layer = runner.cache.layers[0]
        storage = layer.keys.untyped_storage().data_ptr()
        kept = layer.keys[..., :5, :].clone()
        runner.forward(IDS[7:12])
        runner.rollback(5)
        assert layer.length == 5 and torch.equal(layer.keys, kept)
        for _ in range(6):
            runner.forward(IDS[:5])
        assert runner.length == 35 and layer.keys.untyped_storage().data_ptr() == storage  # never reallocated
        runner.rollback(3)
        runner.forward(IDS[:2])
        with pytest.raises(RuntimeError, match="rollback invariant"):  # a layer left behind is refused loudly
            runner.cache.layers[1].trim(1)
            runner.forward(IDS[:1])


def _poison_unwritten_slots(runner: CachedModel) -> int:
    """Fill every layer's slots past those written so far with NaN, as memory fresh from the
    allocator may hold; returns how many slots were poisoned in the first layer."""
    poisoned = 0
    for layer in runner.cache.layers:
        layer._keys[..., layer.length :, :] = float("nan")
        layer._values[..., layer.length :, :] = float("nan")
        layer._finite = layer.length
        poisoned = poisoned or int(layer._keys.shape[-2]) - layer.length
    return poisoned


def test_slots_the_buffer_was_given_unwritten_never_reach_the_logits(pair):
    """The KV buffers are allocated without zero-filling (``KVLayer._allocate``): torch's attention
    reads whole key blocks with the slots past the cache masked out, so ``window`` zeroes each slot
    before it first reads it. Planted: NaN in every slot not yet written, after the prompt and
    again after a rollback; the logits equal an unpoisoned run's bit for bit (a NaN read once
    would make them NaN)."""
    own, _ = pair

    def run(poison: bool) -> list[torch.Tensor]:
        runner = CachedModel(own.model)
        runner.reserve(40)
        with torch.inference_mode():
            outs = [runner.forward(IDS[:7]).logits]
            if poison:
                assert _poison_unwritten_slots(runner) > 0
            outs.append(runner.forward(IDS[7:10]).logits)
            runner.rollback(8)
            if poison:
                _poison_unwritten_slots(runner)
            outs.append(runner.forward(IDS[8:12]).logits)
        return outs

    clean, poisoned = run(False), run(True)
    assert all(torch.equal(a, b) for a, b in zip(clean, poisoned))
    assert not any(bool(out.isnan().any()) for out in poisoned)


def test_safetensors_are_read_exactly_and_a_damaged_file_is_a_clear_error(tmp_path):
    """The loader reads each tensor into memory of its own (no mapping kept alive: peak memory
    at load); what it reads equals safetensors' own reader, and a cut or garbled file is refused."""
    from safetensors.torch import load_file, save_file

    from tierspec.llama import read_safetensors

    tensors = {"a": torch.randn(3, 5), "b": torch.randn(7).to(torch.bfloat16), "c": torch.zeros(0, 4),
               "d": torch.randn(2, 2, dtype=torch.float64)}
    path = tmp_path / "w.safetensors"
    save_file(tensors, str(path))
    read = dict(read_safetensors(path))
    reference = load_file(str(path))
    assert read.keys() == reference.keys()
    for name, tensor in read.items():
        assert tensor.dtype == reference[name].dtype and torch.equal(tensor, reference[name])
        tensor.add_(1)  # writable memory of its own: the file is untouched
    assert torch.equal(load_file(str(path))["a"], tensors["a"])
    data = path.read_bytes()
    (tmp_path / "cut.safetensors").write_bytes(data[:-9])
    with pytest.raises(ValueError, match="does not fit the file|cut short"):
        list(read_safetensors(tmp_path / "cut.safetensors"))
    (tmp_path / "junk.safetensors").write_bytes(b"\xff" * 64)
    with pytest.raises(ValueError, match="not a safetensors file"):
        list(read_safetensors(tmp_path / "junk.safetensors"))
