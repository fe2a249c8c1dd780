"""The OpenAI-compatible server, driven through real HTTP on the real model: the official
``openai`` client and raw ``http.client`` requests (what a careless or hostile client sends)."""

import dataclasses
import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest

import tierspec
from tierspec.server import Scheduler, StopMatcher, serving_in_background

pytestmark = pytest.mark.real_model

MODEL = "smollm2-135m"
QUESTION = "Name three primary colours."
# A completion the model goes on with for thousands of tokens (no end-of-sequence in sight).
ENDLESS = "1, 2, 3, 4, 5, 6, 7, 8, 9, 10,"
ROOT = Path(__file__).resolve().parents[2]


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
    engine = Scheduler(smollm, max_queue=0)
    with serving_in_background(engine) as port:
        yield engine, port


@pytest.fixture(scope="module")
def queued_server(smollm):
    """A server whose requests may wait (max_queue 2), plain decoding by default."""
    engine = Scheduler(smollm, method="ar", max_queue=2)
    with serving_in_background(engine) as port:
        yield engine, port


def openai_client(port: int, timeout: float = 120) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=timeout)


@pytest.fixture
def client(server):
    engine, port = server
    wait_idle(engine)
    return openai_client(port)


def wait_until(condition, seconds: float = 60.0, what: str = "condition"):
    """Poll ``condition()`` until it is truthy (generous bound: a busy machine is slow)."""
    deadline = time.monotonic() + seconds
    while not (value := condition()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)
    return value


def health_when(engine, condition, seconds: float = 60.0, what: str = "condition") -> dict:
    """The engine's health once ``condition(health)`` holds."""
    def check():
        health = engine.health()
        return health if condition(health) else None

    return wait_until(check, seconds, what)


def wait_idle(engine, seconds: float = 60.0) -> dict:
    return health_when(engine, lambda h: not h["running"] and not h["waiting"], seconds, "an idle server")


def post(port: int, path: str, body, headers: dict | None = None, timeout: float = 60):
    """A raw POST (``body``: bytes as they are, anything else as JSON); (status, headers, parsed body)."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    connection.request("POST", path, data, {"Content-Type": "application/json", **(headers or {})})
    response = connection.getresponse()
    raw = response.read()
    connection.close()
    return response.status, dict(response.getheaders()), json.loads(raw)


def get(port: int, path: str, timeout: float = 10):
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    connection.request("GET", path)
    response = connection.getresponse()
    status, body = response.status, json.loads(response.read())
    connection.close()
    return status, body


def is_error_body(body: dict) -> bool:
    error = body.get("error")
    return isinstance(error, dict) and set(error) == {"message", "type", "param", "code"} and bool(error["message"])


def start_request(port: int, body: dict, path: str = "/v1/chat/completions") -> http.client.HTTPConnection:
    """Send a request and leave its connection open without reading the answer."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    connection.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
    return connection


def endless(stream: bool, max_tokens: int = 4000) -> dict:
    return {"model": MODEL, "prompt": ENDLESS, "max_tokens": max_tokens, "temperature": 0, "stream": stream,
            "method": "ar"}


def open_stream(port: int, body: dict, path: str = "/v1/completions"):
    """A streaming request whose first two chunks have arrived: its generation is running."""
    connection = start_request(port, body, path)
    response = connection.getresponse()
    assert response.status == 200
    for _ in range(2):
        assert response.readline().startswith(b"data: ")
        response.readline()
    return connection, response


# ---- what works: endpoints, equality with the library, streaming, usage ---------------------------

def test_models_and_health(client, server):
    assert [m.id for m in client.models.list().data] == [MODEL]
    status, health = get(server[1], "/health")
    assert status == 200 and health["status"] == "ok" and health["model"] == MODEL
    from tierspec.engine import kernel_report

    assert health["kernels"] == kernel_report()  # the default model runs on the engine


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


