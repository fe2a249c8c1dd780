"""OpenAI's response_format / tools / tool_choice as typed records (tierspec/structured.py): what
is accepted and refused (with the field named), the tool-call grammar walked on planted replies,
constrained decoding of tool calls on a tiny random model, and replies read back into
``tool_calls`` whose arguments validate."""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch
from conftest import tiny_llama
from grammar_fixtures import EOS, ByteTokenizer, constrained_ar

from tierspec.grammar import GrammarSpec, compile_grammar
from tierspec.structured import (
    CALL_CLOSE,
    CALL_OPEN,
    StructuredError,
    ToolChoice,
    parse_response_format,
    parse_tool_reply,
    parse_tools,
    tool_call_grammar,
    tool_system_prompt,
    with_tools,
)

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 6},
                                                    "unit": {"enum": ["c", "f"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"type": "integer", "minimum": -12,
                                                                                  "maximum": 14}},
                                       "required": ["zone"], "additionalProperties": False}}}


@pytest.fixture(scope="module")
def tok():
    return ByteTokenizer()


# -- response_format ----------------------------------------------------------------------------------------
def test_response_formats():
    assert parse_response_format(None).grammar is None
    assert parse_response_format({"type": "text"}).grammar is None
    assert parse_response_format({"type": "json_object"}).grammar == GrammarSpec.json_object()
    schema = {"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "string"}}}
    parsed = parse_response_format({"type": "json_schema", "json_schema": {"name": "pair", "schema": schema,
                                                                           "strict": True}})
    assert (parsed.kind, parsed.name, parsed.strict) == ("json_schema", "pair", True)
    assert json.loads(parsed.grammar.source) == schema and list(json.loads(parsed.grammar.source)["properties"]) == ["b", "a"]
    assert parse_response_format({"type": "regex", "regex": "[a-z]+"}).grammar == GrammarSpec.regex("[a-z]+")
    assert parse_response_format({"type": "grammar", "grammar": 'start: "x"'}).grammar == GrammarSpec.lark('start: "x"')


@pytest.mark.parametrize("value, message, param", [
    ("json", "response_format must be an object, got a string", "response_format"),
    ({"type": "xml"}, "response_format.type must be one of text, json_object, json_schema, regex, grammar, got 'xml'",
     "response_format.type"),
    ({"type": "json_object", "schema": {}}, "unknown field(s) schema; allowed: type", "response_format"),
    ({"type": "json_schema"}, "response_format.json_schema must be an object, got null", "response_format.json_schema"),
    ({"type": "json_schema", "json_schema": {"schema": {}}}, "json_schema.name must be 1-64 letters",
     "response_format.json_schema.name"),
    ({"type": "json_schema", "json_schema": {"name": "a b", "schema": {}}}, "json_schema.name must be",
     "response_format.json_schema.name"),
    ({"type": "json_schema", "json_schema": {"name": "x"}}, "json_schema.schema is missing",
     "response_format.json_schema.schema"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": []}}, "json_schema.schema must be an object, got a list",
     "response_format.json_schema.schema"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {}, "strict": "yes"}},
     "json_schema.strict must be a boolean", "response_format.json_schema.strict"),
    ({"type": "regex", "regex": ""}, "response_format.regex must be a non-empty string", "response_format.regex"),
])
def test_bad_response_formats_name_the_field(value, message, param):
    with pytest.raises(StructuredError) as error:
        parse_response_format(value)
    assert str(error.value).startswith(message) and error.value.param == param


# -- tools and tool_choice ------------------------------------------------------------------------------------
def test_tools_and_choices():
    config = parse_tools([WEATHER, TIME])
    assert [tool.name for tool in config.tools] == ["get_weather", "get_time"]
    assert config.choice == ToolChoice("auto") and config.parallel and config.active
    assert parse_tools(None).choice == ToolChoice("none") and not parse_tools(None).active
    assert not parse_tools([WEATHER], "none").active
    named = parse_tools([WEATHER, TIME], {"type": "function", "function": {"name": "get_time"}}, False)
    assert named.choice == ToolChoice("function", "get_time") and not named.parallel
    assert [tool.name for tool in named.offered()] == ["get_time"]
    bare = parse_tools([{"type": "function", "function": {"name": "ping"}}])
    assert bare.tools[0].parameters == {"type": "object", "properties": {}, "additionalProperties": False}


