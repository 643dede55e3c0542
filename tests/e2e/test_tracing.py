"""One trace per request across the processes, scheduler steps that account for every
token, no prompt or completion text in spans or logs, and metrics that match."""
import concurrent.futures
import secrets

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.e2e.engine import Engine, wait_for
from tests.e2e.otlp_receiver import Receiver
from tests.e2e.test_tcp_topology import free_base_port

MODEL = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def traced(tmp_path_factory, model_path):
    receiver = Receiver()
    toml = f"""
[kv]
num_blocks = 256
[engine]
max_model_len = 1024
[telemetry]
exporter = "otlp"
otlp_endpoint = "{receiver.endpoint}"
"""
    eng = Engine(tmp_path_factory.mktemp("traced"), toml, http_port=free_base_port(1),
                 log_level="debug")
    yield eng, receiver
    eng.stop()
    receiver.close()


def _post(eng, prompt, headers=None, **body):
    return httpx.post(eng.base_url + "/v1/completions", timeout=60, headers=headers or {},
                      json={"model": MODEL, "prompt": prompt, "temperature": 0, **body})


def _wait_for(receiver, pred, timeout=10.0):
    """The receiver's spans once ``pred`` holds for them, else after ``timeout`` (the test
    asserts on what came)."""
    return wait_for(receiver.snapshot, timeout, interval=0.2, until=pred, or_last=True)


def test_one_request_is_one_whole_trace(traced):
    eng, receiver = traced
    trace_id, parent = secrets.token_hex(16), secrets.token_hex(8)
    r = _post(eng, "Tell me about the sea, the waves and the wind.", max_tokens=6,
              headers={"traceparent": f"00-{trace_id}-{parent}-01"})
    assert r.status_code == 200
    wanted = {"POST /v1/completions", "weir.submit", "weir.request", "tokenize",
              "admission.decide", "queue", "prefill", "decode", "detokenize", "stream"}
    spans = _wait_for(receiver, lambda ss: wanted <= {s["name"] for s in ss
                                                      if s["trace_id"] == trace_id})
    mine = [s for s in spans if s["trace_id"] == trace_id]
    assert wanted <= {s["name"] for s in mine}
    services = {s["service"] for s in mine}
    assert len(services) >= 6, services
    by_id = {s["span_id"]: s for s in mine}
    for s in mine:                                   # every parent is in the trace (or the caller)
        assert s["parent_span_id"] in by_id or s["parent_span_id"] == parent, s["name"]
    root = next(s for s in mine if s["name"] == "weir.request")
    assert by_id[root["parent_span_id"]]["name"] == "weir.submit"
    for name in ("tokenize", "admission.decide", "queue", "prefill", "decode", "detokenize",
                 "stream"):
        span = next(s for s in mine if s["name"] == name)
        assert span["parent_span_id"] == root["span_id"], name
    assert root["attributes"]["weir.terminal"] == "finished"
    assert root["attributes"]["gen_ai.usage.output_tokens"] == 6
    decide = next(s for s in mine if s["name"] == "admission.decide")["attributes"]
    assert decide["weir.admission.decision"] == "accept" and decide["weir.tenant"] == "default"
    assert decide["gen_ai.request.max_tokens"] == 6
    # no deadline of its own: it runs on its class's (the default interactive, 3 s)
    assert decide["weir.service_class"] == "interactive"
    assert decide["weir.request.deadline_ms"] == -1
    assert decide["weir.admission.deadline_ms"] == 3000
    assert "weir.admission.predicted_ttft_ms" in decide
    # the scheduler's step spans live on the engine trace and link to this request
    steps = [s for s in spans if s["name"] == "scheduler.step"
             and any(link["span_id"] == root["span_id"] for link in s["links"])]
    assert steps and all(s["trace_id"] != trace_id for s in steps)


