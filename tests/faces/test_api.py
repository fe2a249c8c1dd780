"""The one-call API: ``generate`` and ``stream`` with one explicit signature, models named by a
string loaded once per process, a stream that is an iterator, text cut inside a character."""

import inspect
import pydoc
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

import tierspec
from tierspec import api
from tierspec.api import IncrementalDetokenizer
from tierspec.errors import TierspecError
from tierspec.models import resolve_dtype

EMOJI_PROMPT = "Write a short happy message with lots of emojis."  # the model answers 🌟🌟🌟…


def test_generate_and_stream_declare_the_same_parameters():
    generate, stream = inspect.signature(tierspec.generate), inspect.signature(tierspec.stream)
    # the same parameters after the prompt; generate also takes a list of prompts (a batch)
    assert list(generate.parameters.values())[1:] == list(stream.parameters.values())[1:]
    assert list(generate.parameters)[0] == list(stream.parameters)[0] == "prompt"
    one, many = stream.parameters["prompt"].annotation, generate.parameters["prompt"].annotation
    assert set(one.split(" | ")) < set(many.split(" | ")) and "list[str]" in many
    assert all(p.kind is not p.VAR_KEYWORD for p in generate.parameters.values())  # nothing hidden in **kwargs
    shown = pydoc.render_doc(tierspec.generate)
    for name in ("target", "method", "num_draft", "max_new_tokens", "temperature", "top_k", "top_p", "seed"):
        assert f"{name}:" in shown


@pytest.fixture
def loads(monkeypatch, tiny_target):
    """Every load_model call the API makes (each returns the tiny model), with a fresh store."""
    calls = []

    def load(spec, **options):
        calls.append((spec, options))
        return tiny_target

    monkeypatch.setattr(api, "load_model", load)
    monkeypatch.setattr(api, "_SHARED", api._SharedModels())
    return calls


def test_a_model_named_by_a_string_is_loaded_once_per_process(loads, prompt_ids):
    first = tierspec.generate(prompt_ids.tolist(), target="tiny", method="ar", max_new_tokens=4)
    second = tierspec.generate(prompt_ids.tolist(), target="tiny", method="pld", max_new_tokens=4)
    assert len(loads) == 1 and first.token_ids == second.token_ids
    default = str(resolve_dtype("auto")).removeprefix("torch.")  # what this machine's "auto" is
    other = "float32" if default == "bfloat16" else "bfloat16"
    assert tierspec.shared_model("tiny", dtype=default) is tierspec.shared_model("tiny")  # one option, two spellings
    tierspec.shared_model("tiny", dtype=other)  # other load options: a model of their own
    assert len(loads) == 2 and loads[1][1]["dtype"] == other


def test_auto_on_the_engines_defaults_is_a_load_of_its_own(loads):
    """A GGUF model under ``auto`` computes with the engine's default numerics (float16 KV caches),
    which no dtype asked for by name does: ``int8`` by name is another load, not the same one."""
    tierspec.shared_model("toy.gguf")
    tierspec.shared_model("toy.gguf", dtype="int8")
    tierspec.shared_model("toy.gguf", dtype="auto")
    assert [options["dtype"] for _, options in loads] == ["auto", "int8"]


def test_threads_asking_for_one_model_share_a_single_load(monkeypatch, tiny_target):
    entered, release, calls = threading.Event(), threading.Event(), []

    def slow_load(spec, **options):
        calls.append(spec)
        entered.set()
        assert release.wait(60)
        return tiny_target

    monkeypatch.setattr(api, "load_model", slow_load)
    monkeypatch.setattr(api, "_SHARED", api._SharedModels())
    together = threading.Barrier(4)

    def ask():
        together.wait(60)
        return tierspec.shared_model("tiny")

    with ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(ask) for _ in range(4)]
        assert entered.wait(60)
        release.set()
        models = [future.result(60) for future in futures]
    assert calls == ["tiny"] and all(model is tiny_target for model in models)


def test_a_failed_load_is_not_kept(monkeypatch, tiny_target):
    outcomes = [OSError("disk unplugged"), tiny_target]

    def flaky_load(spec, **options):
        outcome = outcomes.pop(0)
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    monkeypatch.setattr(api, "load_model", flaky_load)
    monkeypatch.setattr(api, "_SHARED", api._SharedModels())
    with pytest.raises(OSError):
        tierspec.shared_model("tiny")
    assert tierspec.shared_model("tiny") is tiny_target


def test_a_seed_outside_int64_is_a_clear_error(tiny_target, prompt_ids):
    with pytest.raises(tierspec.PromptError, match="int64"):
        tierspec.generate(prompt_ids.tolist(), target=tiny_target, method="ar", max_new_tokens=2, seed=2 ** 64)


