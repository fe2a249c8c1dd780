"""The llama.cpp peers of the bench (``tierspec/bench/llamacpp.py``): their statistics on hand-made
cycles, their errors, and on the real default model that they are wired to llama.cpp right."""

import json

import pytest
from conftest import char_tokenizer, tiny_llama, write_spec_bench

from tierspec.bench.llamacpp import LLAMACPP_EXTRA, lookup_stats
from tierspec.bench.runner import BenchConfig, run_bench
from tierspec.errors import TierspecError
from tierspec.models import wrap_model


def _import_llama_cpp():
    try:
        import llama_cpp
    except ImportError as error:  # README's install command installs the extra; say so loudly
        pytest.fail(f"llama-cpp-python is missing ({error}); install it with {LLAMACPP_EXTRA}")
    return llama_cpp


class TestLookupStats:
    def test_accepted_prefix_correction_and_bonus(self):
        # cycle 0: the prompt's pass emits 7; cycle 1 drafts [8, 9, 4], 8 and 9 pass, 5 corrects 4;
        # cycle 2 drafts [6], accepted, and the bonus 2 follows.
        tokens, cycles = [7, 8, 9, 5, 6, 2], [0, 1, 1, 1, 2, 2]
        stats = lookup_stats(tokens, cycles, [[8, 9, 4], [6]], [0.001, 0.002], 0.5)
        assert (stats.drafted, stats.evaluated, stats.accepted) == (4, 4, 3)  # 4 rejected in cycle 1 was evaluated
        assert (stats.emitted, stats.target_calls, stats.cycles) == (6, 3, 3)
        assert stats.mean_accepted_tokens == 2.0  # τ = 6 tokens / 3 passes
        assert stats.position_drafted == [2, 1, 1] and stats.position_accepted == [2, 1, 0]
        assert stats.draft_seconds == pytest.approx(0.003) and stats.wall_seconds == 0.5

    def test_a_budget_cut_leaves_later_drafts_unevaluated(self):
        # cycle 1 drafts 4 tokens; the budget stops the generation after 2 accepted ones.
        stats = lookup_stats([3, 4, 5], [0, 1, 1], [[4, 5, 6, 7]], [0.0], 0.1)
        assert (stats.drafted, stats.evaluated, stats.accepted, stats.emitted) == (4, 2, 2, 3)

    def test_plain_decoding_is_one_token_per_pass(self):
        stats = lookup_stats([1, 2, 3], [0, 1, 2], [[], []], [0.0, 0.0], 0.1)
        assert stats.mean_accepted_tokens == 1.0 and stats.drafted == 0


@pytest.fixture
def data_dir(tmp_path):
    return write_spec_bench(tmp_path / "data", {
        "qa": ["What is the capital of France? Answer in one sentence."],
        "rewrite": ["Copy this list exactly, then add one more fruit: apple, banana, cherry, apple, banana, cherry."]})


def test_a_missing_extra_is_one_line_naming_it(tmp_path, data_dir, monkeypatch):
    monkeypatch.setitem(__import__("sys").modules, "llama_cpp", None)  # `import llama_cpp` now raises ImportError
    target = wrap_model(tiny_llama(4, vocab_size=56).model, char_tokenizer(), name="tiny-char")
    config = BenchConfig(target="tiny", methods=("llamacpp-greedy",), per_category=1, max_new_tokens=4,
                         data_dir=str(data_dir))
    with pytest.raises(TierspecError) as error:
        run_bench(config, tmp_path / "out", progress=False, target=target)
    message = str(error.value)
    assert "\n" not in message
    assert message.startswith("llamacpp-greedy needs llama-cpp-python") and message.endswith(LLAMACPP_EXTRA)
    assert not (tmp_path / "out").exists()


def test_a_target_without_a_gguf_file_is_refused(tmp_path, data_dir):
    _import_llama_cpp()
    target = wrap_model(tiny_llama(4, vocab_size=56).model, char_tokenizer(), name="tiny-char")
    config = BenchConfig(target="tiny", methods=("llamacpp-lookup",), per_category=1, max_new_tokens=4,
                         data_dir=str(data_dir))
    with pytest.raises(TierspecError, match="llamacpp-lookup runs llama.cpp on the target's GGUF file: the target must "
                                            r"be a known model \(smollm2-135m, gemma3-270m\) or a .gguf file, not 'tiny'"):
        run_bench(config, tmp_path / "out", progress=False, target=target)


