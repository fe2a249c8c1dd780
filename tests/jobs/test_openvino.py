"""The OpenVINO GenAI peers of the bench (``tierspec/bench/openvino.py``): their errors, their
method specs, and on the real default model that they are wired to OpenVINO right."""

import json

import pytest
from conftest import char_tokenizer, tiny_llama, write_spec_bench

from tierspec.bench.openvino import OPENVINO_EXTRA
from tierspec.bench.runner import BenchConfig, parse_spec, run_bench
from tierspec.errors import TierspecError
from tierspec.models import wrap_model


def _import_genai():
    try:
        import openvino_genai
    except ImportError as error:  # README's install command installs the extra; say so loudly
        pytest.fail(f"openvino-genai is missing ({error}); install it with {OPENVINO_EXTRA}")
    return openvino_genai


@pytest.fixture
def data_dir(tmp_path):
    return write_spec_bench(tmp_path / "data", {
        "qa": ["What is the capital of France? Answer in one sentence."],
        "rewrite": ["Copy this list exactly, then add one more fruit: apple, banana, cherry, apple, banana, cherry."]})


def test_specs_take_the_lookup_parameters_only():
    assert parse_spec("ov-lookup:tokens=3:ngram=2") == ("ov-lookup", {"tokens": "3", "ngram": "2"})
    with pytest.raises(TierspecError, match=r"unknown parameter\(s\) \['tokens'\]"):
        parse_spec("ov-greedy:tokens=3")
    with pytest.raises(TierspecError, match="tokens must be an integer"):
        parse_spec("ov-lookup:tokens=many")


def test_a_missing_extra_is_one_line_naming_it(tmp_path, data_dir, monkeypatch):
    monkeypatch.setitem(__import__("sys").modules, "openvino_genai", None)  # `import openvino_genai` now fails
    target = wrap_model(tiny_llama(4, vocab_size=56).model, char_tokenizer(), name="tiny-char")
    config = BenchConfig(target="tiny", methods=("ov-greedy",), per_category=1, max_new_tokens=4, data_dir=str(data_dir))
    with pytest.raises(TierspecError) as error:
        run_bench(config, tmp_path / "out", progress=False, target=target)
    message = str(error.value)
    assert "\n" not in message
    assert message.startswith("ov-greedy needs openvino-genai") and message.endswith(OPENVINO_EXTRA)
    assert not (tmp_path / "out").exists()


def test_a_target_without_a_gguf_file_is_refused(tmp_path, data_dir):
    _import_genai()
    target = wrap_model(tiny_llama(4, vocab_size=56).model, char_tokenizer(), name="tiny-char")
    config = BenchConfig(target="tiny", methods=("ov-lookup",), per_category=1, max_new_tokens=4, data_dir=str(data_dir))
    with pytest.raises(TierspecError, match=r"ov-lookup runs OpenVINO GenAI on the target's GGUF file: the target "
                                            r"must be a known model \(smollm2-135m, gemma3-270m\) or a \.gguf file, "
                                            r"not 'tiny'"):
        run_bench(config, tmp_path / "out", progress=False, target=target)


@pytest.mark.real_model
def test_peers_on_the_real_model_match_openvinos_own_decoding(tmp_path, data_dir):
    """Through the bench: the records carry the budget and the weights; ov-greedy's tokens are what
    OpenVINO GenAI's own pipeline gives for the same prompt ids (so the peer is wired right: the
    prompt ids, the budget, the stop ids), and its prompt lookup runs in fewer passes' worth of time
    than tokens (it reports no statistics)."""
    genai = _import_genai()
    import numpy as np
    import openvino

    import tierspec
    from tierspec.data import load_prompts
    from tierspec.models import default_model_file
    from tierspec.prompting import encode_prompt, eos_ids

    budget = 24
    target = tierspec.load_model("smollm2-135m")
    config = BenchConfig(methods=("ar", "ov-greedy", "ov-lookup"), per_category=1, max_new_tokens=budget,
                         data_dir=str(data_dir), compute_nll=False)
    run_bench(config, tmp_path / "out", progress=False, target=target)
    records = [json.loads(line) for line in (tmp_path / "out" / "records.jsonl").read_text().splitlines()]
    by = {(r["method"], r["prompt_id"]): r for r in records}
    eos = set(eos_ids(target))
    reference = genai.LLMPipeline(str(default_model_file()), "CPU", INFERENCE_NUM_THREADS=2)
    for prompt in load_prompts("spec_bench", data_dir):
        greedy, lookup = by[("ov-greedy", prompt.id)], by[("ov-lookup", prompt.id)]
        for record in (greedy, lookup):
            assert record["emitted"] == len(record["token_ids"]) > 0
            assert record["emitted"] == budget or record["token_ids"][-1] in eos
            assert record["weights"] == "Q4_1" and record["seconds"] > 0
        ids = np.asarray([encode_prompt(target, prompt.text).tolist()], dtype=np.int64)
        settings = genai.GenerationConfig()
        settings.max_new_tokens, settings.do_sample, settings.stop_token_ids = budget, False, eos
        own = reference.generate(genai.TokenizedInputs(openvino.Tensor(ids), openvino.Tensor(np.ones_like(ids))),
                                 settings)
        assert greedy["token_ids"] == [int(t) for t in own.tokens[0]]
    table = (tmp_path / "out" / "summary.md").read_text()
    assert "`ov-*`: OpenVINO GenAI" in table and "zero point" in table


@pytest.mark.parametrize("name", ["ov-greedy", "ov-lookup"])
def test_the_peers_pipelines_keep_no_prefix_cache(name, monkeypatch):
    """Each prompt is prefilled in full, as tierspec's methods prefill theirs: OpenVINO's LLMPipeline
    keeps a prefix cache by default on the CPU (it held the bench's warm-up prompt — the first one
    measured — prefilled already), so the peer builds it with a scheduler that has none."""
    genai = _import_genai()
    from tierspec.bench.openvino import OpenVinoPeer

    built = []

    class Recorder:
        def __init__(self, *args, **kwargs):
            built.append((args, kwargs))

    monkeypatch.setattr(genai, "LLMPipeline", Recorder)
    OpenVinoPeer(name, {}, "smollm2-135m", 49152, (2,), 0.0, 0, 1.0, 2)
    ((args, kwargs),) = built
    assert args[1] == "CPU" and kwargs["prompt_lookup"] == (name == "ov-lookup")
    assert kwargs["scheduler_config"].enable_prefix_caching is False
