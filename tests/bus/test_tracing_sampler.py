"""Spans are recorded only where they go somewhere: with no exporter a span is not built
(no attributes kept), yet its context is valid, so traceparents still flow between
processes; with an exporter, new traces and a sampled parent's children are recorded."""
from opentelemetry.sdk.trace import TracerProvider

from bus import tracing


def _span(exporter: str, parent: str | None = None):
    provider = TracerProvider(sampler=tracing.sampler_for(exporter, 1.0))
    return provider.get_tracer("t").start_span("s", context=tracing.context_from(parent),
                                               attributes={"weir.x": 1})


def test_no_exporter_records_nothing_but_keeps_a_valid_context():
    sampled_parent = "00-" + "ab" * 16 + "-" + "cd" * 8 + "-01"
    for parent in (None, sampled_parent):
        span = _span("none", parent)
        assert not span.is_recording()
        assert tracing.traceparent_of(span) is not None
    child = _span("none", sampled_parent)
    assert f"{child.get_span_context().trace_id:032x}" == "ab" * 16   # the same trace


def test_an_exporter_records_new_traces_and_a_sampled_parents_children():
    for exporter in ("otlp", "jsonl"):
        span = _span(exporter)
        assert span.is_recording() and span.attributes["weir.x"] == 1
        child = _span(exporter, tracing.traceparent_of(span))
        assert child.is_recording()
        assert child.get_span_context().trace_id == span.get_span_context().trace_id