@pytest.mark.parametrize("settings, error, message", [
    ({"method": ""}, "UnknownMethodError", "unknown method ''"),  # "" ran the default method, as None does
    ({"chat_template": "no"}, "PromptError", "chat_template is True or False"),  # truthy: it meant the template
    ({"temperature": "1"}, "SamplingError", "temperature must be a number"),  # were bare TypeErrors
    ({"top_p": "0.5"}, "SamplingError", "top_p must be a number"),
])
def test_a_setting_of_the_wrong_kind_is_a_clear_error(settings, error, message, tiny_target, prompt_ids):
    with pytest.raises(TierspecError, match=message) as raised:
        tierspec.generate(prompt_ids.tolist(), target=tiny_target, max_new_tokens=2, **settings)
    assert type(raised.value).__name__ == error


def test_an_empty_list_and_a_list_to_stream_are_clear_errors(tiny_target):
    with pytest.raises(tierspec.PromptError, match="the prompt is empty"):  # was "prompt ids must be integers"
        tierspec.generate([], target=tiny_target, method="ar", max_new_tokens=2)
    with pytest.raises(tierspec.PromptError, match="stream takes one prompt"):  # was "too many dimensions 'str'"
        tierspec.stream(["a", "b"], target=tiny_target, method="ar", max_new_tokens=2)
    for prompt in (None, b"hello"):  # were torch's "Could not infer dtype" and "invalid data type 'bytes'"
        with pytest.raises(tierspec.PromptError, match="a prompt is text, token ids"):
            tierspec.generate(prompt, target=tiny_target, method="ar", max_new_tokens=2)


def test_options_none_are_the_methods_defaults_and_another_type_is_a_clear_error(tiny_target, prompt_ids):
    """``options=None`` was an AttributeError from deep in the method's construction."""
    from tierspec.methods import MethodOptions

    ids = prompt_ids.tolist()
    plain = tierspec.generate(ids, target=tiny_target, method="pld", max_new_tokens=6, options=MethodOptions())
    assert tierspec.generate(ids, target=tiny_target, method="pld", max_new_tokens=6, options=None).token_ids == plain.token_ids
    with pytest.raises(TypeError, match="options must be a tierspec.methods.MethodOptions .or None., not dict"):
        tierspec.generate(ids, target=tiny_target, method="pld", max_new_tokens=6, options={"ngram_size": 2})


@pytest.fixture(scope="module")
def smollm():
    return tierspec.shared_model("smollm2-135m")


@pytest.mark.real_model
def test_stream_is_an_iterator_with_its_stats_and_ids(smollm):
    text_stream = tierspec.stream("Name three primary colours.", target=smollm, method="pld", max_new_tokens=12)
    assert iter(text_stream) is text_stream
    first = next(text_stream)
    assert first and text_stream.token_ids and text_stream.stats.emitted == len(text_stream.token_ids)
    rest = list(text_stream)
    assert first + "".join(rest) == text_stream.text
    assert 0 < text_stream.stats.emitted == len(text_stream.token_ids) <= 12
    with pytest.raises(StopIteration):
        next(text_stream)


@pytest.mark.real_model
def test_the_detokeniser_drops_a_character_cut_at_the_end(smollm):
    tokenizer = smollm.tokenizer
    ids = tokenizer("Hi 🙂🚀 é", add_special_tokens=False)["input_ids"]
    cut_inside = 0
    for cut in range(1, len(ids) + 1):
        detok = IncrementalDetokenizer(tokenizer)
        text = "".join(detok.add(ids[: i + 1], final=i == cut - 1) for i in range(cut))
        whole = tokenizer.decode(ids[:cut])
        cut_inside += whole.endswith("\ufffd")
        assert text == whole.rstrip("\ufffd") and "\ufffd" not in text
    assert cut_inside >= 2  # both emoji span several tokens


@pytest.mark.real_model
def test_text_cut_inside_an_emoji_ends_without_a_replacement_character(smollm):
    """Issue 23 finding 12: a max_new_tokens that ends inside an emoji gave text ending in U+FFFD."""
    reference = tierspec.generate(EMOJI_PROMPT, target=smollm, method="ar", max_new_tokens=12)
    cuts = [k for k in range(1, 13) if smollm.tokenizer.decode(reference.token_ids[:k]).endswith("\ufffd")]
    assert cuts, "the model's answer has no character split over tokens"
    cut = cuts[-1]
    out = tierspec.generate(EMOJI_PROMPT, target=smollm, method="ar", max_new_tokens=cut)
    assert out.text == smollm.tokenizer.decode(reference.token_ids[:cut]).rstrip("\ufffd")
    assert "\ufffd" not in out.text and out.text
    assert "".join(tierspec.stream(EMOJI_PROMPT, target=smollm, method="ar", max_new_tokens=cut)) == out.text