@pytest.mark.real_model
def test_peers_on_the_real_model_match_llama_cpp_s_own_greedy_decoding(tmp_path, data_dir):
    """Through the bench: the records carry the budget and the weights; llamacpp-greedy's tokens
    are what llama.cpp's own eval/sample loop and create_completion give for the same prompt ids
    (so the peer is wired right), and prompt lookup, lossless in llama.cpp, gives the same (or
    parts at a near-tie that the pass width flipped)."""
    llama_cpp = _import_llama_cpp()
    import tierspec
    from tierspec.models import default_model_file
    from tierspec.prompting import encode_prompt, eos_ids

    budget = 24
    target = tierspec.load_model("smollm2-135m")
    config = BenchConfig(methods=("ar", "llamacpp-greedy", "llamacpp-lookup"), per_category=1, max_new_tokens=budget,
                         data_dir=str(data_dir), compute_nll=False)
    summary = run_bench(config, tmp_path / "out", progress=False, target=target)
    records = [json.loads(line) for line in (tmp_path / "out" / "records.jsonl").read_text().splitlines()]
    by = {(r["method"], r["prompt_id"]): r for r in records}
    eos = set(eos_ids(target))

    from tierspec.data import load_prompts

    # logits_all: the logits of every position, to measure the gap at a divergence
    reference = llama_cpp.Llama(str(default_model_file()), n_ctx=512, n_threads=2, logits_all=True, verbose=False)
    for prompt in load_prompts("spec_bench", data_dir):
        greedy, lookup = by[("llamacpp-greedy", prompt.id)], by[("llamacpp-lookup", prompt.id)]
        for record in (greedy, lookup):
            assert record["emitted"] == len(record["token_ids"]) > 0
            assert record["emitted"] == budget or record["token_ids"][-1] in eos
            assert record["weights"] == "Q4_1" and record["seconds"] > 0
        ids = encode_prompt(target, prompt.text).tolist()
        # llama.cpp's plain loop: evaluate, take the argmax, feed it back.
        reference.reset()
        reference.eval(ids)
        own = []
        while len(own) < budget:
            own.append(int(reference.sample(temp=0.0)))
            if own[-1] in eos:
                break
            reference.eval([own[-1]])
        assert greedy["token_ids"] == own
        completion = reference.create_completion(ids, max_tokens=budget, temperature=0.0)["choices"][0]["text"]
        assert completion == target.tokenizer.decode(own, skip_special_tokens=True)
        parted = next((i for i, (a, b) in enumerate(zip(own, lookup["token_ids"])) if a != b), None)
        if parted is not None:
            # llama.cpp's logits shift with the number of tokens in a pass (measured here: up to
            # ~0.2 between one 40-token pass and 40 one-token passes), so a drafted pass may flip a
            # near-tie: allowed where greedy's own logits put the two tokens within 0.5.
            reference.reset()
            reference.eval(ids + own[:parted])
            logits = reference.scores[reference.n_tokens - 1]
            assert abs(float(logits[own[parted]] - logits[lookup["token_ids"][parted]])) <= 0.5
        else:
            assert lookup["token_ids"] == greedy["token_ids"]
        assert lookup["target_calls"] <= greedy["emitted"]
    reference.close()
    lookup = summary["methods"]["llamacpp-lookup"]["overall"]
    assert lookup["mean_accepted_tokens"] >= 1.0 and summary["methods"]["llamacpp-greedy"]["overall"]["mean_accepted_tokens"] is None
    table = (tmp_path / "out" / "summary.md").read_text()
    assert "Q4_1 weights" in table and "quantisation" in table



@pytest.mark.real_model
def test_sampling_follows_the_run_s_seed(tmp_path):
    """Above temperature 0 the peer samples with llama.cpp's sampler, seeded per prompt from the
    bench's generator: the same seed gives the same tokens, another seed (almost surely) others."""
    _import_llama_cpp()
    import torch

    import tierspec
    from tierspec.bench.peer_process import PeerProcess, PeerSpec
    from tierspec.bench.runner import PEER_FACTORIES
    from tierspec.prompting import encode_prompt, eos_ids

    target = tierspec.load_model("smollm2-135m")
    spec = PeerSpec(PEER_FACTORIES["llamacpp-lookup"], "llamacpp-lookup", {}, "smollm2-135m", target.vocab_size,
                    tuple(eos_ids(target)), temperature=1.0, top_k=0, top_p=1.0, threads=torch.get_num_threads())
    peer = PeerProcess(spec, "cpu", run_seed=0)  # in its worker process, as the bench runs it
    prompt = encode_prompt(target, "Write a short poem about the sea.")
    runs = [peer.run(prompt, 24, torch.Generator().manual_seed(seed)).token_ids for seed in (1, 1, 2)]
    peer.close()
    assert runs[0] == runs[1] and runs[0] != runs[2]
    assert all(len(tokens) == 24 or tokens[-1] in eos_ids(target) for tokens in runs)
