"""`weir trace REQUEST_ID --file spans.jsonl`: a request's timeline from the JSONL span
export, as a table, for people without a trace explorer."""
from __future__ import annotations

import json
from pathlib import Path

_SHOWN = ("gen_ai.usage.input_tokens", "gen_ai.usage.output_tokens", "weir.terminal",
          "weir.reason", "weir.admission.decision", "weir.admission.reason",
          "weir.prefill.chunk_tokens", "weir.step.id", "weir.step.tokens_used",
          "weir.step.num_decode", "weir.step.num_prefill", "weir.step.predicted_ms",
          "weir.step.measured_ms", "weir.step.free_kv_blocks", "weir.step.preemptions")


def load(path: str | Path) -> list[dict]:
    spans = []
    for line in Path(path).read_text().splitlines():
        line = line.strip()
        if line:
            spans.append(json.loads(line))
    return spans


def timeline(spans: list[dict], request_id: str) -> list[dict]:
    """The request's spans (its whole trace) plus the scheduler steps linked to it, by start."""
    roots = [s for s in spans if s["name"] == "weir.request"
             and s["attributes"].get("weir.request_id") == request_id]
    if not roots:
        raise LookupError(f"no request {request_id!r} in this file")
    root = roots[0]
    mine = [s for s in spans if s["trace_id"] == root["trace_id"]]
    steps = [s for s in spans if s["name"] == "scheduler.step"
             and any(link["span_id"] == root["span_id"] for link in s.get("links", ()))]
    return sorted(mine + steps, key=lambda s: s["start_ns"])


def render(rows: list[dict], request_id: str) -> str:
    t0 = min(s["start_ns"] for s in rows)
    out = [f"request {request_id}  trace {rows[0]['trace_id']}",
           f"{'start ms':>9} {'dur ms':>9}  {'service':18} {'span':22} details"]
    for s in rows:
        a = s["attributes"]
        details = " ".join(f"{k.split('.')[-1]}={a[k]}" for k in _SHOWN if k in a)
        if s["name"] == "scheduler.step":
            ids, toks = a.get("weir.step.request_ids", []), a.get("weir.step.seq_tokens", [])
            mine = [n for rid, n in zip(ids, toks) if rid == request_id]
            details = f"this request: {mine[0] if mine else 0} tok of {len(ids)} seqs; " + details
        for e in s.get("events", ()):
            if e["name"] == "preemption":
                details += f" PREEMPTED {e['attributes'].get('weir.victim')}"
        out.append(f"{(s['start_ns'] - t0) / 1e6:9.2f} {(s['end_ns'] - s['start_ns']) / 1e6:9.2f}  "
                   f"{(s.get('service') or '')[:18]:18} {s['name'][:22]:22} {details}")
    return "\n".join(out)