@pytest.mark.parametrize("tools, choice, message, param", [
    ("x", None, "tools must be a list", "tools"),
    ([{"type": "code_interpreter"}], None, "tool type 'code_interpreter' is not supported", "tools.0.type"),
    ([{"type": "function", "function": {"name": "bad name"}}], None, "a function's name must be", "tools.0.function.name"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}], None,
     "function.parameters must be an object schema", "tools.0.function.parameters"),
    ([{"type": "function", "function": {"name": "f", "params": {}}}], None, "unknown field(s) params",
     "tools.0.function"),
    ([WEATHER, WEATHER], None, "two tools are named 'get_weather'", "tools"),
    ([WEATHER], "always", "tool_choice must be", "tool_choice"),
    (None, "required", "tool_choice 'required' needs tools", "tool_choice"),
    ([WEATHER], {"type": "function", "function": {"name": "nope"}}, "tool_choice names function 'nope'",
     "tool_choice.function.name"),
    ([WEATHER], {"type": "allowed_tools"}, "tool_choice type 'allowed_tools' is not supported", "tool_choice.type"),
])
def test_bad_tools_name_the_field(tools, choice, message, param):
    with pytest.raises(StructuredError) as error:
        parse_tools(tools, choice)
    assert str(error.value).startswith(message) and error.value.param == param


def test_the_tools_are_described_in_the_system_message():
    config = parse_tools([WEATHER, TIME], "required")
    prompt = tool_system_prompt(config)
    assert '"name": "get_weather"' in prompt and "You must call at least one" in prompt and CALL_OPEN in prompt
    messages = with_tools([{"role": "user", "content": "hi"}], config)
    assert messages[0] == {"role": "system", "content": prompt} and messages[1] == {"role": "user", "content": "hi"}
    joined = with_tools([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}], config)
    assert joined[0]["content"] == "Be brief.\n\n" + prompt and len(joined) == 2
    history = with_tools([
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "unit": "c"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "3 degrees"}], config)
    assert history[2] == {"role": "assistant",
                          "content": CALL_OPEN + '[{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "c"}}]' + CALL_CLOSE}
    assert history[3] == {"role": "user", "content": "<tool_response>3 degrees</tool_response>"}
    assert with_tools([{"role": "user", "content": "hi"}], parse_tools([WEATHER], "none")) == [{"role": "user", "content": "hi"}]


# -- the grammar of a reply -------------------------------------------------------------------------------
def takes(tok, compiled, text: str) -> bool:
    """Whether the grammar takes all of ``text`` and then the end."""
    state = compiled.new_state()
    ids = tok.encode(text)
    return state.advance(ids + [EOS]) == len(ids) + 1


