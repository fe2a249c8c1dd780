"""Structured output and tool calls, OpenAI's way, as typed records: what to constrain a
generation to (``response_format``, ``tools``, ``tool_choice`` → a ``GrammarSpec``), how tools
are shown to a model whose chat template has no tool support, and how its reply is read back
into OpenAI's ``tool_calls`` (docs/structured.md).

The tool-call format. SmolLM2's chat template (the default model's) renders only role and
content: it has no tool syntax. tierspec therefore describes the tools in the system message and
constrains the reply with a grammar, in the format SmolLM2's instruction data uses for function
calls (a JSON list inside ``<tool_call>`` tags, tools listed inside ``<tools>`` tags):

    <tool_call>[{"name": "get_weather", "arguments": {"city": "Paris"}}]</tool_call>

The grammar (a Lark grammar with one embedded JSON schema) makes each call's ``name`` one of
the functions and its ``arguments`` an object valid for that function's ``parameters``; with
``parallel_tool_calls: false`` the list holds one call. ``tool_choice``:

- ``"auto"``: plain text that does not start with ``<tool_call>``, or a tool-call block;
- ``"required"``: a tool-call block; a named function: a block of calls to that one;
- ``"none"``: no tools shown, no grammar (the tools change nothing).

A reply that is a complete block becomes ``tool_calls`` (``arguments`` as JSON text, checked
against the schema again with ``jsonschema``) and ``finish_reason`` ``"tool_calls"``.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from typing import Literal

from .errors import TierspecError
from .grammar import JSON_OPTIONS, GrammarSpec

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
#: OpenAI's rule for function and response-format names.
NAME_PATTERN = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
MAX_TOOLS = 128  # OpenAI's limit
EMPTY_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}


class StructuredError(TierspecError):
    """A ``response_format``, ``tools`` or ``tool_choice`` that cannot be served; ``param`` names
    the field at fault (the server's 400 carries it)."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


# -- response_format ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ResponseFormat:
    """A parsed ``response_format``: ``grammar`` None for plain text; ``name`` the json_schema's."""

    kind: Literal["text", "json_object", "json_schema", "regex", "grammar"]
    grammar: GrammarSpec | None = None
    name: str | None = None
    strict: bool = False


def _expect(value, kinds, what: str, param: str):
    if isinstance(value, bool) and bool not in (kinds if isinstance(kinds, tuple) else (kinds,)):
        raise StructuredError(f"{what} must be {_kind_names(kinds)}, got a boolean", param)
    if not isinstance(value, kinds):
        raise StructuredError(f"{what} must be {_kind_names(kinds)}, got {_json_type(value)}", param)
    return value


def _kind_names(kinds) -> str:
    names = {dict: "an object", str: "a string", bool: "a boolean", list: "a list"}
    return " or ".join(names[k] for k in (kinds if isinstance(kinds, tuple) else (kinds,)))


def _json_type(value) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean", type(None): "null",
            int: "a number", float: "a number"}.get(type(value), type(value).__name__)


def _no_other_keys(value: dict, allowed: set[str], param: str) -> None:
    extra = sorted(set(value) - allowed)
    if extra:
        raise StructuredError(f"unknown field(s) {', '.join(extra)}; allowed: {', '.join(sorted(allowed))}", param)


def parse_response_format(value) -> ResponseFormat:
    """OpenAI's ``response_format``: ``{"type": "text"}``, ``{"type": "json_object"}``,
    ``{"type": "json_schema", "json_schema": {"name", "description"?, "schema", "strict"?}}``;
    and tierspec's ``{"type": "regex", "regex": ...}`` and ``{"type": "grammar", "grammar": <Lark>}``.
    ``strict`` is accepted either way: the schema is always enforced whole (or refused)."""
    if value is None:
        return ResponseFormat("text")
    _expect(value, dict, "response_format", "response_format")
    kind = value.get("type")
    fields = {"text": set(), "json_object": set(), "json_schema": {"json_schema"}, "regex": {"regex"},
              "grammar": {"grammar"}}
    if kind not in fields:
        raise StructuredError(f"response_format.type must be one of {', '.join(fields)}, got {kind!r}",
                              "response_format.type")
    _no_other_keys(value, {"type"} | fields[kind], "response_format")
    if kind == "text":
        return ResponseFormat("text")
    if kind == "json_object":
        return ResponseFormat("json_object", GrammarSpec.json_object())
    if kind in ("regex", "grammar"):
        source = value.get(kind)
        if not isinstance(source, str) or not source.strip():
            raise StructuredError(f"response_format.{kind} must be a non-empty string", f"response_format.{kind}")
        return ResponseFormat(kind, GrammarSpec.regex(source) if kind == "regex" else GrammarSpec.lark(source))
    spec = _expect(value.get("json_schema"), dict, "response_format.json_schema", "response_format.json_schema")
    param = "response_format.json_schema"
    _no_other_keys(spec, {"name", "description", "schema", "strict"}, param)
    name = spec.get("name")
    if not isinstance(name, str) or not NAME_PATTERN.match(name):
        raise StructuredError("json_schema.name must be 1-64 letters, digits, '_' or '-'", f"{param}.name")
    if "description" in spec:
        _expect(spec["description"], str, "json_schema.description", f"{param}.description")
    if "schema" not in spec:
        raise StructuredError("json_schema.schema is missing: give the JSON schema to follow", f"{param}.schema")
    schema = _expect(spec["schema"], dict, "json_schema.schema", f"{param}.schema")
    strict = spec.get("strict")
    if strict is not None:
        _expect(strict, bool, "json_schema.strict", f"{param}.strict")
    return ResponseFormat("json_schema", GrammarSpec.json_schema(schema), name, bool(strict))


