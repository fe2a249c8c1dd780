"""What real clients send (issue 33): logprobs and echo (lm-eval's loglikelihood tasks), token-id
prompts, penalties and logit bias, the no-op fields clients send by default, modern chat formats,
``n`` > 1, ``models.retrieve``; and the clients themselves against a live server: lm-eval
0.4.13 (``local-completions`` loglikelihood and generation, ``local-chat-completions``), the
``llm`` CLI 0.36 and the ``openai`` SDK (sync, async, raw responses; structured output with
``chat.completions.parse`` and tool calls, whole and streamed: issue 39). Real model, no downloads."""

import asyncio
import http.client
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Literal

import openai
import pytest
import torch
from pydantic import BaseModel, Field

import tierspec
from tierspec.server import Scheduler, serving_in_background

pytestmark = pytest.mark.real_model

MODEL = "smollm2-135m"
ROOT = Path(__file__).resolve().parents[2]
#: A lossless method's logprob and ar's for one token come from passes of different sizes, whose
#: float32 logits differ by up to 5e-5 on this model (README, "Same seed, same text").
LOGPROB_TOLERANCE = 2e-4


@pytest.fixture(scope="module")
def smollm():
    return tierspec.load_model(MODEL)


@pytest.fixture(scope="module")
def server(smollm):
    engine = Scheduler(smollm, method="hybrid", max_queue=4)
    with serving_in_background(engine, body_timeout=1.0) as port:
        yield engine, port


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=f"http://127.0.0.1:{server[1]}/v1", api_key="unused", max_retries=0, timeout=120)


def post(port: int, path: str, body, timeout: float = 120):
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    connection.request("POST", path, body if isinstance(body, bytes) else json.dumps(body),
                       {"Content-Type": "application/json"})
    response = connection.getresponse()
    status, parsed = response.status, json.loads(response.read())
    connection.close()
    return status, parsed


def reference_logprobs(smollm, ids: list[int]) -> torch.Tensor:
    """log p(token j | tokens < j) for j ≥ 1, recomputed in one full forward (transformers'
    reference pass on the same weights)."""
    with torch.inference_mode():
        logits = smollm.model(torch.tensor([ids])).logits[0, :-1].float()
    return logits.log_softmax(-1).gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]


# ---- logprobs and echo ----------------------------------------------------------------------------


def test_echo_scores_token_id_prompts_like_a_full_forward(server, smollm):
    """lm-eval's loglikelihood request: token-id prompt, max_tokens 1, logprobs 1, echo. It was
    refused ('prompt: Input should be a valid string')."""
    ids = smollm.tokenizer("The capital of France is Paris.")["input_ids"]
    status, body = post(server[1], "/v1/completions", {"model": MODEL, "prompt": [ids], "max_tokens": 1,
                                                        "logprobs": 1, "echo": True, "temperature": 0, "seed": 1234})
    assert status == 200, body
    logprobs = body["choices"][0]["logprobs"]
    assert len(logprobs["token_logprobs"]) == len(ids) + 1 and logprobs["token_logprobs"][0] is None
    expected = reference_logprobs(smollm, ids)
    assert torch.allclose(torch.tensor(logprobs["token_logprobs"][1:len(ids)]), expected, atol=LOGPROB_TOLERANCE)
    assert body["choices"][0]["text"].startswith(smollm.tokenizer.decode(ids))
    for value, top in zip(logprobs["token_logprobs"][1:], logprobs["top_logprobs"][1:]):
        assert len(top) == 1 and max(top.values()) >= value - 1e-6  # the most likely token is listed


def test_echo_with_max_tokens_0_only_scores_and_a_text_prompt_works_too(server, smollm):
    text = "One, two, three, four"
    status, body = post(server[1], "/v1/completions", {"prompt": text, "max_tokens": 0, "logprobs": 0, "echo": True})
    assert status == 200, body
    choice = body["choices"][0]
    ids = smollm.tokenizer(text)["input_ids"]
    assert choice["text"] == text and body["usage"]["completion_tokens"] == 0
    assert torch.allclose(torch.tensor(choice["logprobs"]["token_logprobs"][1:]), reference_logprobs(smollm, ids),
                          atol=LOGPROB_TOLERANCE)
    assert "".join(choice["logprobs"]["tokens"]) == text
    status, body = post(server[1], "/v1/completions", {"prompt": text, "max_tokens": 0})
    assert status == 400 and "allowed with echo" in body["error"]["message"] and body["error"]["param"] == "max_tokens"