def test_tool_call_grammar_by_choice(tok):
    call = '<tool_call>[{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "c"}}]</tool_call>'
    two = ('<tool_call>[{"name": "get_time", "arguments": {"zone": 2}}, '
           '{"name": "get_weather", "arguments": {"city": "Rome", "unit": "f"}}]</tool_call>')
    auto = compile_grammar(tool_call_grammar(parse_tools([WEATHER, TIME])), tok, len(tok), [EOS])
    assert takes(tok, auto, call) and takes(tok, auto, two) and takes(tok, auto, "It is sunny.")
    assert not takes(tok, auto, '<tool_call>[{"name": "get_weather", "arguments": {"city": "Oslo"}}]</tool_call>')
    assert not takes(tok, auto, "<tool_call>not json")  # text may not begin with the tag
    for space in (" ", "\n", " \n\t"):  # nor after whitespace: the reply is read back stripped, as calls
        assert not takes(tok, auto, space + '<tool_call>[{"name": "get_rain", "arguments": {}}]</tool_call>')
        assert takes(tok, auto, space + "It is sunny.")
    assert not takes(tok, auto, '<tool_call>[{"name": "get_rain", "arguments": {}}]</tool_call>')
    required = compile_grammar(tool_call_grammar(parse_tools([WEATHER, TIME], "required", False)), tok, len(tok), [EOS])
    assert takes(tok, required, call) and not takes(tok, required, two) and not takes(tok, required, "It is sunny.")
    named = compile_grammar(tool_call_grammar(parse_tools([WEATHER, TIME], {"type": "function", "function": {
        "name": "get_time"}})), tok, len(tok), [EOS])
    assert not takes(tok, named, call)
    state = named.new_state()  # the tag, the list, the name and the key are forced
    assert tok.decode(state.forced()) == '<tool_call>[{"name": "get_time", "arguments": {"zone": '

    assert tool_call_grammar(parse_tools([WEATHER], "none")) is None


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
@pytest.mark.parametrize("seed", [None, 0, 1])
def test_constrained_tool_calls_on_a_random_model_always_parse_and_validate(tok, choice, seed):
    model = tiny_llama(seed=5, vocab_size=len(tok), layers=2, hidden=32, sharpness=8.0)
    config = parse_tools([WEATHER, TIME], choice, False)  # one call: a random model may not stop adding calls
    compiled = compile_grammar(tool_call_grammar(config), tok, len(tok), [EOS])
    generator = None if seed is None else torch.Generator().manual_seed(seed)
    out = constrained_ar(model.model, tok.encode("call: "), compiled, 300, {EOS}, generator)
    assert out[-1] == EOS
    reply = parse_tool_reply(tok.decode(out[:-1]), config)
    assert reply.problem is None and reply.content is None and reply.finish_reason == "tool_calls"
    schemas = {tool.name: tool.parameters for tool in config.offered()}
    for call in reply.tool_calls:
        jsonschema.validate(json.loads(call.arguments), schemas[call.name])
        assert call.id.startswith("call_")


# -- reading replies back -------------------------------------------------------------------------------------
def test_replies_read_back():
    config = parse_tools([WEATHER, TIME])
    reply = parse_tool_reply('<tool_call>[{"name": "get_time", "arguments": {"zone": -3}}]</tool_call>', config)
    assert reply.content is None and reply.finish_reason == "tool_calls"
    assert reply.tool_calls[0].as_openai() == {"id": reply.tool_calls[0].id, "type": "function",
                                               "function": {"name": "get_time", "arguments": '{"zone": -3}'}}
    assert parse_tool_reply("Sunny.", config) == parse_tool_reply("Sunny.", config)
    assert parse_tool_reply("Sunny.", config).content == "Sunny." and parse_tool_reply("Sunny.", config).finish_reason is None
    cut = parse_tool_reply('<tool_call>[{"name": "get_time", "argu', config)
    assert cut.tool_calls == () and cut.content.startswith("<tool_call>") and "not closed" in cut.problem
    wrong = parse_tool_reply('<tool_call>[{"name": "get_time", "arguments": {"zone": 99}}]</tool_call>', config)
    assert wrong.tool_calls == () and "99 is greater than the maximum of 14" in wrong.problem
    one = parse_tools([WEATHER, TIME], "auto", False)  # parallel_tool_calls false: one call at most, read back too
    two = parse_tool_reply('<tool_call>[{"name": "get_time", "arguments": {"zone": 1}}, '
                           '{"name": "get_time", "arguments": {"zone": 2}}]</tool_call>', one)
    assert two.tool_calls == () and "2 calls where parallel_tool_calls is false" in two.problem
    # tool_choice "none": the text is content whatever it looks like
    none = parse_tools([WEATHER], "none")
    assert parse_tool_reply('<tool_call>[]</tool_call>', none).content == '<tool_call>[]</tool_call>'
