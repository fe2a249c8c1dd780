"""The server's structured-output fields checked and compiled at parse time
(tierspec/server/structured.py): a 400 naming the field for every fault, the compiled grammar
otherwise; and how a streamed reply under tools is held until it is known to be text or calls
(tierspec/server/app.py). The endpoints themselves: tests/faces/test_server_clients.py."""

from __future__ import annotations

import pytest
from grammar_fixtures import EOS, ByteTokenizer

from tierspec.server.scheduler import ApiError
from tierspec.server.structured import structured_request

TOOL = {"type": "function", "function": {"name": "lookup", "parameters": {
    "type": "object", "properties": {"q": {"type": "string", "maxLength": 5}}, "required": ["q"],
    "additionalProperties": False}}}
ANSWER = {"type": "json_schema", "json_schema": {"name": "answer", "strict": True, "schema": {
    "type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"], "additionalProperties": False}}}


@pytest.fixture(scope="module")
def tok():
    return ByteTokenizer()


def request(tok, chat=True, **fields):
    return structured_request(fields, tok, len(tok), [EOS], chat)


def takes(tok, compiled, text: str) -> bool:
    ids = tok.encode(text)
    return compiled.new_state().advance(ids + [EOS]) == len(ids) + 1


def test_unconstrained_requests_compile_nothing(tok):
    assert request(tok).grammar is None
    assert request(tok, response_format={"type": "text"}).grammar is None
    assert request(tok, tools=[TOOL], tool_choice="none").grammar is None


def test_a_schema_and_tools_together(tok):
    both = request(tok, response_format=ANSWER, tools=[TOOL])
    assert takes(tok, both.grammar, '{"a": 3}')
    assert takes(tok, both.grammar, '<tool_call>[{"name": "lookup", "arguments": {"q": "x"}}]</tool_call>')
    assert not takes(tok, both.grammar, "plain text") and not takes(tok, both.grammar, '{"b": 3}')
    required = request(tok, response_format=ANSWER, tools=[TOOL], tool_choice="required")
    assert not takes(tok, required.grammar, '{"a": 3}')  # calls only: the format does not apply
    assert request(tok, chat=False, response_format=ANSWER).constrained  # completions take a format


@pytest.mark.parametrize("fields, chat, message, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "array", "uniqueItems": True}}}}, True,
     "the JSON schema uses keywords tierspec cannot enforce: uniqueItems", "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}}}, True,
     "invalid JSON schema: Invalid type: strin", "response_format"),
    ({"response_format": {"type": "regex", "regex": "[0-9"}}, True, "invalid regular expression", "response_format"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"not": {"type": "string"}}}}}}]}, True,
     "tools.0.function.parameters (f): the JSON schema uses keywords tierspec cannot enforce: not",
     "tools.0.function.parameters"),  # named, not the reply's joined Lark grammar
    ({"response_format": {"type": "regex", "regex": "[^\\s\\S]"}}, True,  # was a 500 at the first token
     "the regular expression matches no text", "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "oneOf": [{"type": "number"}, {"type": "integer"}], "x-guidance": {"coerce_one_of": True}}}}}, True,
     "invalid JSON schema: oneOf constraints are not supported", "response_format"),  # was enforced as anyOf
    ({"tools": [TOOL]}, False, "tools is for /v1/chat/completions", "tools"),
    ({"tool_choice": "auto"}, True, "tool_choice 'auto' needs tools", "tool_choice"),
    ({"response_format": {"type": "regex", "regex": "[a-z]+"}, "tools": [TOOL]}, True,
     "response_format 'regex' cannot be combined with tools", "response_format"),
    ({"response_format": {"type": "json"}}, True, "response_format.type must be one of", "response_format.type"),
])
def test_faults_are_400s_naming_the_field(tok, fields, chat, message, param):
    with pytest.raises(ApiError) as error:
        request(tok, chat, **fields)
    assert error.value.status == 400 and error.value.message.startswith(message) and error.value.param == param


def test_a_streamed_reply_is_held_while_it_may_begin_a_call_block(tok):
    """``app.HeldToolReply``: text that may still become ``<tool_call>`` is held; once it cannot,
    everything held goes out; a block is read back whole at the end, a cut one released as text."""
    from tierspec.server.app import HeldToolReply
    from tierspec.server.scheduler import TextPiece

    tools = request(tok, tools=[TOOL], tool_choice="auto").tools
    held = HeldToolReply(tools)
    pieces = [TextPiece(text) for text in (" <to", "ol_call>[{\"name\": \"lookup\", ", "\"arguments\": {\"q\": \"ab\"}}]",
                                           "</tool_call>")]
    assert all(held.feed(piece) == [] for piece in pieces)
    released, reply = held.end()
    assert released == pieces and [call.name for call in reply.tool_calls] == ["lookup"]
    assert reply.tool_calls[0].arguments == '{"q": "ab"}' and reply.finish_reason == "tool_calls"

    text = HeldToolReply(tools)
    first, second, third = TextPiece("<"), TextPiece("b>"), TextPiece(" more")
    assert text.feed(first) == [] and text.feed(second) == [first, second] and text.feed(third) == [third]
    assert text.end() == ([], None)  # content: nothing held, nothing to read back

    cut = HeldToolReply(tools)
    assert cut.feed(TextPiece('<tool_call>[{"name": "loo')) == []
    released, reply = cut.end()
    assert [piece.text for piece in released] == ['<tool_call>[{"name": "loo'] and not reply.tool_calls
    assert reply.problem and "not closed" in reply.problem
