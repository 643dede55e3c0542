"""`weir trace REQUEST_ID --file spans.jsonl`: a request's timeline from the JSONL span
export, as a table, for people without a trace explorer; `weir trace --steps --file
spans.jsonl`: the scheduler's steps, one line each, with the token budget it chose, why,
and the step's predicted and measured time (how a burst's prompts were paced)."""
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


# (attribute, column header, width): the step table's columns, in order
_STEP_COLUMNS = (("weir.step.id", "step", 5), ("weir.step.num_decode", "decode", 6),
                 ("weir.step.num_prefill", "prefill", 7), ("weir.step.token_budget", "budget", 6),
                 ("weir.step.tokens_used", "used", 5), ("weir.step.budget_reason", "reason", 14),
                 ("weir.step.tightest_tpot_ms", "tpot_ms", 7),
                 ("weir.step.predicted_ms", "pred_ms", 8), ("weir.step.measured_ms", "meas_ms", 8),
                 ("weir.step.running", "running", 7), ("weir.step.waiting", "waiting", 7))


def steps(spans: list[dict], first: int = 0, last: int | None = None) -> list[dict]:
    """The file's ``scheduler.step`` spans by start, those whose step id is within
    ``first``..``last`` (inclusive; ``None``: to the end)."""
    out = []
    for s in spans:
        if s["name"] != "scheduler.step":
            continue
        sid = s["attributes"].get("weir.step.id", 0)
        if sid >= first and (last is None or sid <= last):
            out.append(s)
    if not out:
        raise LookupError("no scheduler.step spans in this file"
                          + (f" with ids {first}..{'' if last is None else last}"
                             if first or last is not None else ""))
    return sorted(out, key=lambda s: s["start_ns"])


def _cell(value: object, width: int) -> str:
    if value is None:
        return f"{'-':>{width}}"
    if isinstance(value, float):
        return f"{value:>{width}.1f}"
    return f"{value!s:>{width}}"


def render_steps(rows: list[dict], t0_ns: int | None = None) -> str:
    """One line a step: its start in ms from ``t0_ns`` (default: the first row's start),
    then the columns of ``_STEP_COLUMNS`` (``-`` where the span lacks one: a step planned
    with no budget rule has no tightest TPOT)."""
    t0 = rows[0]["start_ns"] if t0_ns is None else t0_ns
    out = [f"{'start ms':>9} " + " ".join(f"{h:>{w}}" for _, h, w in _STEP_COLUMNS)]
    for s in rows:
        a = s["attributes"]
        cells = {k: a.get(k) for k, _, _ in _STEP_COLUMNS}
        if (cells["weir.step.tightest_tpot_ms"] or 0) < 0:     # -1: no stream had a TPOT SLO
            cells["weir.step.tightest_tpot_ms"] = None
        out.append(f"{(s['start_ns'] - t0) / 1e6:9.1f} "
                   + " ".join(_cell(cells[k], w) for k, _, w in _STEP_COLUMNS))
    return "\n".join(out)