@pytest.mark.parametrize("method", ["hybrid", "pld", "eagle"])
def test_a_speculative_methods_logprobs_are_ars(client, method):
    """The logprobs of every emitted token come from the verification pass that checked it: the
    same values as plain decoding's, to the tolerance, with no pass of their own (the target
    calls are the method's)."""
    # a prompt whose continuation repeats it: every drafter finds drafts to keep
    kwargs = {"model": MODEL, "prompt": "red, green, blue, red, green, blue, red, green, blue, red,", "max_tokens": 30,
              "temperature": 0, "logprobs": 3}
    ar = client.completions.create(**kwargs, extra_body={"method": "ar"})
    spec = client.completions.create(**kwargs, extra_body={"method": method})
    assert spec.choices[0].text == ar.choices[0].text
    a, b = ar.choices[0].logprobs, spec.choices[0].logprobs
    assert a.tokens == b.tokens and len(a.tokens) == ar.usage.completion_tokens
    assert max(abs(x - y) for x, y in zip(a.token_logprobs, b.token_logprobs)) < LOGPROB_TOLERANCE
    assert [list(t) for t in a.top_logprobs] == [list(t) for t in b.top_logprobs]
    assert spec.usage.model_extra["target_calls"] < ar.usage.model_extra["target_calls"]  # it did speculate


def test_chat_logprobs_in_openais_format_streamed_and_whole(client):
    kwargs = {"model": MODEL, "messages": [{"role": "user", "content": "Name three primary colours."}],
              "max_tokens": 12, "temperature": 0, "logprobs": True, "top_logprobs": 2}
    whole = client.chat.completions.create(**kwargs)
    content = whole.choices[0].logprobs.content
    assert "".join(entry.token for entry in content) == whole.choices[0].message.content
    assert all(len(entry.top_logprobs) == 2 and entry.top_logprobs[0].logprob >= entry.logprob - 1e-6
               for entry in content)
    assert all(bytes(entry.bytes).decode() == entry.token for entry in content)
    chunks = list(client.chat.completions.create(**kwargs, stream=True))
    streamed = [entry for chunk in chunks if chunk.choices and chunk.choices[0].logprobs
                for entry in chunk.choices[0].logprobs.content]
    assert [(e.token, round(e.logprob, 5)) for e in streamed] == [(e.token, round(e.logprob, 5)) for e in content]


def test_a_stop_sequence_cuts_the_logprobs_with_the_text(client):
    kwargs = {"model": MODEL, "prompt": "1, 2, 3, 4, 5, 6, 7, 8,", "max_tokens": 30, "temperature": 0, "logprobs": 0}
    full = client.completions.create(**kwargs).choices[0]
    cut = client.completions.create(**kwargs, stop=[" 12"]).choices[0]
    assert cut.finish_reason == "stop" and full.text.startswith(cut.text + " 12")
    assert "".join(cut.logprobs.tokens) == cut.text
    assert cut.logprobs.token_logprobs == full.logprobs.token_logprobs[: len(cut.logprobs.tokens)]
    # usage counts the tokens of the text returned, not those a cycle committed past the stop
    reply = client.completions.create(**kwargs, stop=[" 12"])
    assert reply.usage.completion_tokens == len(reply.choices[0].logprobs.tokens) < len(full.logprobs.tokens)