def test_step_spans_account_for_every_token(traced):
    eng, receiver = traced
    prompts = [f"Request number {i}: describe a {w} in a few words, please, with care."
               for i, w in enumerate(("mountain", "river", "forest"))]
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        results = list(pool.map(lambda p: _post(eng, p, max_tokens=12, ignore_eos=True), prompts))
    rids = [r.json()["id"].removeprefix("cmpl-") for r in results]
    usage = [r.json()["usage"] for r in results]

    def steps_of(spans):
        return [s for s in spans if s["name"] == "scheduler.step"
                and set(rids) & set(s["attributes"]["weir.step.request_ids"])]

    def complete(spans):
        got = {rid: 0 for rid in rids}
        for s in steps_of(spans):
            for rid, n in zip(s["attributes"]["weir.step.request_ids"],
                              s["attributes"]["weir.step.seq_tokens"]):
                if rid in got:
                    got[rid] += n
        return got

    spans = _wait_for(receiver, lambda ss: all(
        v == u["prompt_tokens"] + u["completion_tokens"] - 1
        for v, u in zip(complete(ss).values(), usage)))
    totals = complete(spans)
    for rid, u in zip(rids, usage):
        assert u["prompt_tokens_details"]["cached_tokens"] == 0
        # every prompt token is computed once; every generated token but the last is fed back
        assert totals[rid] == u["prompt_tokens"] + u["completion_tokens"] - 1
    steps = steps_of(spans)
    assert any(s["attributes"]["weir.step.num_decode"] > 1 for s in steps)   # batched together
    for s in steps:
        a = s["attributes"]
        assert (a["weir.step.tokens_used"] == sum(a["weir.step.seq_tokens"])
                <= a["weir.step.token_budget"])
        assert a["weir.step.measured_ms"] > 0 and "weir.step.predicted_ms" in a
        assert a["weir.step.free_kv_blocks"] >= 0


def test_no_prompt_or_completion_text_in_spans_or_logs(traced):
    eng, receiver = traced
    marker = "zebracorn" + secrets.token_hex(6)
    trace_id = secrets.token_hex(16)
    r = _post(eng, f"My secret word is {marker}. Repeat the secret word:", max_tokens=16,
              headers={"traceparent": f"00-{trace_id}-{secrets.token_hex(8)}-01"})
    text = r.json()["choices"][0]["text"]
    # the request's whole trace, every process's spans, has arrived: all it could leak
    wanted = {"POST /v1/completions", "weir.submit", "weir.request", "tokenize",
              "admission.decide", "queue", "prefill", "decode", "detokenize", "stream"}
    trace_spans = _wait_for(receiver, lambda ss: wanted <= {s["name"] for s in ss
                                                            if s["trace_id"] == trace_id})
    assert wanted <= {s["name"] for s in trace_spans if s["trace_id"] == trace_id}
    blob = repr(receiver.snapshot())
    logs = eng.log_path.read_text(errors="replace")
    assert len(logs) > 1000                         # debug logs were really written
    assert marker not in blob and marker not in logs
    if len(text.strip()) >= 12:
        assert text.strip() not in blob and text.strip() not in logs


def _metric(eng, name) -> float:
    text = httpx.get(eng.base_url + "/metrics").text
    return sum(s.value for fam in text_string_to_metric_families(text) for s in fam.samples
               if s.name == name)


def test_metrics_match_request_count(traced):
    eng, _ = traced
    n = 4
    before = {k: _metric(eng, k) for k in ("weir:request_success_total",
                                           "weir:time_to_first_token_seconds_count",
                                           "weir:e2e_request_latency_seconds_count")}
    for i in range(n):
        assert _post(eng, f"Say {i}.", max_tokens=3).status_code == 200
    for k, v in before.items():
        assert _metric(eng, k) == v + n, k