# -- tools ------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class FunctionTool:
    """One function tool; ``parameters`` is the JSON schema its arguments follow (as JSON text,
    key order kept, so the record is hashable)."""

    name: str
    parameters_json: str
    description: str | None = None

    @property
    def parameters(self) -> dict:
        return json.loads(self.parameters_json)


@dataclass(frozen=True)
class ToolChoice:
    mode: Literal["auto", "required", "none", "function"]
    name: str | None = None  # mode "function"


@dataclass(frozen=True)
class ToolConfig:
    """The tools of one request: what the model is shown and how its reply is constrained."""

    tools: tuple[FunctionTool, ...]
    choice: ToolChoice
    parallel: bool = True

    @property
    def active(self) -> bool:
        """Whether the tools change anything (no tools, or ``tool_choice: "none"``: nothing)."""
        return bool(self.tools) and self.choice.mode != "none"

    def offered(self) -> tuple[FunctionTool, ...]:
        """The tools the model may call (a named choice: that one)."""
        if self.choice.mode == "function":
            return tuple(tool for tool in self.tools if tool.name == self.choice.name)
        return self.tools


def parse_tools(tools, tool_choice=None, parallel_tool_calls=None) -> ToolConfig:
    """OpenAI's ``tools`` (function tools: ``{"type": "function", "function": {"name",
    "description"?, "parameters"?, "strict"?}}``), ``tool_choice`` (``"auto"`` — the default
    with tools —, ``"required"``, ``"none"`` — the default without —, or
    ``{"type": "function", "function": {"name": ...}}``) and ``parallel_tool_calls`` (default
    true)."""
    parsed: list[FunctionTool] = []
    if tools is not None:
        _expect(tools, list, "tools", "tools")
        if len(tools) > MAX_TOOLS:
            raise StructuredError(f"{len(tools)} tools; at most {MAX_TOOLS}", "tools")
        for index, tool in enumerate(tools):
            parsed.append(_parse_tool(tool, f"tools.{index}"))
        names = [tool.name for tool in parsed]
        duplicate = next((name for name in names if names.count(name) > 1), None)
        if duplicate:
            raise StructuredError(f"two tools are named {duplicate!r}", "tools")
    if parallel_tool_calls is not None:
        _expect(parallel_tool_calls, bool, "parallel_tool_calls", "parallel_tool_calls")
    choice = _parse_tool_choice(tool_choice, {tool.name for tool in parsed})
    return ToolConfig(tuple(parsed), choice, True if parallel_tool_calls is None else parallel_tool_calls)


def _parse_tool(tool, param: str) -> FunctionTool:
    _expect(tool, dict, "a tool", param)
    if tool.get("type") != "function":
        raise StructuredError(f"tool type {tool.get('type')!r} is not supported: only \"function\" tools", f"{param}.type")
    _no_other_keys(tool, {"type", "function"}, param)
    function = _expect(tool.get("function"), dict, "tool.function", f"{param}.function")
    _no_other_keys(function, {"name", "description", "parameters", "strict"}, f"{param}.function")
    name = function.get("name")
    if not isinstance(name, str) or not NAME_PATTERN.match(name):
        raise StructuredError("a function's name must be 1-64 letters, digits, '_' or '-'", f"{param}.function.name")
    description = function.get("description")
    if description is not None:
        _expect(description, str, "function.description", f"{param}.function.description")
    if function.get("strict") is not None:
        _expect(function["strict"], bool, "function.strict", f"{param}.function.strict")
    parameters = function.get("parameters", EMPTY_PARAMETERS)
    _expect(parameters, dict, "function.parameters", f"{param}.function.parameters")
    if parameters.get("type", "object") != "object":
        raise StructuredError(f"function.parameters must be an object schema (type \"object\"), got type "
                              f"{parameters.get('type')!r}", f"{param}.function.parameters")
    return FunctionTool(name, json.dumps(parameters, ensure_ascii=False), description)