def test_chat_logprobs_bytes_rebuild_characters_split_over_tokens(client):
    """An emoji is several byte-level tokens, each decoding alone to U+FFFD: their ``bytes`` are the
    emoji's own, so that the entries' bytes add up to the reply's text."""
    reply = client.chat.completions.create(model=MODEL, max_tokens=6, temperature=0, logprobs=True, messages=[
        {"role": "user", "content": "Reply with only a smiley emoji like 😀 and nothing else."}]).choices[0]
    content = reply.logprobs.content
    assert any(entry.token == "\ufffd" for entry in content), reply.message.content  # the case this is for
    assert b"".join(bytes(entry.bytes) for entry in content).decode() == reply.message.content


# ---- prompts, n, modifiers --------------------------------------------------------------------------


def test_a_list_of_prompts_and_n_give_choices_in_openais_order(client):
    prompts = ["The sky is", "Grass is"]
    reply = client.completions.create(model=MODEL, prompt=prompts, n=2, max_tokens=6, temperature=1.0, seed=5)
    assert [c.index for c in reply.choices] == [0, 1, 2, 3]
    for p, prompt in enumerate(prompts):
        alone = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=1.0, seed=5)
        assert reply.choices[2 * p].text == alone.choices[0].text  # choice 0 of a prompt keeps the seed
    again = client.completions.create(model=MODEL, prompt=prompts, n=2, max_tokens=6, temperature=1.0, seed=5)
    assert [c.text for c in again.choices] == [c.text for c in reply.choices]
    assert reply.choices[0].text != reply.choices[1].text  # independent samples (seeds derived per choice)


def test_n_streams_each_choice_with_its_index(client):
    chunks = list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], n=2,
                                                 max_tokens=5, temperature=1.0, seed=3, stream=True))
    texts = {0: "", 1: ""}
    finishes = {}
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            if choice.finish_reason:
                finishes[choice.index] = choice.finish_reason
    whole = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], n=2,
                                           max_tokens=5, temperature=1.0, seed=3)
    assert texts == {c.index: c.message.content for c in whole.choices} and set(finishes) == {0, 1}


@pytest.mark.parametrize("method", ["ar", "hybrid", "pld"])
def test_penalties_and_logit_bias_keep_lossless_methods_equal_to_ar(client, method, smollm):
    """Applied to the target's distribution at every verified position; greedy and seeded."""
    banned = smollm.tokenizer(" the")["input_ids"][0]
    for temperature, seed in ((0, None), (1.0, 11)):
        kwargs = {"model": MODEL, "prompt": "Write about the sea and the sky and the sun:", "max_tokens": 30,
                  "temperature": temperature, "seed": seed, "presence_penalty": 0.7, "frequency_penalty": 0.5,
                  "logit_bias": {str(banned): -100}}
        reference = client.completions.create(**kwargs, extra_body={"method": "ar"})
        reply = client.completions.create(**kwargs, extra_body={"method": method}, logprobs=0)
        assert reply.choices[0].text == reference.choices[0].text
        assert banned not in smollm.tokenizer(reply.choices[0].text)["input_ids"]
    plain = client.completions.create(model=MODEL, prompt="Write about the sea and the sky and the sun:",
                                      max_tokens=30, temperature=0, extra_body={"method": method})
    assert plain.choices[0].text != reply.choices[0].text or temperature != 0


