"""Trace loaders: exact records from every format, the shared Mooncake traces, a span export
written by the engine's own tracing code, and the exact error for every kind of bad row."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from weir.replay.traces import FORMATS, TraceError, load_trace
from weir.replay.types import TraceRequest

ROOT = Path(__file__).resolve().parents[3]
SHARED = ROOT.parent / "shared" / "traces"
SAMPLE = Path(__file__).resolve().parent / "data" / "mooncake_conversation_head.jsonl"
AZURE_HEADER = "TIMESTAMP,ContextTokens,GeneratedTokens\n"
BURSTGPT_HEADER = "Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n"


def write(tmp_path: Path, name: str, text: str | bytes) -> Path:
    path = tmp_path / name
    if isinstance(text, str):
        path.write_text(text)
    else:
        path.write_bytes(text)
    return path


def span(name: str, start_ns: int, attributes: dict, trace_id: str = "a" * 32,
         span_id: str = "1" * 16, parent: str | None = None) -> str:
    """One line as bus.tracing.JsonlSpanExporter writes it."""
    return json.dumps({
        "trace_id": trace_id, "span_id": span_id, "parent_span_id": parent, "name": name,
        "service": "weir-test", "start_ns": start_ns, "end_ns": start_ns + 1000,
        "attributes": attributes, "events": [], "links": [], "status": "UNSET"},
        separators=(",", ":")) + "\n"


def test_formats_named():
    assert FORMATS == ("mooncake", "azure", "burstgpt", "weir", "otel")


# -- Mooncake

def test_mooncake_rows_sorted_stably_relative_to_the_first(tmp_path):
    path = write(tmp_path, "m.jsonl",
                 '{"timestamp": 5000, "input_length": 700, "output_length": 3, '
                 '"hash_ids": [0, 1]}\n'
                 '\n'
                 '{"timestamp": 1500, "input_length": 10, "output_length": 0, "hash_ids": []}\n'
                 '{"timestamp": 5000, "input_length": 512, "output_length": 9, "hash_ids": [0]}\n'
                 '{"timestamp": 2750, "input_length": 1, "output_length": 2}\n')
    assert load_trace(path, "mooncake") == [
        TraceRequest(index=0, arrival_s=0.0, input_tokens=10, output_tokens=0,
                     source=f"{path}:3"),
        TraceRequest(index=1, arrival_s=1.25, input_tokens=1, output_tokens=2,
                     source=f"{path}:5"),
        TraceRequest(index=2, arrival_s=3.5, input_tokens=700, output_tokens=3,
                     hash_ids=(0, 1), source=f"{path}:1"),
        TraceRequest(index=3, arrival_s=3.5, input_tokens=512, output_tokens=9, hash_ids=(0,),
                     source=f"{path}:4")]


def test_the_checked_in_sample_of_the_conversation_trace():
    trace = load_trace(SAMPLE)
    assert len(trace) == 20
    assert [r.arrival_s for r in trace] == [0.0] * 10 + [3.0] * 10
    assert [r.index for r in trace] == list(range(20))
    assert trace[0] == TraceRequest(index=0, arrival_s=0.0, input_tokens=6758, output_tokens=500,
                                    hash_ids=tuple(range(14)), source=f"{SAMPLE}:1")
    assert trace[19] == TraceRequest(index=19, arrival_s=3.0, input_tokens=16609,
                                     output_tokens=349, hash_ids=(0, *range(528, 560)),
                                     source=f"{SAMPLE}:20")


@pytest.mark.parametrize("name, count, last_s", [
    ("mooncake_conversation_trace.jsonl", 12031, 3536.999),
    ("mooncake_synthetic_trace.jsonl", 3993, 1022.025)])
def test_the_shared_mooncake_traces(name, count, last_s):
    path = SHARED / name
    if not path.exists():
        pytest.skip(f"{path} is not here (the shared traces sit beside the repository)")
    trace = load_trace(path)
    assert len(trace) == count
    assert [r.index for r in trace] == list(range(count))
    arrivals = [r.arrival_s for r in trace]
    assert arrivals == sorted(arrivals) and arrivals[0] == 0.0 and arrivals[-1] == last_s
    assert trace[-1].source == f"{path}:{count}"
    assert all(r.hash_ids and r.prompt is None for r in trace)


# -- Azure and BurstGPT CSV

def test_azure_timestamps_with_seven_fewer_or_no_fractional_digits(tmp_path):
    path = write(tmp_path, "AzureLLMInferenceTrace_conv.csv", AZURE_HEADER
                 + "2023-11-16 23:59:59.6805900,374,44\n"
                 + "2023-11-17 00:00:00.1,1025, 7\n"
                 + "\n"
                 + "2023-11-16 23:59:59,18,0\n"
                 + "2023-11-17 00:00:01.000000001,5,19\n")
    assert load_trace(path, "azure") == [
        TraceRequest(index=0, arrival_s=0.0, input_tokens=18, output_tokens=0,
                     source=f"{path}:5"),
        TraceRequest(index=1, arrival_s=0.68059, input_tokens=374, output_tokens=44,
                     source=f"{path}:2"),
        TraceRequest(index=2, arrival_s=1.1, input_tokens=1025, output_tokens=7,
                     source=f"{path}:3"),
        TraceRequest(index=3, arrival_s=2.000000001, input_tokens=5, output_tokens=19,
                     source=f"{path}:6")]


def test_burstgpt_keeps_failed_requests_with_no_output(tmp_path):
    path = write(tmp_path, "BurstGPT_1.csv", BURSTGPT_HEADER
                 + "5,ChatGPT,472,18,490,Conversation log\n"
                 + "7.25,GPT-4,1020,0,1020,API log\n"
                 + "5.5,ChatGPT,36,100,136,Conversation log\n")
    assert load_trace(path, "burstgpt") == [
        TraceRequest(index=0, arrival_s=0.0, input_tokens=472, output_tokens=18,
                     source=f"{path}:2"),
        TraceRequest(index=1, arrival_s=0.5, input_tokens=36, output_tokens=100,
                     source=f"{path}:4"),
        TraceRequest(index=2, arrival_s=2.25, input_tokens=1020, output_tokens=0,
                     source=f"{path}:3")]


# -- Weir JSONL

def test_weir_rows_with_every_field(tmp_path):
    path = write(tmp_path, "t.jsonl",
                 "# two tenants, one deadline\n"
                 '{"arrival_s": 10.5, "prompt": "Tell me a story.", "output_tokens": 64, '
                 '"tenant": "acme", "api_key": "k-1", "class": "interactive", '
                 '"session_id": "s1", "deadline_ms": 500, "max_tokens": 128, '
                 '"cancel_after_s": 2, "n": 2}\n'
                 "\n"
                 '{"arrival_ms": 10000, "input_tokens": 1024, "hash_ids": [4, 5], '
                 '"tenant": null, "output_tokens": 0}\n'
                 '{"arrival_s": 12, "input_tokens": 7}\n')
    assert load_trace(path, "weir") == [
        TraceRequest(index=0, arrival_s=0.0, input_tokens=1024, output_tokens=0, hash_ids=(4, 5),
                     source=f"{path}:4"),
        TraceRequest(index=1, arrival_s=0.5, prompt="Tell me a story.", output_tokens=64,
                     tenant="acme", api_key="k-1", service_class="interactive",
                     session_id="s1", deadline_ms=500, max_tokens=128, cancel_after_s=2.0,
                     n=2, source=f"{path}:2"),
        TraceRequest(index=2, arrival_s=2.0, input_tokens=7, source=f"{path}:5")]


# -- Weir's OpenTelemetry span export

def test_span_export_by_hand(tmp_path):
    """A retried request (two decisions) is one request, arriving at its earliest span; its
    output comes from its root span when no decode span ended; without either, max_tokens;
    with -1 (unset) max_tokens and deadline, None."""
    t0 = 1_700_000_000_000_000_000
    root, child = "2" * 16, "3" * 16
    decide = {"weir.request_id": "r1", "weir.tenant": "acme", "weir.service_class": "standard",
              "weir.admission.decision": "accept", "gen_ai.usage.input_tokens": 40,
              "gen_ai.request.max_tokens": 64, "weir.admission.deadline_ms": 300}
    path = write(tmp_path, "spans.jsonl",
                 span("weir.submit", t0 + 2_500_000_000, {"weir.request_id": "r1"})
                 + span("weir.request", t0 + 2_500_100_000,
                        {"weir.request_id": "r1", "gen_ai.usage.output_tokens": 9}, span_id=root)
                 + span("admission.decide", t0 + 2_502_000_000, decide, span_id=child,
                        parent=root)
                 + span("scheduler.step", t0 + 2_600_000_000,
                        {"weir.step.request_ids": ["r1"], "weir.step.seq_tokens": [40]},
                        trace_id="c" * 32)
                 + span("admission.decide", t0 + 4_000_000_000, {**decide, "weir.tenant": "x"},
                        parent=root)
                 + span("admission.decide", t0,
                        {"weir.request_id": "r2", "weir.tenant": "acme",
                         "gen_ai.usage.input_tokens": 3, "gen_ai.request.max_tokens": -1,
                         "weir.admission.deadline_ms": -1}, trace_id="d" * 32)
                 + span("admission.decide", t0 + 1_000_000_000,
                        {"weir.request_id": "r3", "gen_ai.usage.input_tokens": 5,
                         "gen_ai.request.max_tokens": 8}, trace_id="e" * 32, parent=root))
    assert load_trace(path) == [
        TraceRequest(index=0, arrival_s=0.0, input_tokens=3, tenant="acme",
                     source=f"{path}:6"),
        TraceRequest(index=1, arrival_s=1.0, input_tokens=5, output_tokens=8, max_tokens=8,
                     source=f"{path}:7"),
        TraceRequest(index=2, arrival_s=2.5, input_tokens=40, output_tokens=9, tenant="acme",
                     service_class="standard", deadline_ms=300, max_tokens=64,
                     source=f"{path}:3")]


class _Sink:
    """Stands in for a bus socket: admission sends its decisions here."""

    async def send(self, *args, **kwargs) -> None:
        pass


@pytest.mark.anyio
async def test_span_export_written_by_the_engines_own_tracing(tmp_path, monkeypatch):
    """Spans written by bus.tracing's exporter, with admission's and the scheduler's own span
    code: the loader reads exactly what the engine writes."""
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor

    from bus import tracing
    from components.admission import service as admission
    from components.scheduler import step_trace
    from schemas.client import SamplingParams, Usage
    from schemas.config import load_config
    from schemas.wire import DetokParams, TokenOut
    from tests import messages as msgs

    out = tmp_path / "spans.jsonl"
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(tracing.JsonlSpanExporter(str(out))))
    tracer = provider.get_tracer("test")
    monkeypatch.setattr(admission, "_TRACER", tracer)
    monkeypatch.setattr(step_trace, "_TRACER", tracer)
    service = admission.AdmissionService(load_config(topology={"run_dir": str(tmp_path)}))
    service.inbox = lambda accepts: _Sink()
    service.push_to = lambda component: _Sink()
    await service.setup()
    steps = step_trace.StepTracer(None, token_budget=256)
    t0 = 1_000_000_000_000_000_000            # the streamer's root spans, back-dated
    roots = []
    for rid, arrival_ns, prompt, max_tokens, deadline_ms in (
            ("late", t0 + 1_250_000_000, 5, 16, None), ("early", t0, 11, 32, 250)):
        root = tracer.start_span("weir.request", start_time=arrival_ns, attributes={
            "weir.request_id": rid, "weir.tenant": "default",
            "gen_ai.request.max_tokens": max_tokens})
        traceparent = tracing.traceparent_of(root)
        await service._admit(msgs.tokenized(rid, "default", list(range(prompt)), [],
                                       SamplingParams(max_tokens=max_tokens), arrival_ns,
                                       deadline_ms=deadline_ms), traceparent, None)
        steps.admitted(rid, traceparent)
        roots.append(root)
    steps.outputs([TokenOut("late", [7], params=DetokParams((), True, 5, 0))])
    steps.outputs([TokenOut("late", [8], finish_reason="stop", usage=Usage(5, 2))])
    steps.released(["late", "early"])          # "early" is cancelled before any output
    for root in roots:
        root.end()
    provider.shutdown()
    assert load_trace(out) == [
        TraceRequest(index=0, arrival_s=0.0, input_tokens=11, output_tokens=32,
                     tenant="default", service_class="interactive", deadline_ms=250,
                     max_tokens=32, source=f"{out}:2"),
        TraceRequest(index=1, arrival_s=1.25, input_tokens=5, output_tokens=2,
                     tenant="default", service_class="interactive", max_tokens=16,
                     source=f"{out}:1")]


# -- detection

@pytest.mark.parametrize("fmt, text", [
    ("mooncake", '{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [0]}\n'),
    ("mooncake", '{"input_length": 5, "timestamp": 3, "output_length": 1}\n'),
    ("azure", AZURE_HEADER + "2023-11-16 18:15:46.6805900,374,44\n"),
    ("azure", "\ufeff" + AZURE_HEADER.replace(",", ", ") + "2024-05-10 00:00:00.01,1,1\n"),
    ("burstgpt", BURSTGPT_HEADER + "5,ChatGPT,472,18,490,Conversation log\n"),
    ("weir", "# a comment first\n\n" + '{"arrival_s": 0, "prompt": "hi"}\n'),
    ("weir", '{"arrival_ms": 0, "input_tokens": 5}\n'),
    ("otel", span("admission.decide", 5, {"weir.request_id": "r",
                                          "gen_ai.usage.input_tokens": 4}))])
def test_auto_detects_each_format(tmp_path, fmt, text):
    path = write(tmp_path, "trace.txt", text)
    trace = load_trace(path)
    assert trace == load_trace(path, fmt)
    assert len(trace) == 1 and trace[0].source == f"{path}:{text.count(chr(10))}"


# -- errors: the first bad row, by file and line

@pytest.mark.parametrize("fmt, text, error", [
    ("mooncake", ('{"timestamp": 0, "input_length": 5, "output_length": 1}\n'
                  '{"timestamp": 1, "input_length": "abc", "output_length": 1}\n'
                  '{"timestamp": -1, "input_length": 5, "output_length": 1}\n'),
     '2: input_length must be a non-negative integer, got "abc"'),
    ("mooncake", '{"timestamp": 0, "input_length": 5, "output_length": true}\n',
     "1: output_length must be a non-negative integer, got true"),
    ("mooncake", '{"timestamp": 0, "input_length": -5, "output_length": 1}\n',
     "1: input_length must be a non-negative integer, got -5"),
    ("mooncake", '{"timestamp": -5, "input_length": 5, "output_length": 1}\n',
     "1: timestamp must be a non-negative number, got -5"),
    ("mooncake", '{"timestamp": 0, "input_length": 5}\n',
     '1: missing required field "output_length"'),
    ("mooncake", '{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": "1,2"}\n',
     '1: hash_ids must be a list of non-negative integers, got "1,2"'),
    ("mooncake", '{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [1, -2]}\n',
     "1: hash_ids[1] must be a non-negative integer, got -2"),
    ("mooncake", '{"timestamp": 0, "input_length": 5, "output_length": 1}\n{"timestamp": 1,\n',
     "2: invalid JSON: Input data was truncated"),
    ("mooncake", '{"timestamp": 0, "input_length": 5, "output_length": 1}\n[1, 2]\n',
     "2: expected a JSON object, got [1,2]"),
    ("weir", '{"arrival_s": 0, "promt": "hi"}\n',
     '1: unknown field "promt" (did you mean "prompt"?)'),
    ("weir", '{"arrival_s": 0, "prompt": "hi", "priority": 1}\n', '1: unknown field "priority"'),
    ("weir", '{"prompt": "hi"}\n', '1: missing required field "arrival_s" (or "arrival_ms")'),
    ("weir", '{"arrival_s": 0, "arrival_ms": 0, "prompt": "hi"}\n',
     '1: give "arrival_s" or "arrival_ms", not both'),
    ("weir", '{"arrival_s": null, "prompt": "hi"}\n',
     "1: arrival_s must be a non-negative number, got null"),
    ("weir", '{"arrival_s": "0", "prompt": "hi"}\n',
     '1: arrival_s must be a non-negative number, got "0"'),
    ("weir", '{"arrival_s": 0, "output_tokens": 5}\n',
     '1: missing required field "prompt" (or "input_tokens")'),
    ("weir", '{"arrival_s": 0, "prompt": "hi", "input_tokens": 2}\n',
     '1: give "prompt" or "input_tokens", not both'),
    ("weir", '{"arrival_s": 0, "prompt": "hi", "hash_ids": [1]}\n',
     '1: "hash_ids" goes with "input_tokens"; a prompt\'s prefixes are its text'),
    ("weir", '{"arrival_s": 0, "input_tokens": false}\n',
     "1: input_tokens must be a non-negative integer, got false"),
    ("weir", '{"arrival_s": 0, "prompt": "hi", "n": 0}\n', "1: n must be an integer >= 1, got 0"),
    ("weir", '{"arrival_s": 0, "prompt": "hi", "max_tokens": 1.5}\n',
     "1: max_tokens must be an integer >= 1, got 1.5"),
    ("weir", '{"arrival_s": 0, "prompt": "hi", "cancel_after_s": -1}\n',
     "1: cancel_after_s must be a non-negative number, got -1"),
    ("weir", '{"arrival_s": 0, "prompt": "hi", "tenant": 5}\n',
     "1: tenant must be a non-empty string, got 5"),
    ("weir", '# header\n{"arrival_s": 0, "prompt": "hi", "class": ""}\n',
     '2: class must be a non-empty string, got ""'),
    ("azure", AZURE_HEADER + "2023-11-16 18:15:46.6805900,374,44\n2023-11-16 18:15:47,374\n",
     "3: expected 3 fields, got 2"),
    ("azure", AZURE_HEADER + "yesterday,374,44\n",
     '2: TIMESTAMP must be a date and time like "2023-11-16 18:15:46.6805900", got "yesterday"'),
    ("azure", AZURE_HEADER + "2023-13-01 00:00:00,374,44\n",
     ('2: TIMESTAMP must be a date and time like "2023-11-16 18:15:46.6805900", '
      'got "2023-13-01 00:00:00"')),
    ("azure", AZURE_HEADER + "2023-11-16 18:15:46.6805900123,374,44\n",
     ('2: TIMESTAMP must be a date and time like "2023-11-16 18:15:46.6805900", '
      'got "2023-11-16 18:15:46.6805900123"')),
    ("azure", AZURE_HEADER + "2023-11-16 18:15:46,12.5,44\n",
     '2: ContextTokens must be a non-negative integer, got "12.5"'),
    ("azure", AZURE_HEADER + "2023-11-16 18:15:46,12,-4\n",
     '2: GeneratedTokens must be a non-negative integer, got "-4"'),
    ("azure", BURSTGPT_HEADER,
     ('1: missing column "TIMESTAMP" in the header (Timestamp, Model, Request tokens, '
      'Response tokens, Total tokens, Log Type)')),
    ("burstgpt", BURSTGPT_HEADER + "nan,ChatGPT,472,18,490,Conversation log\n",
     '2: Timestamp must be a non-negative number of seconds, got "nan"'),
    ("burstgpt", BURSTGPT_HEADER + "-1,ChatGPT,472,18,490,Conversation log\n",
     '2: Timestamp must be a non-negative number of seconds, got "-1"'),
    ("burstgpt", BURSTGPT_HEADER + "1,ChatGPT,472,x,490,Conversation log\n",
     '2: Response tokens must be a non-negative integer, got "x"'),
    ("burstgpt", BURSTGPT_HEADER + "1,ChatGPT,472,18,490,Conversation log,extra\n",
     "2: expected 6 fields, got 7"),
    ("otel", span("admission.decide", 5, {"weir.request_id": "r"}),
     "1: admission.decide span has no gen_ai.usage.input_tokens"),
    ("otel", span("admission.decide", 5, {"weir.request_id": 7,
                                          "gen_ai.usage.input_tokens": 4}),
     "1: admission.decide span's weir.request_id must be a non-empty string, got 7"),
    ("otel", span("decode", 5, {}) + span("decode", 6, {"gen_ai.usage.output_tokens": "2"}),
     '2: decode span\'s gen_ai.usage.output_tokens must be a non-negative integer, got "2"'),
    ("otel", '{"name": "queue", "attributes": {}}\n', '1: missing required field "start_ns"'),
    ("otel", '{"name": "queue", "start_ns": 1, "attributes": []}\n',
     "1: attributes must be an object, got []"),
])
def test_bad_rows_name_file_line_and_reason(tmp_path, fmt, text, error):
    path = write(tmp_path, "trace.txt", text)
    with pytest.raises(TraceError) as exc:
        load_trace(path, fmt)
    assert str(exc.value) == f"{path}:{error}"


@pytest.mark.parametrize("fmt, text", [
    ("auto", ""), ("auto", "\n  \n"), ("weir", "# nothing yet\n"), ("auto", AZURE_HEADER),
    ("otel", span("queue", 5, {"weir.request_id": "r"}))])
def test_a_trace_without_requests_is_an_error(tmp_path, fmt, text):
    path = write(tmp_path, "trace.txt", text)
    with pytest.raises(TraceError, match=r"^.*trace\.txt: no requests in the trace$"):
        load_trace(path, fmt)


@pytest.mark.parametrize("text, error", [
    ('{"a": 1, "b": 2}\n', ("1: unknown trace format: a JSON object with fields a, b; "
                            "pass the format explicitly")),
    ("\n\nid,prompt,output\n1,2,3\n", ("3: unknown trace format: neither a JSONL trace nor an "
                                       "Azure or BurstGPT CSV header")),
    ('{"arrival_s": 0,\n', "1: invalid JSON: Input data was truncated")])
def test_undetectable_traces(tmp_path, text, error):
    path = write(tmp_path, "trace.txt", text)
    with pytest.raises(TraceError) as exc:
        load_trace(path)
    assert str(exc.value) == f"{path}:{error}"


def test_file_level_errors(tmp_path):
    path = write(tmp_path, "trace.csv", AZURE_HEADER.encode()
                 + b"2023-11-16 18:15:46,1,2\n2023-11-16 18:15:47,\xff,2\n")
    with pytest.raises(TraceError) as exc:
        load_trace(path)
    assert str(exc.value) == f"{path}:3: not UTF-8 text"
    with pytest.raises(TraceError) as exc:
        load_trace(path, "parquet")
    assert str(exc.value) == (f"{path}: unknown trace format 'parquet'; expected auto or one "
                              "of mooncake, azure, burstgpt, weir, otel")
    missing = tmp_path / "missing.jsonl"
    with pytest.raises(TraceError) as exc:
        load_trace(missing)
    assert str(exc.value) == f"{missing}: cannot read the trace: No such file or directory"
