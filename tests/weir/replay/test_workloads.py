"""Synthetic fairness traces: seeded, shaped as asked, and written as Weir JSONL that the
loader reads back to the same requests."""
from __future__ import annotations

import msgspec
import pytest

from weir.replay.traces import load_trace, write_weir
from weir.replay.types import TraceRequest
from weir.replay.workloads import TenantLoad, backlogged_tenants, noisy_neighbour


def test_backlogged_tenants_draws_each_tenant_in_its_ranges():
    loads = {"a": TenantLoad(3, (10, 20), (1, 2)), "b": TenantLoad(1, (100, 100), (5, 9))}
    reqs = backlogged_tenants(2000, 50.0, loads, seed=4)
    assert reqs == backlogged_tenants(2000, 50.0, loads, seed=4)
    assert reqs != backlogged_tenants(2000, 50.0, loads, seed=5)
    assert [r.index for r in reqs] == list(range(2000))
    assert all(b.arrival_s > a.arrival_s for a, b in zip(reqs, reqs[1:]))
    assert reqs[-1].arrival_s == pytest.approx(2000 / 50.0, rel=0.1)
    share = sum(r.tenant == "a" for r in reqs) / len(reqs)
    assert share == pytest.approx(0.75, abs=0.03)
    for r in reqs:
        lo, hi = loads[r.tenant].prompt
        assert lo <= r.input_tokens <= hi
        lo, hi = loads[r.tenant].output
        assert lo <= r.output_tokens <= hi
    with pytest.raises(ValueError):
        backlogged_tenants(10, 0.0, loads)


def test_noisy_neighbour_floods_one_tenant_and_ticks_the_other():
    reqs = noisy_neighbour(30.0, flood_rate=5.0, light_every_s=0.5, flood_class="bulk")
    light = [r for r in reqs if r.tenant == "B"]
    flood = [r for r in reqs if r.tenant == "A"]
    assert [r.arrival_s for r in light] == pytest.approx([0.5 * k for k in range(1, 61)])
    assert len(flood) == pytest.approx(150, rel=0.2)
    assert all(1500 <= r.input_tokens <= 1900 and r.service_class == "bulk" for r in flood)
    assert all(32 <= r.input_tokens <= 64 and r.service_class is None for r in light)
    alone = noisy_neighbour(30.0, flood_rate=5.0, light_every_s=0.5, only="B")
    strip = [msgspec.structs.replace(r, index=0) for r in light]
    assert [msgspec.structs.replace(r, index=0) for r in alone] == strip   # the same draws
    assert [r.index for r in alone] == list(range(len(alone)))


def test_write_weir_round_trips_every_field(tmp_path):
    reqs = [TraceRequest(index=0, arrival_s=0.5, input_tokens=7, hash_ids=(1, 2),
                         output_tokens=3, tenant="t", api_key="k", service_class="batch",
                         session_id="s", deadline_ms=900, max_tokens=5, cancel_after_s=1.5,
                         n=2),
            TraceRequest(index=1, arrival_s=2.0, prompt="hello there"),
            TraceRequest(index=2, arrival_s=2.25, input_tokens=0)]
    path = tmp_path / "t.jsonl"
    write_weir(reqs, path)
    back = load_trace(path)
    assert [msgspec.structs.replace(r, source="") for r in back] == [
        msgspec.structs.replace(r, arrival_s=r.arrival_s - 0.5) for r in reqs]
    assert load_trace(path, "weir") == back