def test_no_op_fields_clients_send_by_default_are_accepted(client, server):
    """They were refused: presence/frequency penalty 0, response_format text, store, logit_bias {},
    parallel_tool_calls, tool_choice none; the developer role and text content parts too."""
    reply = client.chat.completions.create(
        model=MODEL, max_tokens=6, temperature=0, presence_penalty=0, frequency_penalty=0, logit_bias={},
        response_format={"type": "text"}, store=False, parallel_tool_calls=False, tool_choice="none",
        messages=[{"role": "developer", "content": "Answer briefly."},
                  {"role": "user", "content": [{"type": "text", "text": "Name three"}, {"type": "text", "text": "colours."}]}])
    plain = client.chat.completions.create(
        model=MODEL, max_tokens=6, temperature=0,
        messages=[{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Name three\ncolours."}])
    assert reply.choices[0].message.content == plain.choices[0].message.content


@pytest.mark.parametrize("extra, where, message", [
    ({"tools": [{"type": "web_search"}]}, "tools.0.type", "tool type 'web_search' is not supported"),
    ({"response_format": {"type": "xml"}}, "response_format.type", "response_format.type must be one of"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format.json_schema.schema",
     "json_schema.schema is missing"),
    ({"tool_choice": "auto"}, "tool_choice", "tool_choice 'auto' needs tools"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": {
        "type": "function", "function": {"name": "g"}}}, "tool_choice.function.name", "not among the tools"),
    ({"messages": [{"role": "tool", "content": "3"}]}, "messages.0", "a tool message needs tool_call_id"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages.0.content", "part 0 has type 'image_url': only text parts"),
    ({"method": ""}, "method", "give a method name"),  # was taken as the server's default
    ({"logit_bias": {"99999999": 1}}, "logit_bias", "outside the model's vocabulary"),
    ({"logit_bias": {"x": 1}}, "logit_bias", "keys are token ids"),
    ({"presence_penalty": 3}, "presence_penalty", "less than or equal to 2"),
    ({"top_logprobs": 2}, "body", "top_logprobs needs logprobs"),
    ({"n": 17}, "n", "less than or equal to 16"),
])
def test_what_is_not_supported_is_a_clear_400(server, extra, where, message):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, **extra}
    before = server[0].health()
    status, error = post(server[1], "/v1/chat/completions", body)
    assert status == 400 and message in error["error"]["message"], error
    assert (error["error"]["param"] or "body") == where
    after = server[0].health()
    assert after["invalid"] == before["invalid"] + 1 and after["failed"] == before["failed"]


@pytest.mark.parametrize("prompt, message", [
    ([1, 2, 99999999], "token id 99999999 is outside the model's vocabulary"),
    ([], "give at least one prompt"),
    ([[1, 2], []], "prompt 1: give one or more token ids"),
    ([-1], "token ids >= 0"),
])
def test_bad_token_id_prompts_are_named(server, prompt, message):
    status, error = post(server[1], "/v1/completions", {"prompt": prompt, "max_tokens": 1})
    assert status == 400 and message in error["error"]["message"], error


def test_an_unbuildable_method_counts_as_invalid_not_failed(server):
    """/health counted a 400 for a method this model cannot build as 'failed'."""
    engine, port = server
    before = engine.health()
    status, error = post(port, "/v1/completions", {"prompt": "Hi", "max_tokens": 2, "method": "judge"})
    assert status == 400 and error["error"]["param"] == "method"
    after = engine.health()
    assert after["invalid"] == before["invalid"] + 1 and after["failed"] == before["failed"]


def test_models_retrieve(client):
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4")


def test_tokenize_and_detokenize_with_the_served_tokenizer(server, smollm):
    status, body = post(server[1], "/tokenize", {"prompt": "Hello world", "add_special_tokens": False})
    assert status == 200 and body["tokens"] == smollm.tokenizer("Hello world", add_special_tokens=False)["input_ids"]
    status, body = post(server[1], "/detokenize", {"tokens": body["tokens"]})
    assert status == 200 and body["prompt"] == "Hello world"
    status, body = post(server[1], "/detokenize", {"tokens": [10 ** 9]})
    assert status == 400 and "outside the model's vocabulary" in body["error"]["message"]
    for path, request in (("/tokenize", {"prompt": "hi"}), ("/detokenize", {"tokens": [1]})):  # another model: 404,
        status, body = post(server[1], path, {"model": "bogus", **request})  # as the generation endpoints answer
        assert status == 404 and body["error"]["param"] == "model", (path, body)


# ---- the HTTP layer: slow bodies, garbage ------------------------------------------------------------


def test_a_body_that_never_arrives_gets_408(server):
    """A body announced and never sent held its connection with no timeout (1 s here)."""
    with socket.create_connection(("127.0.0.1", server[1]), timeout=30) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 100\r\n\r\n{\"prompt\"")
        started = time.monotonic()
        answer = sock.makefile("rb").read()
    assert answer.startswith(b"HTTP/1.1 408") and time.monotonic() - started < 20
    body = json.loads(answer.split(b"\r\n\r\n", 1)[1])
    assert "did not arrive within 1 s" in body["error"]["message"]


def test_a_garbage_request_line_gets_an_openai_error_body(server):
    with socket.create_connection(("127.0.0.1", server[1]), timeout=30) as sock:
        sock.sendall(b"\x16\x03\x01 garbage\r\n\r\n")
        answer = sock.makefile("rb").read()
    head, body = answer.split(b"\r\n\r\n", 1)
    assert head.startswith(b"HTTP/1.1 400") and b"application/json" in head
    error = json.loads(body)["error"]
    assert set(error) == {"message", "type", "param", "code"} and "malformed HTTP request" in error["message"]


# ---- the clients ---------------------------------------------------------------------------------


def test_the_openai_sdk_async_client_and_raw_responses(server):
    port = server[1]

    async def run():
        client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
        replies = await asyncio.gather(*[client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4, temperature=0) for _ in range(2)])
        stream = await client.completions.create(model=MODEL, prompt="Hello", max_tokens=4, temperature=0, stream=True)
        pieces = [chunk.choices[0].text async for chunk in stream if chunk.choices]
        await client.close()
        return replies, pieces

    replies, pieces = asyncio.run(run())
    assert replies[0].choices[0].message.content == replies[1].choices[0].message.content
    raw = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused").completions.with_raw_response.create(
        model=MODEL, prompt="Hello", max_tokens=4, temperature=0)
    assert raw.http_response.status_code == 200 and raw.headers["content-type"] == "application/json"
    assert raw.parse().choices[0].text == "".join(pieces)