def test_completion_stream_equals_completion(client):
    whole = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=10, temperature=0)
    chunks = list(client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=10,
                                            temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason


def test_a_seed_goes_straight_to_the_generation(client, smollm):
    """The same seed gives the library's text, request after request: the server keeps no
    random state of its own (plain decoding here; the other methods follow the seed contract)."""
    kwargs = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 16, "temperature": 1.0, "seed": 7,
              "extra_body": {"method": "ar"}}
    texts = [client.completions.create(**kwargs).choices[0].text for _ in range(2)]
    reference = tierspec.generate("Once upon a time", target=smollm, method="ar", max_new_tokens=16, temperature=1.0,
                                  seed=7, chat_template=False)
    assert texts == [reference.text] * 2


@pytest.mark.parametrize("method", ["hybrid", "eagle", "adaptive-pld"])
def test_a_seed_fixes_a_speculative_methods_text_across_requests(client, smollm, method):
    """Issue finding 1 on the server: ``eagle``, ``hybrid`` and ``adaptive-pld`` gave other texts
    for the same seed from one request to the next. Now the same seed gives ``ar``'s text (the
    seed contract: every lossless method samples what plain decoding samples), also with another
    request of the same method in between."""
    prompt = "Write a short story about a robot learning to paint."
    kwargs = {"model": MODEL, "prompt": prompt, "max_tokens": 24, "temperature": 1.0, "seed": 7,
              "extra_body": {"method": method}}
    first = client.completions.create(**kwargs).choices[0].text
    client.completions.create(**{**kwargs, "prompt": "1, 2, 3, 4, 5, 6, 7, 8,", "seed": 11})
    again = client.completions.create(**kwargs).choices[0].text
    reference = tierspec.generate(prompt, target=smollm, method="ar", max_new_tokens=24, temperature=1.0, seed=7,
                                  chat_template=False)
    assert first == again == reference.text


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


@pytest.fixture(scope="module")
def byte_bound_server(smollm):
    """A server whose default method was built on a pinned pass-cost table in which a pass of k
    tokens costs what one costs plus 2% a token (a CPU whose passes stream their weights), not on
    this machine's measured one, and a draft-head step pinned at a tenth of a pass (what its weight
    bytes say): how long a cost-aware draft may be then depends on the model's acceptance and the
    request, never on how fast or busy the CPU running the tests is (a CI machine whose wider
    passes measured slow drafted one token whatever num_draft allowed)."""
    from tierspec import methods
    from tierspec.costs import ForwardCosts

    def pinned_table(target, max_tokens):
        return ForwardCosts({k: 0.01 * (1 + 0.02 * (k - 1)) for k in range(1, max_tokens + 1)})

    engine = Scheduler(smollm, max_queue=0)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(methods, "_cost_table", pinned_table)
        patch.setattr(methods, "_head_fractions", lambda target, head: {"head": 0.1})
        engine.method(engine.default_method)  # built (and cached) before serving starts
    with serving_in_background(engine) as port:
        yield engine, port


def test_a_requests_num_draft_sizes_the_default_methods_drafts(byte_bound_server):
    """Issue 37: the default (cost-aware) method ignored num_draft. A request's num_draft is the
    longest draft its generation may verify; the text stays the lossless text; ar refuses one."""
    engine, port = byte_bound_server
    client = openai_client(port)
    messages = [{"role": "user", "content": QUESTION}]
    replies = {n: client.chat.completions.create(model=MODEL, messages=messages, max_tokens=48, temperature=0,
                                                 extra_body={"num_draft": n}) for n in (1, 8)}
    lengths = {n: len(reply.usage.model_dump()["acceptance_by_position"]) for n, reply in replies.items()}
    assert lengths[1] <= 1 < lengths[8] <= 8
    assert replies[1].choices[0].message.content == replies[8].choices[0].message.content
    with pytest.raises(openai.BadRequestError, match="takes no num_draft"):
        client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, temperature=0,
                                       extra_body={"method": "ar", "num_draft": 2})


def test_stop_sequence_cuts_the_text(client):
    full = client.completions.create(model=MODEL, prompt="Count: one, two, three,", max_tokens=16, temperature=0)
    text = full.choices[0].text
    stop = text[len(text) // 2: len(text) // 2 + 2]
    assert stop.strip(), text
    cut = client.completions.create(model=MODEL, prompt="Count: one, two, three,", max_tokens=16, temperature=0,
                                    stop=[stop])
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].text == text[: text.index(stop)]


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


