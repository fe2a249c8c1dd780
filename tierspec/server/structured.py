"""A request's ``response_format``, ``tools``, ``tool_choice`` and ``parallel_tool_calls`` →
what the scheduler constrains the reply to, checked and compiled while the request is parsed, so
that an unsupported schema or a bad tool is a 400 naming the field before any work starts.

``parsing.prepare`` calls it (the request models keep these fields as their JSON): the compiled
grammar is each choice's ``DecodeConfig.constraint``, the tools rewrite the chat's messages
(``structured.with_tools``) and ride on the job, and the handler reads each reply back with
``structured.parse_tool_reply`` (``app.ChatCompletions.choice``, ``app.HeldToolReply``).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..grammar import CompiledGrammar, GrammarError, GrammarSpec, compile_grammar
from ..structured import ResponseFormat, StructuredError, ToolConfig, parse_response_format, parse_tools, reply_grammar
from .scheduler import ApiError


@dataclass(frozen=True)
class StructuredRequest:
    """What one request asks of its reply's form: the parsed ``response_format`` and tools, and
    the compiled grammar every choice's state starts from (None: unconstrained)."""

    response: ResponseFormat
    tools: ToolConfig
    grammar: CompiledGrammar | None

    @property
    def constrained(self) -> bool:
        return self.grammar is not None


def structured_request(fields: dict, tokenizer, vocab_size: int, eos_token_ids, chat: bool) -> StructuredRequest:
    """``fields``: the request body's ``response_format``, ``tools``, ``tool_choice`` and
    ``parallel_tool_calls`` (absent = not given), as JSON values. ``chat``: the chat endpoint
    (tools are refused elsewhere). An ``ApiError`` 400 naming the field on any fault."""
    try:
        response = parse_response_format(fields.get("response_format"))
        if not chat and any(fields.get(name) is not None for name in ("tools", "tool_choice", "parallel_tool_calls")):
            name = next(name for name in ("tools", "tool_choice", "parallel_tool_calls") if fields.get(name) is not None)
            raise StructuredError(f"{name} is for /v1/chat/completions: a completion has no tool calls", name)
        tools = parse_tools(fields.get("tools"), fields.get("tool_choice"), fields.get("parallel_tool_calls"))
        spec = reply_grammar(response, tools)
    except StructuredError as error:
        raise ApiError(400, str(error), error.param) from None
    except GrammarError as error:  # a grammar field that is not a string, say
        raise ApiError(400, str(error), "response_format") from None
    if spec is None:
        return StructuredRequest(response, tools, None)
    try:
        compiled = compile_grammar(spec, tokenizer, vocab_size, eos_token_ids)
    except GrammarError as error:
        if not tools.active:
            raise ApiError(400, str(error), "response_format") from None
        # the reply's grammar joins every tool's schema: name the one at fault, not the joined grammar
        for index, tool in enumerate(tools.tools):
            try:
                compile_grammar(GrammarSpec.json_schema(tool.parameters), tokenizer, vocab_size, eos_token_ids)
            except GrammarError as fault:
                where = f"tools.{index}.function.parameters"
                raise ApiError(400, f"{where} ({tool.name}): {fault}", where) from None
        raise ApiError(400, str(error), "tools") from None
    return StructuredRequest(response, tools, compiled)