def _write_tasks(folder: Path) -> None:
    """Two tiny local lm-eval tasks: a multiple-choice one (loglikelihood) and a generation one."""
    items = [{"question": "The sky on a clear day is", "choices": [" blue", " green", " purple"], "answer": 0},
             {"question": "Two plus two equals", "choices": [" four", " seven", " nine"], "answer": 0},
             {"question": "Ice is made of frozen", "choices": [" sand", " water", " glass"], "answer": 1}]
    (folder / "items.jsonl").write_text("".join(json.dumps(item) + "\n" for item in items))
    common = f"dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {folder / 'items.jsonl'}\ntest_split: test\n"
    (folder / "tiny_mc.yaml").write_text(
        "task: tiny_mc\n" + common + "output_type: multiple_choice\ndoc_to_text: \"{{question}}\"\n"
        "doc_to_choice: \"{{choices}}\"\ndoc_to_target: \"{{answer}}\"\nmetric_list:\n  - metric: acc\n")
    (folder / "tiny_gen.yaml").write_text(
        "task: tiny_gen\n" + common + "output_type: generate_until\ndoc_to_text: \"{{question}}\"\n"
        "doc_to_target: \"{{choices[answer]}}\"\ngeneration_kwargs:\n  until: [\"\\n\", \".\"]\n  max_gen_toks: 6\n"
        "metric_list:\n  - metric: exact_match\n")


def _lm_eval(port: int, folder: Path, model: str, tasks: str, url_path: str, extra: str = "") -> dict:
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    out = folder / f"out-{model}"
    command = [sys.executable, "-m", "lm_eval", "--model", model, "--tasks", tasks, "--include_path", str(folder),
               "--model_args", f"model={MODEL},base_url=http://127.0.0.1:{port}{url_path},num_concurrent=1,"
               f"max_retries=1{extra}", "--output_path", str(out), "--log_samples"]
    if model == "local-chat-completions":
        command.append("--apply_chat_template")
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(next(out.rglob("results_*.json")).read_text())
    samples = {path.name.split("_20")[0].removeprefix("samples_"):
               [json.loads(line) for line in path.read_text().splitlines()] for path in out.rglob("samples_*.jsonl")}
    return {"results": results["results"], "samples": samples}


