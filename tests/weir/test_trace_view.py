"""`weir trace --steps`: the scheduler's steps from a JSONL span export, one line each
(weir/trace_view.py). The live export is read in tests/e2e/test_tracing.py."""
from __future__ import annotations

import pytest

from weir.trace_view import render_steps, steps


def step(sid: int, start_ms: float, **attrs: object) -> dict:
    a = {"weir.step.id": sid, "weir.step.num_decode": 3, "weir.step.num_prefill": 1,
         "weir.step.token_budget": 480, "weir.step.tokens_used": 451,
         "weir.step.budget_reason": "tpot_slo", "weir.step.tightest_tpot_ms": 300.0,
         "weir.step.predicted_ms": 352.4, "weir.step.measured_ms": 424.71,
         "weir.step.running": 4, "weir.step.waiting": 37}
    return {"name": "scheduler.step", "start_ns": int(start_ms * 1e6),
            "end_ns": int(start_ms * 1e6) + 1, "attributes": {**a, **attrs}}


SPANS = [step(2, 236.4), {"name": "tokenize", "start_ns": 5_000_000, "end_ns": 6_000_000,
                          "attributes": {}},
         step(1, 17.1, **{"weir.step.budget_reason": "no_decodes",
                          "weir.step.tightest_tpot_ms": -1.0, "weir.step.num_decode": 0}),
         step(3, 718.0)]


def test_the_steps_in_start_order_within_the_ids_asked():
    assert [s["attributes"]["weir.step.id"] for s in steps(SPANS)] == [1, 2, 3]
    assert [s["attributes"]["weir.step.id"] for s in steps(SPANS, 2)] == [2, 3]
    assert [s["attributes"]["weir.step.id"] for s in steps(SPANS, 0, 2)] == [1, 2]
    assert [s["attributes"]["weir.step.id"] for s in steps(SPANS, 2, 2)] == [2]
    with pytest.raises(LookupError, match="ids 9..$"):
        steps(SPANS, 9)
    with pytest.raises(LookupError, match="no scheduler.step spans in this file$"):
        steps(SPANS[1:2])


def test_one_line_a_step_from_the_files_first_span():
    text = render_steps(steps(SPANS, 0, 2), t0_ns=5_000_000)
    assert text.splitlines() == [
        " start ms  step decode prefill budget  used         reason tpot_ms  pred_ms  meas_ms"
        " running waiting",
        "     12.1     1      0       1    480   451     no_decodes       -    352.4    424.7"
        "       4      37",
        "    231.4     2      3       1    480   451       tpot_slo   300.0    352.4    424.7"
        "       4      37"]
    partial = step(4, 1.0)
    del partial["attributes"]["weir.step.predicted_ms"]      # a span without a column
    assert render_steps([partial]).splitlines()[1].split()[:8] == [
        "0.0", "4", "3", "1", "480", "451", "tpot_slo", "300.0"]
    assert render_steps([partial]).splitlines()[1].split()[8] == "-"
