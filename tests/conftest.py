"""Tiny random Llama-style models built in-process (no downloads)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from tierspec.models import wrap_model

# One intra-op thread for the whole suite (and the commands it starts): the tests check results,
# not speed, and on a shared machine a second thread waits for a busy core at every operation.
# Measured while another job kept both cores busy: a tiny model's four-token PEARL decode took
# 21 ms with one thread and 159 ms with two, and the suite has thousands of such small
# decodes. TIERSPEC_TEST_THREADS overrides it.
_TEST_THREADS = int(os.environ.get("TIERSPEC_TEST_THREADS", "1"))
torch.set_num_threads(_TEST_THREADS)
os.environ.setdefault("OMP_NUM_THREADS", str(_TEST_THREADS))
# Tests on the real model (marked ``real_model``) run on up to two threads: their operations are
# products over 576-1536-wide weights (milliseconds each, not microseconds), which a second core
# speeds up. Measured on a quiet 2-core AVX2 machine, clean clone: the whole suite took 23 min 21 s
# with one thread everywhere and 19 min 32 s with two for these tests, and every real-model test
# (the recorded draft-head tokens included) passed both ways.
# README's command runs the suite on two worker processes (pytest-xdist, ``-n 2 --dist loadfile``: each
# file on one worker, so a module's fixtures are made once): on a 2-core AVX2 Zen 3 (stop 77) 1,594 s against
# 2,400 s in one process, every test passing both ways. A real-model test's two threads then share the cores
# with the other worker's test.
_REAL_MODEL_THREADS = _TEST_THREADS if "TIERSPEC_TEST_THREADS" in os.environ else max(1, min(2, os.cpu_count() or 1))


@pytest.fixture(autouse=True)
def _threads_for_the_real_model(request):
    if request.node.get_closest_marker("real_model") is None:
        yield
        return
    torch.set_num_threads(_REAL_MODEL_THREADS)
    try:
        yield
    finally:
        torch.set_num_threads(_TEST_THREADS)


def tiny_llama(seed: int, vocab_size: int = 64, layers: int = 4, hidden: int = 32, sharpness: float = 1.0,
               dtype: torch.dtype = torch.float64):
    """A random Llama with ``layers`` layers; ``sharpness`` scales the LM head so that
    distributions are peaked (random models are otherwise near uniform)."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        bos_token_id=0,
        eos_token_id=None,
        pad_token_id=None,
    )
    model = LlamaForCausalLM(config).to(dtype).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(sharpness)
    return wrap_model(model, name=f"tiny-llama-{seed}")


def char_tokenizer():
    """A character-level tokenizer (56 ids, lower-cased) for tiny models that need text."""
    from tokenizers import Regex, Tokenizer, decoders, normalizers, pre_tokenizers
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    chars = list(" abcdefghijklmnopqrstuvwxyz0123456789.,?!:;=+-*/()'\"\n#")
    vocab = {"<unk>": 0, "<eos>": 1, **{c: i + 2 for i, c in enumerate(chars)}}
    tokenizer = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    tokenizer.normalizer = normalizers.Lowercase()
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex(".|\n"), "isolated")
    tokenizer.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>", eos_token="<eos>")


@pytest.fixture(scope="session", autouse=True)
def private_cache(tmp_path_factory):
    """Every test writes tierspec's cache (converted models, cost tables) to a temporary folder,
    never to the user's."""
    import os

    previous = os.environ.get("TIERSPEC_CACHE")
    os.environ["TIERSPEC_CACHE"] = str(tmp_path_factory.mktemp("tierspec-cache"))
    yield
    if previous is None:
        os.environ.pop("TIERSPEC_CACHE", None)
    else:
        os.environ["TIERSPEC_CACHE"] = previous


@pytest.fixture(scope="session")
def tiny_target():
    return tiny_llama(seed=1, sharpness=20.0)


@pytest.fixture(scope="session")
def tiny_drafter():
    return tiny_llama(seed=2, layers=2, sharpness=20.0)


def shared_fixture(name: str, source: str):
    """A module's fixture ``name`` that is the session fixture ``source`` (``target =
    shared_fixture("target", "sampling_target")``: one model for every module that samples)."""
    return pytest.fixture(scope="module", name=name)(lambda request: request.getfixturevalue(source))


@pytest.fixture(scope="session")
def sampling_target():
    """float32 like the real model; sharpness 6 keeps sampling at temperature 1 far from greedy."""
    return tiny_llama(seed=21, sharpness=6.0, dtype=torch.float32)


@pytest.fixture(scope="session")
def sampling_own_target(sampling_target, tmp_path_factory):
    """The same weights on tierspec's own Llama forward: what CLaSP and token trees run on."""
    from tierspec.models import load_model

    folder = tmp_path_factory.mktemp("sampling-own") / "m"
    sampling_target.model.save_pretrained(folder)
    return load_model(folder, dtype="float32", implementation="tierspec")


