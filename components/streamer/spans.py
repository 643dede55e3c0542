"""A request's spans at the streamer: ``weir.request``, its root in the engine, from its
Submit to its terminal, and ``stream``, from its first delta to its terminal."""
from __future__ import annotations

from typing import Any

import msgspec
from opentelemetry import trace
from opentelemetry.trace import Status, StatusCode

from bus import tracing
from components.streamer.registry import Active
from schemas.client import Submit, Usage

_TRACER = trace.get_tracer("weir.streamer")


def start_request(sub: Submit, tenant: str, traceparent: str | None,
                  record_content: bool) -> Any:
    """The request's root span, child of the client's ``traceparent``; with
    ``record_content`` (off by default: text stays out) it holds the prompt."""
    p = sub.params
    span = _TRACER.start_span("weir.request", context=tracing.context_from(traceparent),
                              kind=trace.SpanKind.SERVER, attributes={
        "weir.request_id": sub.request_id, "weir.tenant": tenant,
        "gen_ai.operation.name": "chat" if sub.messages is not None else "text_completion",
        "gen_ai.request.max_tokens": p.max_tokens if p.max_tokens is not None else -1,
        "gen_ai.request.temperature": p.temperature, "gen_ai.request.top_p": p.top_p,
        "gen_ai.request.top_k": p.top_k})
    if record_content:
        span.set_attribute("gen_ai.prompt", sub.prompt if sub.prompt is not None else
                           msgspec.json.encode(sub.messages or sub.prompt_token_ids).decode())
    return span


def start_stream(req: Active) -> None:
    """``req``'s first delta: its ``stream`` span starts (once)."""
    if req.delivery is None:
        req.delivery = _TRACER.start_span("stream",
                                          context=trace.set_span_in_context(req.span))


def end_request(req: Active, terminal: str, reason: str = "",
                usage: Usage | None = None) -> None:
    """``req``'s terminal: its root span ends with how it ended, its stream span too."""
    attrs: dict[str, Any] = {"weir.terminal": terminal, "weir.reason": reason}
    if usage is not None:
        attrs.update({"gen_ai.usage.input_tokens": usage.prompt_tokens,
                      "gen_ai.usage.output_tokens": usage.completion_tokens,
                      "weir.usage.cached_tokens": usage.cached_tokens})
    if terminal == "finished":
        attrs["gen_ai.response.finish_reasons"] = (reason,)
    elif terminal in ("failed", "rejected"):
        req.span.set_status(Status(StatusCode.ERROR, terminal))
    if req.delivery is not None:
        req.delivery.end()
    if req.completion is not None:
        attrs["gen_ai.completion"] = "".join(req.completion)
    req.span.set_attributes(attrs)
    req.span.end()
