"""OpenTelemetry for every process: one TracerProvider per process (``service.name`` =
``weir-<component>``), W3C trace context carried in the bus envelope, and exporters
chosen by config or the standard ``OTEL_*`` variables: OTLP/HTTP, a JSONL file, or none.

Spans never carry prompt or completion text (``telemetry.record_content`` is off by default).
"""
from __future__ import annotations

import json
import os
import threading
from collections.abc import Sequence
from typing import Any

from opentelemetry import context as otel_context, trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF, ParentBased, Sampler, TraceIdRatioBased
from opentelemetry.trace import Link
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from schemas.config import TelemetryConfig

_PROPAGATOR = TraceContextTextMapPropagator()
_PROVIDER: TracerProvider | None = None


class JsonlSpanExporter(SpanExporter):
    """Appends one JSON object per finished span to a file shared by every process.
    Each line is written with a single O_APPEND write, so processes never interleave."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._lock = threading.Lock()
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        with self._lock:
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                for span in spans:
                    line = json.dumps(span_record(span), separators=(",", ":")) + "\n"
                    os.write(fd, line.encode())
            finally:
                os.close(fd)
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        pass


def span_record(span: ReadableSpan) -> dict[str, Any]:
    ctx = span.get_span_context()
    assert ctx is not None                  # an ended span always has its context
    parent = span.parent
    return {
        "trace_id": f"{ctx.trace_id:032x}", "span_id": f"{ctx.span_id:016x}",
        "parent_span_id": f"{parent.span_id:016x}" if parent else None,
        "name": span.name, "service": span.resource.attributes.get("service.name"),
        "start_ns": span.start_time, "end_ns": span.end_time,
        "attributes": dict(span.attributes or {}),
        "events": [{"name": e.name, "time_ns": e.timestamp, "attributes": dict(e.attributes or {})}
                   for e in span.events],
        "links": [{"trace_id": f"{link.context.trace_id:032x}",
                   "span_id": f"{link.context.span_id:016x}",
                   "attributes": dict(link.attributes or {})} for link in span.links],
        "status": span.status.status_code.name,
    }


def sampler_for(exporter_name: str, ratio: float) -> Sampler:
    """Sample ``ratio`` of new traces (and follow a parent's choice) where spans go
    somewhere; where they go nowhere (exporter "none"), record none: a recorded span was
    built (its attributes, links, events) only to be dropped, on every request and every
    step. Unrecorded spans still carry valid contexts, so traceparents still flow."""
    if exporter_name not in ("otlp", "jsonl"):
        return ALWAYS_OFF
    return ParentBased(TraceIdRatioBased(ratio))


def setup(component: str, cfg: TelemetryConfig) -> None:
    """Install this process's tracer provider. Call once, at process start."""
    global _PROVIDER
    exporter_name = os.environ.get("OTEL_TRACES_EXPORTER", cfg.exporter).split(",")[0].strip()
    ratio = float(os.environ.get("OTEL_TRACES_SAMPLER_ARG", cfg.sample_ratio))
    provider = TracerProvider(resource=Resource.create({"service.name": f"weir-{component}",
                                                        "service.namespace": "weir"}),
                              sampler=sampler_for(exporter_name, ratio))
    exporter: SpanExporter | None = None
    if exporter_name == "otlp":
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        endpoint = (os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
                    or (os.environ["OTEL_EXPORTER_OTLP_ENDPOINT"].rstrip("/") + "/v1/traces"
                        if os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") else cfg.otlp_endpoint))
        exporter = OTLPSpanExporter(endpoint=endpoint)
    elif exporter_name == "jsonl":
        exporter = JsonlSpanExporter(os.environ.get("WEIR_TRACE_FILE", cfg.jsonl_path))
    if exporter is not None:
        provider.add_span_processor(BatchSpanProcessor(exporter, schedule_delay_millis=200))
    trace.set_tracer_provider(provider)
    _PROVIDER = provider


def shutdown() -> None:
    if _PROVIDER is not None:
        _PROVIDER.shutdown()


def tracer(name: str) -> trace.Tracer:
    return trace.get_tracer(name)


def context_from(traceparent: str | None) -> otel_context.Context | None:
    """The OpenTelemetry context a W3C ``traceparent`` string names (None if absent/invalid)."""
    if not traceparent:
        return None
    ctx = _PROPAGATOR.extract({"traceparent": traceparent})
    return ctx if trace.get_current_span(ctx).get_span_context().is_valid else None


def traceparent_of(span: trace.Span | None = None) -> str | None:
    """The W3C ``traceparent`` for ``span`` (default: the current span), or None."""
    span = span if span is not None else trace.get_current_span()
    sc = span.get_span_context()
    if not sc.is_valid:
        return None
    return f"00-{sc.trace_id:032x}-{sc.span_id:016x}-{int(sc.trace_flags):02x}"


def link_to(traceparent: str | None, **attributes: Any) -> Link | None:
    ctx = context_from(traceparent)
    if ctx is None:
        return None
    return Link(trace.get_current_span(ctx).get_span_context(), attributes)