@pytest.fixture(scope="session")
def sampling_drafter():
    """A drafter model of its own for sd, adaptive-sd and csd beside ``sampling_target`` (the target
    drafting for itself always agrees; a drafter as costly as the target never pays)."""
    return tiny_llama(seed=22, layers=1, sharpness=6.0, dtype=torch.float32)


@pytest.fixture(scope="session")
def prompt_ids():
    # Repetitive, so that prompt lookup finds matches.
    return torch.tensor([5, 9, 13, 5, 9, 13, 7, 21, 5, 9, 13, 7, 3, 30, 41])


def as_method(drafter, rule=None, policy=None, num_draft: int = 5, slim_mask=None, pass_costs=None):
    """A (drafter, policy, rule) method for the decode loop; FixedLength(num_draft) by default
    (padding its passes by ``pass_costs`` when given)."""
    from tierspec.methods import Method
    from tierspec.policies import FixedLength
    from tierspec.rules import ExactRule

    return Method.of("test", drafter, rule or ExactRule(), policy or FixedLength(num_draft, pass_costs), "test method",
                     slim_mask)


def draft_request(budget: int, sampling=None, noise=None, policy=None):
    """What the loop asks a drafter for: ``budget`` drafts (greedy, no early stop by default)."""
    from tierspec.drafters.base import DraftEverything
    from tierspec.proposal import DraftRequest
    from tierspec.sampling import SamplingConfig

    return DraftRequest(budget, sampling or SamplingConfig(), noise, policy or DraftEverything())


def run_ids(target, method, prompt, max_new: int = 40, sampling=None, eos=(), generator=None, inspect=None, on_step=None):
    """The generated ids of one decode-loop run; ``on_step(step)`` sees every step."""
    from tierspec.decode import DecodeConfig, decode
    from tierspec.sampling import SamplingConfig

    config = DecodeConfig(max_new_tokens=max_new, sampling=sampling or SamplingConfig(), eos_token_ids=tuple(eos))
    out = []
    for step in decode(target, method, prompt, config, generator, inspect):
        out.extend(step.new_tokens)
        if on_step is not None:
            on_step(step)
    return out


@pytest.fixture
def training_data_dir(tmp_path):
    """A miniature of ../shared/data's training sources (GSM8K train, WMT14, CNN/DM, XSum)."""
    import json

    root = tmp_path / "data"
    rows = {
        "gsm8k/train.jsonl": [{"question": f"tom has {i} apples and buys {i + 1} more. how many?",
                               "answer": f"{i} + {i + 1} = <<{i}+{i + 1}={2 * i + 1}>>{2 * i + 1}\n#### {2 * i + 1}"}
                              for i in range(8)],
        "wmt14/newstest2014_deen.jsonl": [{"id": i, "de": f"der hund {i} ist gross.", "en": f"the dog {i} is big.",
                                           "in_spec_bench": i == 0} for i in range(6)],
        "cnn_dailymail/test.jsonl": [{"id": f"c{i}", "article": f"the mayor of springfield said {i} parks open today.",
                                      "highlights": "parks open.", "in_spec_bench": False} for i in range(3)],
        "xsum/test.jsonl": [{"id": f"x{i}", "document": f"rain fell on london for {i} days in a row.",
                             "summary": "it rained."} for i in range(3)],
    }
    for name, records in rows.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text("\n".join(json.dumps(r) for r in records))
    return root


def write_spec_bench(folder: Path, texts: dict[str, list[str]]) -> Path:
    """A Spec-Bench question file under ``folder`` with ``texts`` per category (question ids 1, 2, …
    in order); returns ``folder``, the ``data_dir`` to pass."""
    (folder / "spec_bench").mkdir(parents=True, exist_ok=True)
    rows, number = [], 0
    for category, items in texts.items():
        for text in items:
            number += 1
            rows.append({"question_id": number, "category": category, "turns": [text]})
    (folder / "spec_bench" / "question.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    return folder


@pytest.fixture(scope="module")
def pinned_pass_costs():
    """One pass-cost table, one draft-head step cost and one tree-call cost for the cost-aware
    methods a test module builds (measuring them on a tiny model under a busy test run could make
    drafting never pay, and checks that drafts were verified would then depend on the machine: a
    tree-call cost measured slow once left a CI run's eagle tree drafting nothing it kept). A
    module uses it with ``pytestmark = pytest.mark.usefixtures("pinned_pass_costs")``."""
    from tierspec import costs

    def table(target, max_tokens=16, refresh=False):
        return costs.ForwardCosts({n: 0.030 + 0.002 * (n - 1) for n in range(1, max_tokens + 1)})

    def draft_step(target, drafter_key, make_step, refresh=False):  # a head step: a tenth of a pass
        return costs.DraftStepCost(step_seconds=0.003, one_token_seconds=0.030)

    def tree_call(target, refresh=False):  # on the pass engine a tree attends in no extra calls
        return 0.0

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(costs, "forward_costs", table)
        patch.setattr(costs, "draft_step_cost", draft_step)
        patch.setattr(costs, "tree_call_seconds", tree_call)
        yield