def test_jsonl_export_and_weir_trace(tmp_path, model_path):
    import os
    import subprocess
    import sys

    from tests.e2e.engine import ROOT

    spans = tmp_path / "spans.jsonl"
    eng = Engine(tmp_path, f'[telemetry]\nexporter = "jsonl"\njsonl_path = "{spans}"\n'
                           'record_content = true\n'
                           '[kv]\nnum_blocks = 128\n[engine]\nmax_model_len = 512\n')
    try:
        with eng.client() as c:
            r = c.generate("Explain rain in one line, for a curious child who asks why.",
                           max_tokens=5, temperature=0.0)
    finally:
        eng.stop()                                  # flushes every process's exporter
    out = subprocess.run([sys.executable, "-m", "weir.cli", "trace", r.request_id, "--file",
                          str(spans)], cwd=ROOT, capture_output=True, text=True,
                         env=dict(os.environ, PYTHONPATH=str(ROOT)), check=True).stdout
    for name in ("weir.request", "tokenize", "admission.decide", "queue", "prefill", "decode",
                 "detokenize", "stream", "scheduler.step"):
        assert f" {name} " in out, (name, out)
    assert "weir-scheduler" in out and "weir-tokenizer" in out
    assert "output_tokens=5" in out
    import json

    root = next(json.loads(line) for line in spans.read_text().splitlines()
                if '"weir.request"' in line and r.request_id in line)
    assert root["attributes"]["gen_ai.prompt"].startswith("Explain rain in one line")
    assert root["attributes"]["gen_ai.completion"] == r.text      # only because it was asked
    bad = subprocess.run([sys.executable, "-m", "weir.cli", "trace", "nope", "--file", str(spans)],
                         cwd=ROOT, capture_output=True, text=True,
                         env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert bad.returncode == 1 and "no request" in bad.stderr
    table = subprocess.run([sys.executable, "-m", "weir.cli", "trace", "--steps", "--file",
                            str(spans)], cwd=ROOT, capture_output=True, text=True,
                           env=dict(os.environ, PYTHONPATH=str(ROOT)), check=True).stdout
    head, *lines = table.splitlines()
    assert head.split()[:9] == ["start", "ms", "step", "decode", "prefill", "budget", "used",
                                "reason", "tpot_ms"], head
    n_steps = sum('"scheduler.step"' in line for line in spans.read_text().splitlines())
    assert len(lines) == n_steps >= 2, table     # a prefill and a decode at least (ngram
    #                                                speculation may take several tokens a step)
    for line in lines:
        _, _, _, _, budget, used, reason, *_ = line.split()
        assert 0 < int(used) <= int(budget) and reason in (
            "full", "no_decodes", "no_tpot_slo", "cost_unknown", "tpot_slo",
            "tpot_slo_mean"), line


def test_admission_predicts_ttft_and_records_the_deadline(traced):
    eng, receiver = traced
    with eng.client() as c:
        for i in range(3):                       # let the step cost model see some steps
            c.generate(f"Warm up {i}: " + "words " * 40, max_tokens=4, temperature=0.0)
        wait_for(lambda: eng.stats("admission").get("prefill_tokens_per_s", 0) > 0,
                 what="admission measuring the prefill rate")
        r = c.generate("Now with a deadline, please answer briefly.", max_tokens=4,
                       temperature=0.0, deadline_ms=5000)
    spans = _wait_for(receiver, lambda ss: any(
        s["name"] == "admission.decide" and s["attributes"].get("weir.request_id") == r.request_id
        for s in ss))
    decide = next(s for s in spans if s["name"] == "admission.decide"
                  and s["attributes"].get("weir.request_id") == r.request_id)["attributes"]
    assert decide["weir.admission.deadline_ms"] == 5000
    assert decide["weir.admission.predicted_ttft_ms"] > 0


def test_admission_knows_the_cached_prefix(traced):
    eng, receiver = traced
    prompt = "Cache probe: " + "lorem ipsum dolor sit amet " * 10
    with eng.client() as c:
        first = c.generate(prompt, max_tokens=2, temperature=0.0)
        second = c.generate(prompt, max_tokens=2, temperature=0.0)

    def decide_of(spans, rid):
        return next((s["attributes"] for s in spans if s["name"] == "admission.decide"
                     and s["attributes"].get("weir.request_id") == rid), None)

    spans = _wait_for(receiver, lambda ss: decide_of(ss, second.request_id) is not None)
    n = second.usage.prompt_tokens
    a1, a2 = decide_of(spans, first.request_id), decide_of(spans, second.request_id)
    assert a1["weir.admission.cached_prompt_tokens"] == 0
    assert (a2["weir.admission.cached_prompt_tokens"] == (n - 1) // 16 * 16
            == second.usage.cached_tokens)
    assert a2["weir.admission.uncached_prompt_tokens"] == n - second.usage.cached_tokens
