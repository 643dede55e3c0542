"""OpenAI tool calling, built on structured output. A chat request's ``tools`` go to the
chat template (which shows them to the model if it takes tools); ``tool_choice``
``"required"`` holds the output to a JSON list of calls (``[{"name": ..., "parameters":
{...}}]``, each call's parameters valid under its function's schema) and a named function
to that function's parameters; the answer's text becomes ``tool_calls``. ``"auto"`` (also
OpenAI's default when tools are given) would need a parser for the model's own tool-call
format, which Weir does not have: it is refused with a 400, as vLLM refuses it without a
``--tool-call-parser``. ``"none"``: the tools are shown, the output is free."""
from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any, Literal

import msgspec

from schemas.client import StructuredOutput, Tool


class FunctionDef(msgspec.Struct, frozen=True):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDef(msgspec.Struct, frozen=True):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(msgspec.Struct, frozen=True):
    name: str


class NamedToolChoice(msgspec.Struct, frozen=True):
    type: Literal["function"]
    function: NamedFunction


class CallFunction(msgspec.Struct, frozen=True):
    name: str
    arguments: str


class CallMsg(msgspec.Struct, frozen=True, kw_only=True):
    """An assistant message's ``tool_calls`` entry, as a client sends it back."""

    id: str
    type: Literal["function"] = "function"
    function: CallFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


@dataclass(frozen=True)
class ToolMode:
    """How an answer becomes tool calls: ``name`` the named function (the text is its
    arguments), or None for ``"required"`` (the text is a JSON list of calls)."""

    name: str | None


class ToolError(ValueError):
    """A request's tools or tool_choice cannot be served (a 400)."""


def _schema(f: FunctionDef) -> dict[str, Any]:
    return f.parameters if f.parameters is not None else {"type": "object"}


def mode_of(tools: list[ToolDef] | None, choice: ToolChoice | None) -> ToolMode | None:
    """How a (valid) request's answer becomes tool calls; None: it stays text."""
    if not tools or choice in (None, "none", "auto"):
        return None
    return ToolMode(None if choice == "required" else choice.function.name)


def tool_request(tools: list[ToolDef] | None, choice: ToolChoice | None,
                 parallel: bool | None) -> tuple[list[Tool], StructuredOutput | None]:
    """The tools for the template, and the structured output ``choice`` asks for.
    Raises ToolError."""
    tools = tools or []
    if not tools:
        if choice not in (None, "none"):
            raise ToolError("tool_choice needs tools")
        return [], None
    engine_tools = [Tool(t.function.name, t.function.description,
                         None if t.function.parameters is None
                         else json.dumps(t.function.parameters, ensure_ascii=False))
                    for t in tools]
    if choice == "none":
        return engine_tools, None
    if choice in (None, "auto"):
        raise ToolError(
            'tool_choice "auto" (OpenAI\'s default when tools are given) needs a parser for '
            "this model's own tool-call format, which this server does not have; ask for "
            'tool_choice "required" or {"type": "function", "function": {"name": ...}}, or '
            '"none"')
    if choice == "required":
        calls = {"anyOf": [{"type": "object", "additionalProperties": False,
                            "required": ["name", "parameters"],
                            "properties": {"name": {"const": t.function.name},
                                           "parameters": _schema(t.function)}}
                           for t in tools]}
        schema = {"type": "array", "minItems": 1, "items": calls}
        if parallel is False:
            schema["maxItems"] = 1
        return engine_tools, StructuredOutput(json=json.dumps(schema))
    named = next((t for t in tools if t.function.name == choice.function.name), None)
    if named is None:
        raise ToolError(f"tool_choice names {choice.function.name[:64]!r}, which is not "
                        "among the tools")
    return engine_tools, StructuredOutput(json=json.dumps(_schema(named.function)))


def call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def calls_of(mode: ToolMode, text: str) -> list[dict[str, Any]] | None:
    """The answer's ``tool_calls`` (OpenAI's shape), or None where ``"required"``'s text is
    not a whole list of calls (``max_tokens`` cut it short). A named function's call is
    its text whatever it holds: cut short, its arguments are too (``finish_reason``
    ``length`` says so, as OpenAI's does)."""
    if mode.name is not None:
        return [{"id": call_id(), "type": "function",
                 "function": {"name": mode.name, "arguments": text}}]
    try:
        items = json.loads(text)
    except ValueError:
        return None
    return [{"id": call_id(), "type": "function",
             "function": {"name": item["name"],
                          "arguments": json.dumps(item["parameters"], ensure_ascii=False)}}
            for item in items]
