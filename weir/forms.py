"""The SDK's friendly forms of what a request carries, made into the protocol's types:
chat messages and tools in OpenAI's shapes, structured output from keywords, replica
addresses as ``weir route --replica`` writes them."""
from __future__ import annotations

from typing import Any

import msgspec

from schemas.client import ChatMessage, ReplicaAddress, StructuredOutput, Tool, ToolCall


def replica_address(spec: ReplicaAddress | str) -> ReplicaAddress:
    """``"name=endpoint[,kv_events[,pool]]"`` (as ``weir route --replica`` takes it) or
    itself."""
    if isinstance(spec, ReplicaAddress):
        return spec
    name, sep, rest = spec.partition("=")
    if not sep:
        raise ValueError(f"a replica is NAME=ENDPOINT[,KV_EVENTS[,POOL]], got {spec!r}")
    endpoint, _, rest = rest.partition(",")
    kv_events, _, pool = rest.partition(",")
    return ReplicaAddress(name, endpoint, kv_events, pool or "default")


def json_text(value: Any) -> str | None:
    return value if value is None or isinstance(value, str) else \
        msgspec.json.encode(value).decode()


def chat_message(m: dict | ChatMessage) -> ChatMessage:
    """A chat message from OpenAI's shape: ``role``, ``content`` (None with calls), an
    assistant's ``tool_calls`` (``{"id", "function": {"name", "arguments"}}``), a tool
    answer's ``tool_call_id``."""
    if isinstance(m, ChatMessage):
        return m
    calls = tuple(c if isinstance(c, ToolCall) else ToolCall(
        c["id"], c["function"]["name"], json_text(c["function"].get("arguments")) or "{}")
        for c in m.get("tool_calls") or ())
    return ChatMessage(m["role"], m.get("content") or "", calls, m.get("tool_call_id"))


def tool(t: dict | Tool) -> Tool:
    """A tool from OpenAI's shape (``{"type": "function", "function": {"name",
    "description", "parameters"}}``) or its function alone."""
    if isinstance(t, Tool):
        return t
    f = t.get("function", t)
    return Tool(f["name"], f.get("description"), json_text(f.get("parameters")))


def structured_output(json: str | dict | None = None, *, json_object: bool = False,
                      regex: str | None = None, choice: list[str] | None = None,
                      grammar: str | None = None, json_whitespace: bool = False
                      ) -> StructuredOutput:
    """A ``StructuredOutput``; ``json`` a JSON Schema as a dict or as JSON text."""
    return StructuredOutput(json=json_text(json), json_object=json_object,
                            regex=regex, choice=None if choice is None else tuple(choice),
                            grammar=grammar, json_whitespace=json_whitespace)