# ---- bad input: 400 with OpenAI's error body, strict types -----------------------------------------

@pytest.mark.parametrize("request_kwargs, param", [
    ({"extra_body": {"method": "warp-drive"}}, "method"),
    ({"max_tokens": 10 ** 6}, "max_tokens"),
    ({"temperature": "hot"}, "temperature"),
    ({"extra_body": {"frobnicate": True}}, "frobnicate"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "user", "content": "   "}]}, "messages"),
    ({"top_p": 0}, "top_p"),
    ({"seed": 2 ** 64}, "seed"),  # above int64: was a 500
    ({"max_tokens": "5"}, "max_tokens"),  # was coerced to 5
    ({"max_tokens": True}, "max_tokens"),  # was taken as 1
    ({"extra_body": {"num_draft": 2.5}}, "num_draft"),
    ({"extra_body": {"num_draft": 10 ** 6}}, "num_draft"),  # was accepted (issue 40)
    ({"stream_options": {"include_usage": True}}, "stream_options"),  # without stream: OpenAI answers 400
    ({"extra_body": {"top_k": 10 ** 6}}, "top_k"),
])
def test_bad_requests_get_400_with_an_openai_error_body(client, request_kwargs, param):
    kwargs = {"model": MODEL, "messages": [{"role": "user", "content": QUESTION}], "max_tokens": 4, **request_kwargs}
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(**kwargs)
    error = caught.value.body
    assert caught.value.status_code == 400 and error["type"] == "invalid_request_error"
    assert param in (error.get("param") or "") + error["message"]


@pytest.mark.parametrize("body, param, message", [
    (b'{"model": "smollm2-135m", "messages": [{"role": "user", "content": "a\\ud800b"}]}', "messages.0.content",
     "lone surrogate"),  # was a 500 in plain text
    (b'{"model": "smollm2-135m", "messages": [{"role": "user", "content": "Hi"}], "stream": "yes"}', "stream",
     "valid boolean"),  # was taken as true
    (b'{"model": "smollm2-135m", "messages": [{"role": "user", "content": "Hi"}], "stop": ["\\udc00"]}', "stop.0",
     "lone surrogate"),
    (b'{"model": "smollm2-135m", "messages": [{"role": "user", "conte', None, "not valid JSON"),  # param was "17"
    (b'{"model": "smollm2-135m", "messages": [{"role": "user", "content": "\xff"}]}', None, "not valid JSON"),
    (b'[1, 2]', None, "a JSON object"),
    (b'[' * 100_000, None, "nested too deeply"),
    (b'', None, "not valid JSON"),
])
def test_malformed_bodies_get_400_with_an_openai_error_body(server, body, param, message):
    status, _, error = post(server[1], "/v1/chat/completions", body)
    assert status == 400 and is_error_body(error), error
    assert error["error"]["param"] == param and message in error["error"]["message"]


def test_every_error_uses_the_openai_error_body(server):
    _, port = server
    status, body = get(port, "/v1/nothing-here")
    assert status == 404 and is_error_body(body) and body["error"]["type"] == "not_found_error"
    status, body = get(port, "/v1/chat/completions")
    assert status == 405 and is_error_body(body)
    status, _, body = post(port, "/v1/completions", {"model": "gpt-4", "prompt": "Hi"})
    assert status == 404 and is_error_body(body) and body["error"]["param"] == "model"


def test_a_prompt_longer_than_the_context_gets_400_before_generating(client, server):
    engine, _ = server
    before = engine.health()
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=MODEL, prompt="hello " * 9000, max_tokens=1)  # > 8192 tokens
    assert caught.value.body["param"] == "prompt" and "context" in caught.value.body["message"]
    assert engine.health()["completed"] == before["completed"] and engine.health()["failed"] == before["failed"]


# ---- size limit; no CPU work on the event loop -----------------------------------------------------