def test_lm_eval_loglikelihood_and_generation_tasks_run_against_tierspec_serve(server, smollm, tmp_path):
    """lm-eval's local-completions tokenises through the server (/tokenizer_info, /tokenize: its
    remote tokenizer, no tokenizer download) and scores each choice with echo; every
    loglikelihood equals a full forward's, and the generations equal tierspec's greedy text."""
    _write_tasks(tmp_path)
    run = _lm_eval(server[1], tmp_path, "local-completions", "tiny_mc,tiny_gen", "/v1/completions")
    assert "acc,none" in run["results"]["tiny_mc"] and "exact_match,none" in run["results"]["tiny_gen"]
    scored = 0
    for sample in run["samples"]["tiny_mc"]:
        for i in range(len(sample["doc"]["choices"])):
            arguments = sample["arguments"][f"gen_args_{i}"]  # (context, continuation) as lm-eval asked
            context, continuation = arguments["arg_0"], arguments["arg_1"]
            whole = smollm.tokenizer(context + continuation, add_special_tokens=False)["input_ids"]
            context_ids = smollm.tokenizer(context, add_special_tokens=False)["input_ids"]
            expected = float(reference_logprobs(smollm, whole)[len(context_ids) - 1:].sum())
            assert float(sample["resps"][i][0][0]) == pytest.approx(expected, abs=1e-3)
            scored += 1
    assert scored == 9
    for sample in run["samples"]["tiny_gen"]:
        context = sample["arguments"]["gen_args_0"]["arg_0"]
        reference = tierspec.generate(context, target=smollm, method="ar", max_new_tokens=6, chat_template=False)
        assert reference.text.startswith(sample["resps"][0][0])


def test_lm_eval_chat_completions_generation(server, tmp_path):
    _write_tasks(tmp_path)
    run = _lm_eval(server[1], tmp_path, "local-chat-completions", "tiny_gen", "/v1/chat/completions",
                   ",tokenizer_backend=none")
    assert len(run["samples"]["tiny_gen"]) == 3 and "exact_match,none" in run["results"]["tiny_gen"]


def test_the_llm_cli_prompts_and_continues_a_conversation(server, tmp_path, client):
    (tmp_path / "extra-openai-models.yaml").write_text(
        f"- model_id: tierspec\n  model_name: {MODEL}\n  api_base: \"http://127.0.0.1:{server[1]}/v1\"\n")
    env = {**os.environ, "LLM_USER_PATH": str(tmp_path)}

    def llm(*arguments: str) -> str:
        done = subprocess.run([sys.executable, "-m", "llm", *arguments], env=env, capture_output=True, text=True,
                              timeout=300)
        assert done.returncode == 0, done.stderr
        return done.stdout.strip()

    first = llm("-m", "tierspec", "-o", "temperature", "0", "-o", "max_tokens", "8", "Name a colour.")
    expected = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Name a colour."}],
                                              max_tokens=8, temperature=0).choices[0].message.content
    assert first == expected.strip()
    assert llm("-c", "-o", "temperature", "0", "-o", "max_tokens", "8", "And another?")
    assert llm("-m", "tierspec", "-s", "Answer in one word.", "-o", "max_tokens", "4", "Hi")


# ---- structured output and tool calls (issue 39) ------------------------------------------------------


class City(BaseModel):
    """What ``chat.completions.parse`` is asked to fill (the SDK sends its strict JSON schema)."""

    name: str = Field(max_length=16)
    country: str = Field(max_length=16)
    founded: int = Field(ge=0, le=2100)


class GetWeather(BaseModel):
    city: str = Field(max_length=12)
    unit: Literal["celsius", "fahrenheit"]


WEATHER = openai.pydantic_function_tool(GetWeather, name="get_weather", description="The weather in a city now.")
TIME = {"type": "function", "function": {"name": "get_time", "description": "The time in a time zone.", "parameters": {
    "type": "object", "properties": {"utc_offset": {"type": "integer", "minimum": -12, "maximum": 14}},
    "required": ["utc_offset"], "additionalProperties": False}}}
ASK_CITY = [{"role": "user", "content": "Give the name, country and founding year of the capital of Italy as JSON."}]
ASK_WEATHER = [{"role": "user", "content": "What is the weather like in Paris today?"}]


