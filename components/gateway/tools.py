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


class CallStream:
    """A ``"required"`` answer's calls as its text arrives (the grammar holds it to a JSON
    list of ``{"name": ..., "parameters": {...}}``): each call's opening (its index, id and
    name) once its name is whole, then its arguments, the ``parameters`` value's text, as
    they come: OpenAI's streamed ``tool_calls`` deltas. ``feed`` scans only what is new."""

    def __init__(self) -> None:
        self.text = ""
        self._at = 0                        # scanned up to here
        self._depth = 0
        self._in_string = self._escaped = False
        self._string_start = 0
        self._key: str | None = None        # the call object's key being read or valued
        self._calls: list[dict[str, Any]] = []   # name, args (start, sent up to), opened
        self.opened = 0                     # calls whose opening has gone out

    def feed(self, text: str) -> list[dict[str, Any]]:
        """The deltas ``text`` completes (``[{"index": k, ...}, ...]``, maybe none)."""
        self.text += text
        t = self.text
        while self._at < len(t):
            c, i = t[self._at], self._at
            self._at += 1
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif c == "\\":
                    self._escaped = True
                elif c == '"':
                    self._in_string = False
                    if self._depth == 2:
                        self._string_ended(t[self._string_start:i])
                continue
            if c == '"':
                self._in_string, self._string_start = True, i + 1
                if self._depth == 2 and self._key == "parameters":
                    self._value_starts(i)
            elif c in "[{":
                if self._depth == 1 and c == "{":
                    self._calls.append({"name": None, "args": None, "sent": 0})
                    self._key = None
                elif self._depth == 2 and self._key == "parameters":
                    self._value_starts(i)
                self._depth += 1
            elif c in "]}":
                self._depth -= 1
                if self._depth == 1:
                    self._value_ends(i)
            elif c == "," and self._depth == 2:
                self._value_ends(i)
                self._key = None
            elif self._depth == 2 and self._key == "parameters" and not c.isspace() \
                    and c != ":":
                self._value_starts(i)             # a scalar value
        return self._deltas()

    def whole(self) -> bool:
        """Whether the text fed so far is a whole JSON value (the answer was not cut short)."""
        try:
            json.loads(self.text)
        except ValueError:
            return False
        return True

    def _string_ended(self, s: str) -> None:
        call = self._calls[-1]
        if self._key is None:
            self._key = json.loads(f'"{s}"')
        elif self._key == "name" and call["name"] is None:
            call["name"] = json.loads(f'"{s}"')

    def _value_starts(self, i: int) -> None:
        call = self._calls[-1]
        if call["args"] is None:
            call["args"] = call["sent"] = i

    def _value_ends(self, i: int) -> None:
        if self._calls and self._key == "parameters":
            self._calls[-1].setdefault("end", i)

    def _deltas(self) -> list[dict[str, Any]]:
        out = []
        for k, call in enumerate(self._calls):
            if call["name"] is None:
                break                              # calls open in order
            if k >= self.opened:
                out.append({"index": k, "id": call_id(), "type": "function",
                            "function": {"name": call["name"], "arguments": ""}})
                self.opened = k + 1
            if call["args"] is None:
                continue
            upto = call.get("end", self._at)
            if upto > call["sent"]:
                out.append({"index": k,
                            "function": {"arguments": self.text[call["sent"]:upto]}})
                call["sent"] = upto
        return out


def calls_of(mode: ToolMode, text: str) -> list[dict[str, Any]] | None:
    """The answer's ``tool_calls`` (OpenAI's shape), or None where ``"required"``'s text is
    not a whole list of calls (``max_tokens`` cut it short). A named function's call is
    its text whatever it holds: cut short, its arguments are too (``finish_reason``
    ``length`` says so, as OpenAI's does). A call's arguments are its ``parameters``' text
    as the model wrote it, the same text a stream sends (``CallStream``)."""
    if mode.name is not None:
        return [{"id": call_id(), "type": "function",
                 "function": {"name": mode.name, "arguments": text}}]
    stream = CallStream()
    deltas = stream.feed(text)
    if not stream.whole():
        return None
    calls: list[dict[str, Any]] = []
    for delta in deltas:
        if "id" in delta:
            calls.append({"id": delta["id"], "type": "function",
                          "function": dict(delta["function"])})
        else:
            calls[delta["index"]]["function"]["arguments"] += delta["function"]["arguments"]
    return calls