def _parse_tool_choice(value, names: set[str]) -> ToolChoice:
    if value is None:
        return ToolChoice("auto" if names else "none")
    if isinstance(value, str):
        if value not in ("auto", "required", "none"):
            raise StructuredError(f"tool_choice must be \"auto\", \"required\", \"none\" or a function, got {value!r}",
                                  "tool_choice")
        if value != "none" and not names:
            raise StructuredError(f"tool_choice {value!r} needs tools", "tool_choice")
        return ToolChoice(value)
    _expect(value, dict, "tool_choice", "tool_choice")
    if value.get("type") != "function":
        raise StructuredError(f"tool_choice type {value.get('type')!r} is not supported: \"function\" only",
                              "tool_choice.type")
    _no_other_keys(value, {"type", "function"}, "tool_choice")
    function = _expect(value.get("function"), dict, "tool_choice.function", "tool_choice.function")
    _no_other_keys(function, {"name"}, "tool_choice.function")
    name = function.get("name")
    if name not in names:
        raise StructuredError(f"tool_choice names function {name!r}, which is not among the tools", "tool_choice.function.name")
    return ToolChoice("function", name)


# -- what the model is shown, and its grammar -----------------------------------------------------------------
def tool_system_prompt(config: ToolConfig) -> str:
    """The system text that describes the tools and the call format."""
    described = [{"name": tool.name, **({"description": tool.description} if tool.description else {}),
                  "parameters": tool.parameters} for tool in config.offered()]
    many = "one or more" if config.parallel else "one"
    if config.choice.mode == "function":
        rule = f"Call the function {config.choice.name}."
    elif config.choice.mode == "required":
        rule = "You must call at least one of these functions."
    else:
        rule = "Call a function only when it helps to answer; otherwise answer in plain text."
    return (f"You can call functions. They are described in JSON inside <tools></tools>:\n"
            f"<tools>{json.dumps(described, ensure_ascii=False)}</tools>\n{rule}\n"
            f"To call {many}, reply with nothing but {CALL_OPEN}[{{\"name\": <function name>, \"arguments\": "
            f"<arguments as a JSON object>}}]{CALL_CLOSE}")


def with_tools(messages: list[dict], config: ToolConfig) -> list[dict]:
    """``messages`` (role, content) with the tools described in the system message (appended to
    the first message's text when it is a system message, else as a new first message). OpenAI's
    ``tool`` messages and assistant ``tool_calls`` become text the template can render: an
    assistant turn with its call block, a user turn with ``<tool_response>`` tags."""
    rendered = [_as_text_message(message) for message in messages]
    if not config.active:
        return rendered
    prompt = tool_system_prompt(config)
    if rendered and rendered[0]["role"] == "system":
        return [{**rendered[0], "content": rendered[0]["content"] + "\n\n" + prompt}, *rendered[1:]]
    return [{"role": "system", "content": prompt}, *rendered]


def _as_text_message(message: dict) -> dict:
    if message.get("role") == "tool":
        return {"role": "user", "content": f"<tool_response>{message.get('content', '')}</tool_response>"}
    calls = message.get("tool_calls")
    if message.get("role") == "assistant" and calls:
        block = [{"name": call["function"]["name"], "arguments": json.loads(call["function"]["arguments"])}
                 for call in calls]
        text = (message.get("content") or "") + CALL_OPEN + json.dumps(block, ensure_ascii=False) + CALL_CLOSE
        return {"role": "assistant", "content": text}
    return {key: value for key, value in message.items() if key in ("role", "content", "name")}


def _calls_schema(config: ToolConfig) -> dict:
    calls = [{"type": "object", "properties": {"name": {"const": tool.name}, "arguments": tool.parameters},
              "required": ["name", "arguments"], "additionalProperties": False} for tool in config.offered()]
    # The JSON layout of a response_format schema (llguidance reads a %json block's options from
    # its "x-guidance" key).
    schema = {"x-guidance": JSON_OPTIONS, "type": "array", "items": calls[0] if len(calls) == 1 else {"anyOf": calls},
              "minItems": 1}
    if not config.parallel:
        schema["maxItems"] = 1
    return schema