def check_calls(message, names: set[str]):
    """Each call names one of ``names`` and its arguments validate against that tool's schema."""
    import jsonschema

    schemas = {tool["function"]["name"]: tool["function"]["parameters"] for tool in (WEATHER, TIME)}
    assert message.tool_calls and message.content is None
    for call in message.tool_calls:
        assert call.type == "function" and call.function.name in names and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])


def streamed_message(stream) -> tuple[str | None, list[dict], str]:
    """A streamed chat reply put together as OpenAI's chunks build it: its content, its tool
    calls (by index, arguments joined) and the finish reason."""
    content, calls, finish = None, {}, None
    for chunk in stream:
        for choice in chunk.choices:
            delta = choice.delta
            if delta.content:
                content = (content or "") + delta.content
            for call in delta.tool_calls or []:
                entry = calls.setdefault(call.index, {"id": None, "name": None, "arguments": ""})
                entry["id"] = call.id or entry["id"]
                if call.function is not None:
                    entry["name"] = call.function.name or entry["name"]
                    entry["arguments"] += call.function.arguments or ""
            finish = choice.finish_reason or finish
    return content, [calls[index] for index in sorted(calls)], finish


def as_dicts(tool_calls) -> list[dict]:
    return [{"id": c.id, "name": c.function.name, "arguments": c.function.arguments} for c in tool_calls or []]


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "t=1"])
def test_parse_fills_a_pydantic_model_and_the_default_method_is_ars(client, temperature):
    """``chat.completions.parse`` (a strict json_schema) gives a City; the server's default method
    (hybrid) and ``ar`` write the same tokens under the grammar, greedy and seeded at t=1."""
    kwargs = {"model": MODEL, "messages": ASK_CITY, "response_format": City, "max_tokens": 48,
              "temperature": temperature, "seed": 77}
    default = client.chat.completions.parse(**kwargs)
    ar = client.chat.completions.parse(**kwargs, extra_body={"method": "ar"})
    choice = default.choices[0]
    assert isinstance(choice.message.parsed, City) and choice.finish_reason == "stop"
    assert choice.message.content == ar.choices[0].message.content
    assert default.usage.model_extra["method"] == "hybrid" and ar.usage.model_extra["method"] == "ar"
    with client.chat.completions.stream(**kwargs) as stream:  # the SDK's streaming helper: the same object
        assert stream.get_final_completion().choices[0].message.parsed == choice.message.parsed


def test_json_mode_and_completions_with_a_schema_whole_and_streamed(client):
    """json_object on chat; a json_schema on /v1/completions (through extra_body: the SDK's
    completions take no response_format), its text valid, streamed in the same pieces' sum."""
    import jsonschema

    reply = client.chat.completions.create(model=MODEL, messages=ASK_CITY, response_format={"type": "json_object"},
                                           max_tokens=40, temperature=0)
    if reply.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(reply.choices[0].message.content), dict)
    else:  # cut by max_tokens: still the start of an object
        assert reply.choices[0].message.content.startswith("{")
    schema = {"type": "object", "properties": {"colour": {"enum": ["red", "green", "blue"]},
                                               "count": {"type": "integer", "minimum": 1, "maximum": 9}},
              "required": ["colour", "count"], "additionalProperties": False}
    response_format = {"type": "json_schema", "json_schema": {"name": "pick", "schema": schema, "strict": True}}
    kwargs = {"model": MODEL, "prompt": "A colour and a small number, as JSON:", "max_tokens": 24, "temperature": 0,
              "extra_body": {"response_format": response_format}}
    whole = client.completions.create(**kwargs)
    jsonschema.validate(json.loads(whole.choices[0].text), schema)
    assert whole.choices[0].finish_reason == "stop"
    pieces = [chunk.choices[0].text for chunk in client.completions.create(**kwargs, stream=True) if chunk.choices]
    assert "".join(pieces) == whole.choices[0].text


