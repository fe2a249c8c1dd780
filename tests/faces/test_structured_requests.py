"""The server's structured-output fields checked and compiled at parse time
(tierspec/server/structured.py): a 400 naming the field for every fault, the compiled grammar
otherwise (wired into the endpoints in phase 2 of issue 39)."""

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
     "the JSON schema uses keywords tierspec cannot enforce: not", "tools"),
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