def test_a_body_over_the_size_limit_gets_413_with_an_openai_error_body(smollm):
    engine = Scheduler(smollm, method="ar", max_queue=0)
    with serving_in_background(engine, max_request_bytes=20_000) as port:
        with pytest.raises(openai.APIStatusError) as caught:
            openai_client(port).completions.create(model=MODEL, prompt="word " * 5000, max_tokens=1)
        assert caught.value.status_code == 413 and is_error_body({"error": caught.value.body})
        assert "20000 bytes" in caught.value.body["message"]
        # the same without a Content-Length (chunked): the limit counts the bytes as they come
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        pieces = [b'{"model": "smollm2-135m", "prompt": "', *[b"word " * 1000] * 5, b'"}']
        connection.request("POST", "/v1/completions", iter(pieces), {"Content-Type": "application/json"},
                           encode_chunked=True)
        response = connection.getresponse()
        assert response.status == 413 and is_error_body(json.loads(response.read()))
        connection.close()
        reply = openai_client(port).completions.create(model=MODEL, prompt="word " * 100, max_tokens=1)
        assert reply.usage.completion_tokens == 1  # under the limit: served
    assert engine.health()["completed"] == 1


class GatedTokenizer:
    """The real tokenizer, except that encoding a long text waits for ``release`` (after setting
    ``entered``): it stands for the seconds a huge prompt takes to tokenise."""

    def __init__(self, tokenizer):
        self._tokenizer = tokenizer
        self.entered, self.release = threading.Event(), threading.Event()

    def __call__(self, text, *args, **kwargs):
        if len(text) > 1_000:
            self.entered.set()
            assert self.release.wait(120)
        return self._tokenizer(text, *args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._tokenizer, name)


def test_health_answers_while_a_large_prompt_is_tokenised(smollm):
    """A 20 MB prompt blocked /health for 14.6 s: tokenisation ran on the event loop. The gated
    tokenizer stands for those seconds, so the prompt itself stays short (with a 4,000-token prompt
    the reply did not come within the client's 60 s timeout on a 2-core AVX2 machine, one thread)."""
    tokenizer = GatedTokenizer(smollm.tokenizer)
    engine = Scheduler(dataclasses.replace(smollm, tokenizer=tokenizer), method="ar", max_queue=0)
    with serving_in_background(engine) as port, ThreadPoolExecutor(1) as pool:
        big = pool.submit(post, port, "/v1/completions", {"model": MODEL, "prompt": "word " * 300, "max_tokens": 1})
        try:
            assert tokenizer.entered.wait(60)
            status, health = get(port, "/health", timeout=20)  # the tokenisation is still held
            assert status == 200 and health["status"] == "ok"
        finally:
            tokenizer.release.set()
        status, _, reply = big.result(timeout=120)
        assert status == 200 and reply["usage"]["completion_tokens"] == 1


# ---- clients that leave; a bounded method cache -------------------------------------------------------

def test_full_queue_answers_503_and_a_streaming_disconnect_stops_the_generation(client, server):
    engine, port = server
    before = dict(engine.health())
    connection, response = open_stream(port, endless(stream=True))
    with pytest.raises(openai.APIStatusError) as caught:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": QUESTION}], max_tokens=4)
    assert caught.value.status_code == 503
    assert caught.value.response.headers.get("retry-after") == "1"
    assert caught.value.body["type"] == "server_busy"
    response.close()
    connection.close()  # the client goes away mid-stream
    health = wait_idle(engine)  # 4000 tokens would take minutes
    assert health["cancelled"] == before["cancelled"] + 1 and health["refused"] == before["refused"] + 1
    reply = client.completions.create(model=MODEL, prompt="Hello", max_tokens=3, temperature=0)
    assert reply.usage.completion_tokens >= 1  # the model was freed


def test_a_non_streaming_client_that_leaves_stops_its_generation(queued_server):
    """Issue 23 finding 3: a non-streaming 1500-token request ran to the end after its client
    timed out, and the requests queued behind it waited."""
    engine, port = queued_server
    before = wait_idle(engine)
    leaving = start_request(port, endless(stream=False), "/v1/completions")
    wait_until(lambda: engine.health()["running"], what="the generation to start")
    with ThreadPoolExecutor(1) as pool:
        queued = pool.submit(openai_client(port).completions.create, model=MODEL, prompt="Hello", max_tokens=3,
                             temperature=0)
        wait_until(lambda: engine.health()["waiting"] == 1, what="the second request to queue")
        leaving.close()  # the client goes away without reading its answer
        assert queued.result(timeout=90).usage.completion_tokens >= 1  # 4000 tokens would take minutes
    health = wait_idle(engine)
    assert health["cancelled"] == before["cancelled"] + 1 and health["completed"] == before["completed"] + 1