def tool_call_grammar(config: ToolConfig) -> GrammarSpec | None:
    """The grammar of a reply under ``config`` (None: unconstrained)."""
    if not config.active:
        return None
    block = f'"{CALL_OPEN}" calls "{CALL_CLOSE}"'
    calls = f"calls: %json {json.dumps(_calls_schema(config), ensure_ascii=False)}"
    if config.choice.mode == "auto":
        # Text that does not begin with the call tag, after any whitespace (llguidance's & and ~ on a
        # lexeme: the reply is read back stripped, so " <tool_call>…" would be read as calls the
        # grammar never checked), or a block.
        text = f'TEXT: /(.|\\n)+/ & ~/\\s*{re.escape(CALL_OPEN)}(.|\\n)*/'
        return GrammarSpec.lark(f"start: TEXT | {block}\n{text}\n{calls}\n")
    return GrammarSpec.lark(f"start: {block}\n{calls}\n")


def reply_grammar(response: ResponseFormat, config: ToolConfig) -> GrammarSpec | None:
    """The grammar of a reply under both ``response_format`` and the tools (None: free text).
    With ``tool_choice`` auto and a JSON format, the reply is an answer in that format or a call
    block; with required or a named function the format does not apply (the reply is calls)."""
    if not config.active:
        return response.grammar
    if response.grammar is None or config.choice.mode != "auto":
        return tool_call_grammar(config)
    if response.kind not in ("json_object", "json_schema"):
        raise StructuredError(f"response_format {response.kind!r} cannot be combined with tools; use json_schema "
                              "or json_object, or tool_choice \"required\"", "response_format")
    schema = {"type": "object"} if response.kind == "json_object" else json.loads(response.grammar.source)
    if not isinstance(schema, dict):
        raise StructuredError("with tools, the response schema must be an object schema", "response_format")
    answer = {"x-guidance": JSON_OPTIONS, **schema}
    block = f'"{CALL_OPEN}" calls "{CALL_CLOSE}"'
    return GrammarSpec.lark(f"start: answer | {block}\nanswer: %json {json.dumps(answer, ensure_ascii=False)}\n"
                            f"calls: %json {json.dumps(_calls_schema(config), ensure_ascii=False)}\n")


# -- reading a reply back ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ToolCall:
    """One call as OpenAI reports it: ``arguments`` is JSON text."""

    id: str
    name: str
    arguments: str

    def as_openai(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True)
class ToolReply:
    """A reply read back: ``content`` (None when the reply is calls only) and its ``tool_calls``;
    ``problem``: why a reply that began a call block is not one (cut by max_tokens, say)."""

    content: str | None
    tool_calls: tuple[ToolCall, ...] = ()
    problem: str | None = None

    @property
    def finish_reason(self) -> str | None:
        """``"tool_calls"`` when it holds calls, else None (the generation's own reason stands)."""
        return "tool_calls" if self.tool_calls else None


def parse_tool_reply(text: str, config: ToolConfig) -> ToolReply:
    """Read a reply under ``config``: a complete call block → its calls, each checked against
    its function's schema; any other text → content."""
    import jsonschema

    stripped = text.strip()
    if not config.active or not stripped.startswith(CALL_OPEN):
        return ToolReply(text)
    if not stripped.endswith(CALL_CLOSE):
        return ToolReply(text, problem="the tool-call block is not closed (the reply was cut)")
    try:
        block = json.loads(stripped[len(CALL_OPEN):-len(CALL_CLOSE)])
    except ValueError as error:
        return ToolReply(text, problem=f"the tool-call block is not JSON: {error}")
    tools = {tool.name: tool for tool in config.offered()}
    if not isinstance(block, list) or not block:
        return ToolReply(text, problem="the tool-call block is not a non-empty list of calls")
    if not config.parallel and len(block) > 1:
        return ToolReply(text, problem=f"{len(block)} calls where parallel_tool_calls is false (one at most)")
    calls = []
    for index, call in enumerate(block):
        if not isinstance(call, dict) or set(call) != {"name", "arguments"} or call["name"] not in tools:
            return ToolReply(text, problem=f"call {index} is not {{\"name\": <a tool>, \"arguments\": {{...}}}}")
        try:
            jsonschema.validate(call["arguments"], tools[call["name"]].parameters)
        except jsonschema.ValidationError as error:
            return ToolReply(text, problem=f"call {index} ({call['name']}): {error.message}")
        digest = hashlib.blake2b(f"{index}/{stripped}".encode(), digest_size=12).hexdigest()
        calls.append(ToolCall(f"call_{digest}", call["name"], json.dumps(call["arguments"], ensure_ascii=False)))
    return ToolReply(None, tuple(calls))