@pytest.mark.parametrize("tool_choice", ["required", "named"])
def test_forced_tool_calls_whole_and_streamed(client, tool_choice):
    """``required`` and a named function: the reply is calls only (``finish_reason``
    ``tool_calls``, arguments valid for the function's schema); the streamed deltas build the
    same calls, ids included; the default method's calls are ``ar``'s."""
    choice = {"type": "function", "function": {"name": "get_weather"}} if tool_choice == "named" else "required"
    names = {"get_weather"} if tool_choice == "named" else {"get_weather", "get_time"}
    kwargs = {"model": MODEL, "messages": ASK_WEATHER, "tools": [WEATHER, TIME], "tool_choice": choice,
              "max_tokens": 60, "temperature": 0}
    reply = client.chat.completions.create(**kwargs)
    assert reply.choices[0].finish_reason == "tool_calls"
    check_calls(reply.choices[0].message, names)
    ar = client.chat.completions.create(**kwargs, extra_body={"method": "ar"})
    assert as_dicts(ar.choices[0].message.tool_calls) == as_dicts(reply.choices[0].message.tool_calls)
    content, calls, finish = streamed_message(client.chat.completions.create(**kwargs, stream=True))
    assert content is None and finish == "tool_calls" and calls == as_dicts(reply.choices[0].message.tool_calls)


def test_parse_reads_a_strict_tools_arguments_into_its_model(client):
    reply = client.chat.completions.parse(model=MODEL, messages=ASK_WEATHER, tools=[WEATHER],
                                          tool_choice="required", max_tokens=40, temperature=0, seed=3)
    call = reply.choices[0].message.tool_calls[0]
    assert isinstance(call.function.parsed_arguments, GetWeather)


def test_tool_choice_auto_and_none_whole_and_streamed(client):
    """``auto``: the reply is either text or calls, whole and streamed alike; ``none``: the tools
    change nothing (the same text as without them)."""
    kwargs = {"model": MODEL, "messages": ASK_WEATHER, "tools": [WEATHER, TIME], "max_tokens": 24, "temperature": 0}
    auto = client.chat.completions.create(**kwargs, tool_choice="auto")
    message = auto.choices[0].message
    if message.tool_calls:
        assert auto.choices[0].finish_reason == "tool_calls"
        check_calls(message, {"get_weather", "get_time"})
    else:
        assert message.content and not message.content.lstrip().startswith("<tool_call>")
    content, calls, finish = streamed_message(client.chat.completions.create(**kwargs, tool_choice="auto", stream=True))
    assert (content, calls, finish) == (message.content, as_dicts(message.tool_calls), auto.choices[0].finish_reason)
    none = client.chat.completions.create(**{**kwargs, "max_tokens": 8}, tool_choice="none")
    plain = client.chat.completions.create(model=MODEL, messages=ASK_WEATHER, max_tokens=8, temperature=0)
    assert none.choices[0].message.content == plain.choices[0].message.content and not none.choices[0].message.tool_calls


def test_a_conversation_with_a_call_and_its_result(client):
    """The history sends back the assistant's call and the tool's result (OpenAI's roles)."""
    history = ASK_WEATHER + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21, "sky": "clear"}'}]
    reply = client.chat.completions.create(model=MODEL, messages=history, tools=[WEATHER], tool_choice="none",
                                           max_tokens=6, temperature=0)
    assert reply.choices[0].message.content and reply.choices[0].finish_reason in ("stop", "length")


@pytest.mark.parametrize("body, param, message", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "array", "items": {"type": "integer"}, "uniqueItems": True}}}}, "response_format",
     "the JSON schema uses keywords tierspec cannot enforce: uniqueItems"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"not": {"type": "string"}}}}}}]}, "tools.0.function.parameters",
     "tools.0.function.parameters (f): the JSON schema uses keywords tierspec cannot enforce: not"),
    ({"response_format": {"type": "json_object"}, "method": "lossy"}, "method", "cannot decode under a constraint"),
])
def test_what_cannot_be_enforced_is_a_400_naming_it(client, server, body, param, message):
    before = server[0].health()
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model=MODEL, messages=ASK_CITY, max_tokens=4, extra_body=body)
    assert message in refused.value.message and refused.value.param == param
    assert server[0].health()["invalid"] == before["invalid"] + 1
