"""Numeric request fields bounded to what a method can use, refused with the bound (issue 40,
item 4): the server's request parsing (OpenAI's error body), the Python API and the CLI."""

import asyncio
import json
from types import SimpleNamespace

import pytest

from tierspec import cli
from tierspec.errors import PromptError
from tierspec.limits import MAX_LOGIT_BIAS_ENTRIES, MAX_NUM_DRAFT, check_num_draft
from tierspec.server.scheduler import ApiError
from tierspec.server.parsing import ChatRequest, CompletionRequest, prepare

ENGINE = SimpleNamespace(model_name="tiny", default_method="ar", target=SimpleNamespace(vocab_size=64, tokenizer=None),
                         context=128, eos=())


def refusal(body: dict, model=CompletionRequest) -> dict:
    with pytest.raises(ApiError) as caught:
        prepare(ENGINE, model, json.dumps(body).encode(), asyncio.new_event_loop())
    assert caught.value.status == 400
    return caught.value.body()["error"]


BASE = {"prompt": [1, 2, 3], "max_tokens": 4}


@pytest.mark.parametrize("fields, param, message", [
    ({"num_draft": MAX_NUM_DRAFT + 1}, "num_draft", "num_draft: Input should be less than or equal to 64"),
    ({"num_draft": -1}, "num_draft", "num_draft: Input should be greater than or equal to 0"),
    ({"top_k": 65}, "top_k", "top_k: at most the vocabulary size 64 (0: no top-k), got 65"),
    ({"n": 17}, "n", "n: Input should be less than or equal to 16"),
    ({"logprobs": 21}, "logprobs", "logprobs: Input should be less than or equal to 20"),
    ({"temperature": 2.5}, "temperature", "temperature: Input should be less than or equal to 2"),
    ({"top_p": 1.5}, "top_p", "top_p: Input should be less than or equal to 1"),
    ({"presence_penalty": 3.0}, "presence_penalty", "presence_penalty: Input should be less than or equal to 2"),
    ({"frequency_penalty": -2.5}, "frequency_penalty", "frequency_penalty: Input should be greater than or equal to -2"),
    ({"seed": 2 ** 63}, "seed", "seed: Input should be less than or equal to 9223372036854775807"),
    ({"logit_bias": {"5": 101.0}}, "logit_bias", "logit_bias: the bias of token 5 must be in [-100, 100], got 101.0"),
    ({"logit_bias": {str(i): 1.0 for i in range(MAX_LOGIT_BIAS_ENTRIES + 1)}}, "logit_bias",
     f"logit_bias: at most {MAX_LOGIT_BIAS_ENTRIES} tokens, got {MAX_LOGIT_BIAS_ENTRIES + 1}"),
    ({"logit_bias": {"64": 1.0}}, "logit_bias", "logit_bias: token id 64 is outside the model's vocabulary (0 .. 63)"),
    # digits str.isdigit takes and int() refuses (a 500) or reads as another number ("٣": token 3)
    ({"logit_bias": {"²": 1.0}}, "logit_bias", "logit_bias: keys are token ids (strings of at most 10 digits 0-9), got '²'"),
    ({"logit_bias": {"٣": 1.0}}, "logit_bias", "logit_bias: keys are token ids (strings of at most 10 digits 0-9), got '٣'"),
    ({"logit_bias": {"9" * 5000: 1.0}}, "logit_bias",
     "logit_bias: keys are token ids (strings of at most 10 digits 0-9), got '" + "9" * 40 + "'"),
    ({"max_tokens": 200}, "max_tokens", "max_tokens 200 + the 3 tokens of prompt exceed the model's context of 128"),
    ({"stream_options": {"include_usage": True}}, "stream_options",
     "The 'stream_options' parameter is only allowed when 'stream' is enabled."),
    ({"stream": False, "stream_options": {"include_usage": False}}, "stream_options",
     "The 'stream_options' parameter is only allowed when 'stream' is enabled."),
])
def test_out_of_bound_fields_get_400_naming_the_bound(fields, param, message):
    error = refusal({**BASE, **fields})
    assert error == {"message": message, "type": "invalid_request_error", "param": param, "code": None}


def test_null_is_the_default_of_a_field_that_has_one():
    """OpenAI reads null as "not given"; clients serialise unset options so ("temperature": null was a 400)."""
    nulls = {"temperature": None, "top_p": None, "n": None, "presence_penalty": None, "frequency_penalty": None,
             "stream": None, "echo": None, "logprobs": None, "top_k": None, "seed": None, "stop": None}
    body, job = prepare(ENGINE, CompletionRequest, json.dumps({**BASE, **nulls}).encode(), asyncio.new_event_loop())
    plain, _ = prepare(ENGINE, CompletionRequest, json.dumps(BASE).encode(), asyncio.new_event_loop())
    assert body == plain and len(job.choices) == 1
    chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    body = ChatRequest.model_validate_json(json.dumps({**chat, "logprobs": None, "temperature": None}))
    assert body.logprobs is False and body.temperature == 1.0
    assert refusal({**BASE, "temperature": "0.5"})["param"] == "temperature"  # still strict about types


def test_chat_top_logprobs_is_bounded_too():
    error = refusal({"messages": [{"role": "user", "content": "Hi"}], "logprobs": True, "top_logprobs": 21,
                     "max_tokens": 2}, ChatRequest)
    assert error["param"] == "top_logprobs" and "less than or equal to 20" in error["message"]


def test_fields_at_their_bounds_are_accepted():
    body, job = prepare(ENGINE, CompletionRequest,
                        json.dumps({**BASE, "num_draft": MAX_NUM_DRAFT, "top_k": 64, "n": 16, "logprobs": 20,
                                    "stream": True, "stream_options": {"include_usage": True}}).encode(),
                        asyncio.new_event_loop())
    assert [c.config.num_draft for c in job.choices] == [MAX_NUM_DRAFT] * 16 and body.include_usage


def test_the_python_api_and_the_cli_take_the_same_bound(capsys):
    check_num_draft(MAX_NUM_DRAFT)
    check_num_draft(None)
    with pytest.raises(PromptError, match="^num_draft must be an integer from 0 to 64 .*got 1000000$"):
        check_num_draft(10 ** 6)
    import tierspec

    with pytest.raises(PromptError, match="^num_draft must be an integer from 0 to 64"):
        tierspec.generate([1, 2, 3], target=SimpleNamespace(), num_draft=10 ** 6)  # refused before any work
    assert cli.main(["generate", "--num-draft", "1000000", "Hello"]) == 2
    assert capsys.readouterr().err == ("tierspec: error: --num-draft must be an integer from 0 to 64 (tokens drafted "
                                       "per cycle), got 1000000\n")
    assert cli.main(["bench", "--num-draft", "65", "--methods", "ar", "--out", "/nonexistent/x"]) == 2
    assert "--num-draft must be an integer from 0 to 64" in capsys.readouterr().err


@pytest.mark.parametrize("arguments, message", [
    ("[" * 100_000, "nested too deeply"),  # a RecursionError in json.loads, not a 500
    ('{"a": ', "arguments must be JSON text of an object: Expecting value"),
    ("[1]", "arguments must be JSON text of an object"),
])
def test_a_historys_call_arguments_are_json_objects(arguments, message):
    history = [{"role": "user", "content": "Hi"}, {"role": "assistant", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": arguments}}]}]
    error = refusal({"messages": history, "max_tokens": 2}, ChatRequest)
    assert error["param"] == "messages.1.tool_calls.0.function.arguments" and message in error["message"]