def test_a_queued_request_whose_client_left_never_starts(queued_server):
    engine, port = queued_server
    before = wait_idle(engine)
    running, response = open_stream(port, endless(stream=True))
    leaving = start_request(port, endless(stream=False), "/v1/completions")
    wait_until(lambda: engine.health()["waiting"] == 1, what="the request to queue")
    leaving.close()
    # its place in the queue is freed at once, while the first generation still runs
    health = health_when(engine, lambda h: h["withdrawn"] == before["withdrawn"] + 1,
                         what="the queued request to be withdrawn")
    assert health["waiting"] == 0 and health["running"] == 1
    response.close()
    running.close()
    health = wait_idle(engine)
    assert health["cancelled"] == before["cancelled"] + 1 and health["completed"] == before["completed"]


def test_back_to_back_requests_find_the_server_free(client):
    """With no waiting room, a request sent the moment the previous answer arrived must not be
    refused: the engine frees itself before it sends a generation's last event."""
    for _ in range(8):
        reply = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": QUESTION}],
                                               max_tokens=1, temperature=0, extra_body={"method": "ar"})
        assert reply.usage.completion_tokens == 1


def test_one_method_serves_every_num_draft(client, server):
    """Issue 23 finding 4 (a method built and kept for every num_draft a client sent) and issue 37
    (a second, identical method per num_draft): a method is built once per name; each request's
    num_draft sizes its own generation's policy."""
    engine, port = server
    before = get(port, "/health")[1]["methods_cached"]
    for value in range(0, 11):
        reply = client.completions.create(model=MODEL, prompt="Hello", max_tokens=2, temperature=0,
                                          extra_body={"method": "hybrid", "num_draft": value})
        assert reply.usage.completion_tokens == 2
    status, health = get(port, "/health")
    assert health["methods_cached"] <= before + 1


# ---- text cut inside a character -------------------------------------------------------------------

def test_text_cut_inside_an_emoji_ends_without_a_replacement_character(client, smollm):
    """Issue 23 finding 12: a max_tokens that ends inside an emoji gave text ending in U+FFFD."""
    messages = [{"role": "user", "content": "Write a short happy message with lots of emojis."}]
    reference = tierspec.generate(messages[0]["content"], target=smollm, method="ar", max_new_tokens=12)
    cuts = [k for k in range(1, 13) if smollm.tokenizer.decode(reference.token_ids[:k]).endswith("\ufffd")]
    assert cuts, "the model's answer has no character split over tokens"
    cut = cuts[-1]
    expected = smollm.tokenizer.decode(reference.token_ids[:cut]).rstrip("\ufffd")
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=cut, temperature=0,
                                           extra_body={"method": "ar"})
    assert whole.choices[0].message.content == expected and whole.choices[0].finish_reason == "length"
    chunks = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=cut, temperature=0,
                                            stream=True, extra_body={"method": "ar"})
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected


# ---- the serve command: SIGTERM, a port in use -------------------------------------------------------

