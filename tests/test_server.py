"""The OpenAI-compatible server, driven by the official ``openai`` client on the real model."""

import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import time

import openai
import pytest

import tierspec
from tierspec.server import Engine, StopMatcher, serving_in_background

pytestmark = pytest.mark.real_model


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def smollm():
    return tierspec.load_model("smollm2-135m")


@pytest.fixture(scope="module")
def server(smollm):
    """A server on 127.0.0.1 with no waiting room (max_queue 0), so a second request while one
    runs is refused; its default method is the package default."""
    engine = Engine(smollm, max_queue=0)
    with serving_in_background(engine) as port:
        yield engine, port


@pytest.fixture
def client(server):
    engine, port = server
    wait_idle(engine)
    return openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=120)


def wait_idle(engine, seconds: float = 10.0) -> dict:
    deadline = time.monotonic() + seconds
    while True:
        health = engine.health()
        if not health["running"] and not health["waiting"]:
            return health
        assert time.monotonic() < deadline, f"server still busy: {health}"
        time.sleep(0.05)


MODEL = "smollm2-135m"
QUESTION = "Name three primary colours."


def test_models_and_health(client, server):
    assert [m.id for m in client.models.list().data] == [MODEL]
    connection = http.client.HTTPConnection("127.0.0.1", server[1], timeout=10)
    connection.request("GET", "/health")
    health = json.loads(connection.getresponse().read())
    assert health["status"] == "ok" and health["model"] == MODEL


def test_completion_equals_greedy_ar(client, smollm):
    reply = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=12, temperature=0)
    reference = tierspec.generate("The capital of France is", target=smollm, method="ar", max_new_tokens=12,
                                  chat_template=False)
    assert reply.choices[0].text == reference.text
    assert reply.choices[0].finish_reason in ("length", "stop")
    assert reply.usage.prompt_tokens > 0 and reply.usage.completion_tokens == len(reference.token_ids)


def test_chat_stream_equals_chat_and_usage_has_speculative_statistics(client):
    messages = [{"role": "system", "content": "You are brief."}, {"role": "user", "content": QUESTION}]
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=24, temperature=0)
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=24, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == whole.choices[0].message.content and streamed
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == [
        whole.choices[0].finish_reason]
    usage = chunks[-1].usage.model_dump()
    assert usage["completion_tokens"] == whole.usage.completion_tokens
    for name in ("drafted_tokens", "accepted_tokens", "mean_accepted_tokens", "target_calls", "method"):
        assert name in usage
    assert usage["target_calls"] <= usage["completion_tokens"]


def test_request_overrides_the_method(client):
    messages = [{"role": "user", "content": QUESTION}]
    default = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=20, temperature=0)
    plain = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=20, temperature=0,
                                           extra_body={"method": "ar"})
    usage = plain.usage.model_dump()
    assert usage["method"] == "ar" and usage["drafted_tokens"] == 0
    assert usage["target_calls"] == usage["completion_tokens"]
    assert default.usage.model_dump()["method"] == tierspec.methods.DEFAULT_METHOD  # a head ships for this model
    assert plain.choices[0].message.content == default.choices[0].message.content  # both lossless, greedy


def test_stop_sequence_cuts_the_text(client):
    full = client.completions.create(model=MODEL, prompt="Count: one, two, three,", max_tokens=16, temperature=0)
    text = full.choices[0].text
    stop = text[len(text) // 2: len(text) // 2 + 2]
    assert stop.strip(), text
    cut = client.completions.create(model=MODEL, prompt="Count: one, two, three,", max_tokens=16, temperature=0,
                                    stop=[stop])
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].text == text[: text.index(stop)]


@pytest.mark.parametrize("request_kwargs, param", [
    ({"extra_body": {"method": "warp-drive"}}, "method"),
    ({"max_tokens": 10 ** 6}, "max_tokens"),
    ({"temperature": "hot"}, "temperature"),
    ({"extra_body": {"frobnicate": True}}, "frobnicate"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "user", "content": "   "}]}, "messages"),
    ({"top_p": 0}, "top_p"),
])
def test_bad_requests_get_400_with_an_openai_error_body(client, request_kwargs, param):
    kwargs = {"model": MODEL, "messages": [{"role": "user", "content": QUESTION}], "max_tokens": 4, **request_kwargs}
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(**kwargs)
    error = caught.value.body
    assert caught.value.status_code == 400 and error["type"] == "invalid_request_error"
    assert param in (error.get("param") or "") + error["message"]


def _open_stream(port: int, max_tokens: int) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Write a long story about a dragon."}],
            "max_tokens": max_tokens, "temperature": 0, "stream": True, "method": "ar"}
    connection.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
    response = connection.getresponse()
    assert response.status == 200
    for _ in range(3):  # the role chunk and two pieces of text: the generation is running
        assert response.readline().startswith(b"data: ")
        response.readline()
    return connection, response


def test_full_queue_answers_503_and_a_disconnect_stops_the_generation(client, server):
    engine, port = server
    before = dict(engine.health())
    connection, response = _open_stream(port, max_tokens=2000)
    with pytest.raises(openai.APIStatusError) as caught:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": QUESTION}], max_tokens=4)
    assert caught.value.status_code == 503
    assert caught.value.response.headers.get("retry-after") == "1"
    assert caught.value.body["type"] == "server_busy"
    started = time.monotonic()
    response.close()
    connection.close()  # the client goes away mid-stream
    health = wait_idle(engine, seconds=15)
    assert time.monotonic() - started < 15  # 2000 tokens would take over a minute
    assert health["cancelled"] == before["cancelled"] + 1 and health["refused"] == before["refused"] + 1
    reply = client.completions.create(model=MODEL, prompt="Hello", max_tokens=3, temperature=0)
    assert reply.usage.completion_tokens >= 1  # the model was freed


@pytest.mark.parametrize("pieces, stops, expected, stopped", [
    (["Hel", "lo wor", "ld"], ["lo w"], "Hel", True),
    (["ab", "c##", "#d"], ["###"], "abc", True),
    (["a#", "#b"], ["###"], "a##b", False),
    (["x"], [], "x", False),
])
def test_stop_matcher_holds_back_only_possible_starts(pieces, stops, expected, stopped):
    matcher, out, hit = StopMatcher(stops), "", False
    for piece in pieces:
        text, hit = matcher.feed(piece)
        out += text
        if hit:
            break
    if not hit:
        out += matcher.flush()
    assert (out, hit) == (expected, stopped)


def test_serve_command_shuts_down_cleanly_on_sigterm():
    port = free_port()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    process = subprocess.Popen([sys.executable, "-m", "tierspec.cli", "serve", "--port", str(port), "--method", "ar",
                                "--log-level", "warning"], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 120
        while True:
            assert process.poll() is None, process.stderr.read().decode()
            try:
                connection = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
                connection.request("GET", "/health")
                if connection.getresponse().status == 200:
                    break
            except OSError:
                pass
            assert time.monotonic() < deadline, "serve did not come up"
            time.sleep(0.2)
        process.send_signal(signal.SIGTERM)
        # uvicorn shuts down gracefully, then re-raises the signal it caught (the conventional status)
        assert process.wait(timeout=30) in (0, -signal.SIGTERM)
        assert "stopped cleanly" in process.stderr.read().decode()
    finally:
        if process.poll() is None:
            process.kill()