def serve_process(port: int, *flags: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(ROOT)}
    return subprocess.Popen([sys.executable, "-m", "tierspec.cli", "serve", "--port", str(port), "--method", "ar",
                             "--log-level", "warning", *flags], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def wait_serving(process: subprocess.Popen, port: int) -> None:
    def up():
        assert process.poll() is None, process.stderr.read().decode()
        try:
            return get(port, "/health", timeout=2)[0] == 200
        except OSError:
            return False

    wait_until(up, 180, "serve to come up")


def test_sigterm_ends_every_open_request_well_and_exits_0():
    """Issue 23 finding 10: SIGTERM cut the running stream without a final chunk or [DONE],
    closed a queued client's connection with no response, and exited by the signal. A batch of
    one (``--max-batch 1``) so that the two later requests wait in the queue."""
    port = free_port()
    process = serve_process(port, "--max-queue", "2", "--max-batch", "1", "--max-request-bytes", "30000")
    try:
        wait_serving(process, port)
        status, _, body = post(port, "/v1/completions", {"model": MODEL, "prompt": "word " * 7000})
        assert status == 413 and is_error_body(body)  # --max-request-bytes
        streaming, response = open_stream(port, endless(stream=True))
        with ThreadPoolExecutor(2) as pool:
            queued = [pool.submit(post, port, "/v1/completions", endless(stream=stream), timeout=120)
                      for stream in (False, True)]
            wait_until(lambda: get(port, "/health")[1]["waiting"] == 2, what="two queued requests")
            process.send_signal(signal.SIGTERM)
            lines = [line.decode().strip() for line in response.readlines() if line.strip()]
            for future in queued:  # each queued client gets a 503 with an error body
                status, headers, body = future.result(timeout=60)
                assert status == 503 and is_error_body(body) and body["error"]["type"] == "server_shutting_down"
        streaming.close()
        assert lines[-1] == "data: [DONE]"  # the running stream ends well-formed
        last = json.loads(lines[-2].removeprefix("data: "))
        assert last["choices"][0]["finish_reason"] == "length"
        assert process.wait(timeout=60) == 0
        log = process.stderr.read().decode()
        assert "stopped on SIGTERM" in log and "3 ended by the shutdown" in log, log
        assert "Cancel" not in log and "Traceback" not in log, log
    finally:
        if process.poll() is None:
            process.kill()


def test_a_shutdown_answers_a_running_non_streaming_request_503(smollm):
    engine = Scheduler(smollm, method="ar", max_queue=0)
    with ThreadPoolExecutor(1) as pool:
        with serving_in_background(engine) as port:
            running = pool.submit(post, port, "/v1/completions", endless(stream=False), timeout=120)
            wait_until(lambda: engine.health()["running"], what="the generation to start")
        # leaving the block shuts the server down as SIGTERM does
        status, _, body = running.result(timeout=60)
    assert status == 503 and is_error_body(body) and body["error"]["type"] == "server_shutting_down"
    assert engine.health()["interrupted"] == 1


def test_serve_on_a_port_in_use_is_a_one_line_error():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        process = serve_process(taken.getsockname()[1])
        _, err = process.communicate(timeout=120)
    log = err.decode().strip()
    assert process.returncode == 2
    assert log.startswith("tierspec: error:") and "in use" in log and "\n" not in log, log
    assert "stopped" not in log


def test_a_batching_server_gives_every_request_its_solo_reply(smollm):
    """Issue 31 through the official client: four requests at once on a server batching up to four
    generations (the default method, greedy and seeded; a stop sequence; logprobs, streamed and
    not) get exactly the replies the same requests get one at a time from a server of batch one."""
    requests = [
        ("chat", {"messages": [{"role": "user", "content": QUESTION}], "max_tokens": 24, "temperature": 0}),
        ("chat", {"messages": [{"role": "user", "content": "Write a haiku about rain."}], "max_tokens": 24,
                  "temperature": 1.0, "seed": 3}),
        ("completion", {"prompt": ENDLESS, "max_tokens": 24, "temperature": 0, "stop": [" 15"], "logprobs": 2}),
        ("stream", {"messages": [{"role": "user", "content": "Count to five."}], "max_tokens": 20, "temperature": 0,
                    "logprobs": True, "top_logprobs": 2}),
    ]

    def reply(client, kind, body):
        if kind == "completion":
            choice = client.completions.create(model=MODEL, **body).choices[0]
            return choice.text, choice.finish_reason, choice.logprobs.tokens, choice.logprobs.token_logprobs
        if kind == "chat":
            choice = client.chat.completions.create(model=MODEL, **body).choices[0]
            return choice.message.content, choice.finish_reason
        text, finish, logprobs = "", None, []
        for chunk in client.chat.completions.create(model=MODEL, stream=True, **body):
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
                finish = chunk.choices[0].finish_reason or finish
                if chunk.choices[0].logprobs is not None:
                    logprobs += [(e.token, e.logprob) for e in chunk.choices[0].logprobs.content or ()]
        return text, finish, logprobs

    alone = Scheduler(smollm, max_queue=4)
    with serving_in_background(alone) as port:
        solo = [reply(openai_client(port), kind, body) for kind, body in requests]
    batched = Scheduler(smollm, max_queue=4, max_batch=4)
    with serving_in_background(batched) as port:
        client = openai_client(port)
        with ThreadPoolExecutor(len(requests)) as pool:
            together = list(pool.map(lambda r: reply(client, *r), requests))
        assert batched.health()["completed"] == len(requests)
        times = batched.batch.times  # the requests shared passes: more than one generation per cycle on average
        assert times.sequences > times.cycles
    assert together == solo
    assert solo[2][1] == "stop" and not solo[2][0].endswith(" 15")  # the stop sequence cut it
    assert solo[3][2] and solo[3][1] == "length"


def test_a_requests_dead_end_fails_it_alone(smollm):
    """A response_format whose text needs a special token's text: every request of the batch answered 500."""
    import requests

    engine = Scheduler(smollm, method="ar", max_queue=4, max_batch=4)
    plain = {"messages": [{"role": "user", "content": "Count to five."}], "max_tokens": 24, "temperature": 0}
    dead = {"messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 24, "temperature": 0,
            "response_format": {"type": "regex", "regex": "hi<\\|im_start\\|>"}}
    with serving_in_background(engine) as port:
        url = f"http://127.0.0.1:{port}/v1/chat/completions"
        solo = requests.post(url, json=plain, timeout=120).json()["choices"][0]["message"]["content"]
        with ThreadPoolExecutor(2) as pool:
            answers = list(pool.map(lambda body: requests.post(url, json=body, timeout=120), [dead, plain, dead]))
        assert [a.status_code for a in answers] == [400, 200, 400]
        assert "'<|im_start|>'" in answers[0].json()["error"]["message"]
        assert answers[1].json()["choices"][0]["message"]["content"] == solo
        health = engine.health()
        assert health["failed"] == 0 and health["invalid"] >= 2


def test_a_bug_reading_a_request_is_a_500_counted_as_failed(server, monkeypatch):
    """/health's failed counted the worker's errors only: a 500 from reading a request left it at 0."""
    import requests

    from tierspec.server import app

    engine, port = server
    wait_idle(engine)
    before = engine.health()["failed"]

    def broken(*args):
        raise RuntimeError("a bug")

    monkeypatch.setattr(app, "prepare", broken)
    answer = requests.post(f"http://127.0.0.1:{port}/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=60)
    assert answer.status_code == 500 and answer.json()["error"]["type"] == "server_error"
    assert engine.health()["failed"] == before + 1


def test_completion_text_offsets_count_a_split_character_once(smollm):
    """Each token's offset advanced by its own text's length: a character split over three tokens (each
    shown as U+FFFD) counted three, and every later offset drifted (non-streaming; the stream was right)."""
    from tierspec.decode import TokenLogprob
    from tierspec.server.app import COMPLETIONS, TokenTexts

    text = "🌏 in braille, café"
    ids = smollm.tokenizer.encode(text, add_special_tokens=False)
    assert len(ids) > len(smollm.tokenizer.encode(" in braille, café", add_special_tokens=False)) + 1  # split
    logprobs = COMPLETIONS.logprobs([TokenLogprob(token, -1.0) for token in ids], TokenTexts(smollm.tokenizer), 5)
    expected = [5 + len(smollm.tokenizer.decode(ids[:i]).rstrip("\ufffd")) for i in range(len(ids))]
    assert logprobs["text_offset"] == expected
    pieces = logprobs["tokens"]
    assert text[expected[-1] - 5:] == pieces[-1]  # the last token's text where its offset says


def test_the_server_puts_what_it_loaded_out_of_the_collectors_reach():
    """``settle_heap`` (``tierspec serve``, once the default method is built): what exists then is
    frozen — no collection walks it again — and what is made later is collected as before."""
    import gc

    from tierspec.server import settle_heap

    loaded = [object()]  # a container the collector tracks, made "at start-up"
    frozen_before = gc.get_freeze_count()
    try:
        settle_heap()
        assert gc.get_freeze_count() > frozen_before
        assert not any(o is loaded for o in gc.get_objects())  # in the permanent generation
        later = [object()]
        assert any(o is later for o in gc.get_objects())
    finally:
        gc.unfreeze()
