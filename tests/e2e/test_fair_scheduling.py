"""Fair, SLO-aware scheduling through the whole engine (issue 14), live:

- stall-free chunking: 16 streams keep their class's TPOT through a burst of 16 prompts of
  512 tokens, and no gap stalls; with a fixed 2048-token budget they do not (both engines
  in this test);
- VTC between tenants: a short two-tenant run stays within VTC's bound on the weighted
  service gap, where FCFS breaks it (both engines in this test);
- budgets: the flooding tenant never holds more KV blocks than its budget, nor runs more
  sequences than its cap, while the other tenant's requests all complete.

The simulator covers the same properties over 10,000 requests
(tests/weir/replay/test_fairness_sim.py); these runs show the live engine does what the
simulated one does."""
from __future__ import annotations

import math
import random
import statistics

import anyio
import msgspec

from tests.e2e.engine import Engine
from weir.replay.fairness import max_backlogged_gap, service_events
from weir.replay.live import SdkTarget, replay
from weir.replay.probes import decode_through_burst
from weir.replay.report import percentile, summarize
from weir.replay.types import COMPLETED, Slo, TraceRequest

TPOT_SLO_MS = 400.0

# linear = "torch": one kernel for every step size, so the measured ITL is scheduling,
# not which kernel the plan picked for each varying chunk size; no speculation, so that
# each gap is one step (a verify emits several tokens in one)
CHUNKING = """
[engine]
max_model_len = 1024
kernels = {{ linear = "torch" }}
[scheduler]
chunking = "{chunking}"
[admission]
classes = [{{ name = "chat", tpot_slo_ms = {tpot} }}]
[speculative]
method = "off"
"""


def test_stall_free_chunking_keeps_the_streams_tpot_through_a_burst(tmp_path_factory,
                                                                   model_path):
    """The slack budget keeps each step's predicted time within 1.5x the tightest TPOT SLO
    among the decoding streams, and each stream's mean over its next tokens within 80% of
    it, so while the burst is prefilled every stream's TPOT (the mean of its inter-token
    gaps, the SLO's measure) stays within the SLO, 90% of the gaps within 1.5x it, and no
    gap past 2x it (a step's prediction off by a third); a fixed 2048-token step takes
    seconds on this CPU.
    (Until 2026-12-06 each step was held within 80% of the SLO itself: 90% of the gaps
    within it, but a burst's prompts waited on steps shorter than the streams needed.)

    A stream's TPOT is the mean of all its gaps, from its first token: the SLO's measure and
    the scheduler's, which lends time a stream banked before the burst to the burst's
    prompts. Until 2026-12-06 this test took the mean of the gaps after the burst's arrival
    only, which that lending puts over the SLO by design (417-424 ms on a 2-core Zen 4,
    where the whole-stream TPOT read 319 ms against the 320 ms the budget plans); and the
    banked streams' gaps rode the 1.5x cap, and the first steps of the burst, planned before
    the cost model had seen 8 live steps (no slowdown yet), ran 4-13% over it (gap p90
    612-626 ms). The slowdown now counts from the first step the startup prior predicts
    (p90 525-564 ms), and the cost model scales the prior as a whole (p90 463 ms).

    The worst gap is one step's time against its prediction, so it moves with the machine's
    noise: 395-489 ms here against a 500 ms SLO. It was this test's bar, and a neighbour's
    burst on a CI machine could break it without the scheduler being wrong; 1.5x the SLO is
    a prediction off by nearly 2x. A fixed budget's gaps run to ~10x the SLO.

    Sized for time: the fixed engine computes the whole burst before its streams end, in
    2048-token steps of ~6 s here, so the burst's size is most of the test's time. 16
    prompts (8192 tokens) give each stream 4 such gaps among its ~20 after the burst
    arrives: its TPOT over 1 s, and over 10% of the gaps stalled.

    On the 2-core AMX Xeon those steps take 1.5 s, and the fixed engine's worst stream TPOT
    read 470-492 ms alone (618 and 563 after other tests): against the 500 ms SLO this test
    had, whether the fixed budget broke it was a coin flip. Hence 400 ms, which the slack
    engine keeps with room (255-345 ms at 500). There, too, the slack budget once fell back
    to the full 2048 tokens when the cost model's fit priced the decodes at nothing
    (worst stream TPOT 594-618 ms, gap p90 1.5 s): see ``step_budget``'s "tpot_slo_mean"."""
    tpot, p90, worst = {}, {}, {}
    for chunking in ("slack", "fixed"):
        eng = Engine(tmp_path_factory.mktemp(f"chunk-{chunking}"),
                     CHUNKING.format(chunking=chunking, tpot=TPOT_SLO_MS))
        per_stream: list[list[float]] = []
        try:
            gaps, _ = anyio.run(lambda eng=eng, per_stream=per_stream: decode_through_burst(
                eng.endpoint, eng.service_key, stream_tokens=32, burst=16, cancel_burst=True,
                stream_gaps=per_stream))
        finally:
            eng.stop()
        assert len(gaps) > 200, (chunking, len(gaps))   # the streams decoded through it
        tpot[chunking] = max(statistics.mean(g) for g in per_stream if g) * 1e3
        p90[chunking] = percentile(gaps, 90) * 1e3
        worst[chunking] = max(gaps) * 1e3
    report = {"worst stream TPOT": tpot, "gap p90": p90, "worst gap": worst}
    print("stall-free chunking, ms:", report)
    assert tpot["slack"] <= TPOT_SLO_MS < tpot["fixed"], report
    assert p90["slack"] <= 1.5 * TPOT_SLO_MS < p90["fixed"], report
    assert worst["slack"] <= 2.0 * TPOT_SLO_MS < worst["fixed"], report


FAIRNESS = """
[engine]
max_model_len = 1024
[kv]
num_blocks = 512
[scheduler]
fairness = "{fairness}"
max_num_seqs = {slots}
[admission]
# the scheduler's fairness alone: admission lets every request in (the default deadline
# policy would refuse A's flood past its running cap, which its class does not queue)
policy = "fcfs"
max_outstanding = 256
tenants = [
  {{ name = "A", weight = 1.0, kv_blocks = {kv}, max_running = {cap} }},
  {{ name = "B", weight = 2.0 }},
]
"""
A_KV, A_CAP = 64, 3
SLOTS = 4           # running sequences, both engines: new work waits for a slot
WEIGHTS = {"A": 1.0, "B": 2.0}


def two_tenants(seed: int = 3) -> list[TraceRequest]:
    """A sends 10 prompts of 200-300 tokens in the first 50 ms; B sends 8 short ones, one
    every 0.3 s from 0.1 s: both stay backlogged for most of the run.

    With ``SLOTS`` sequences running at most, A's flood is a queue whatever the machine's
    speed: when B's first request arrives, 6 of A's still wait for a slot. FCFS serves them
    all (~1500 weighted tokens of prompt) before any of B's, so its gap exceeds VTC's bound
    by more than 2x on a fast machine and a slow one alike. (A flood spread over a second,
    as this test had, was a queue only where the steps were slow: a faster CI machine
    scheduled A's prompts as they came and FCFS's gap fell under the bound.)"""
    rng = random.Random(seed)
    rows = [(rng.uniform(0.0, 0.05), "A", rng.randint(200, 300), 8) for _ in range(10)]
    rows += [(0.1 + 0.3 * i, "B", rng.randint(32, 64), 12) for i in range(8)]
    rows.sort()
    return [TraceRequest(index=i, arrival_s=t, input_tokens=p, output_tokens=o, tenant=u,
                         max_tokens=o) for i, (t, u, p, o) in enumerate(rows)]


def run_live(eng: Engine, requests: list[TraceRequest], samples: list | None = None):
    rng = random.Random(0)
    ids = {r.index: [rng.randrange(1000, 40000) for _ in range(r.input_tokens)]
           for r in requests}

    async def main():
        async with anyio.create_task_group() as tg:
            if samples is not None:
                async def sample():
                    while True:
                        status = await anyio.to_thread.run_sync(eng.status)
                        samples.append((status["kv_manager"].stats.get("tenant_kv_blocks.A", 0),
                                        status["scheduler"].tenants.get("A")))
                        await anyio.sleep(0.1)
                tg.start_soon(sample)
            async with SdkTarget(eng.endpoint, eng.service_key) as target:
                run = await replay(requests, target, lambda r: (ids[r.index], ""),
                                   progress=False, max_lag_ms=500)
            tg.cancel_scope.cancel()
        return run

    run = anyio.run(main)
    run.meta["weights"] = WEIGHTS
    return run


def test_vtc_keeps_the_service_gap_bound_live_where_fcfs_breaks_it(tmp_path_factory,
                                                                    model_path):
    requests = two_tenants()
    # VTC's bound: 2U, U the largest weighted cost of one request (input + 2 x output)
    u = max((r.input_tokens + 2 * r.output_tokens) / WEIGHTS[r.tenant] for r in requests)
    gaps, samples = {}, []
    for fairness in ("vtc", "fcfs"):
        eng = Engine(tmp_path_factory.mktemp(f"fair-{fairness}"),
                     FAIRNESS.format(fairness=fairness, kv=A_KV if fairness == "vtc" else 0,
                                     cap=A_CAP if fairness == "vtc" else 0, slots=SLOTS))
        try:
            run = run_live(eng, requests, samples if fairness == "vtc" else None)
        finally:
            eng.stop()
        assert all(r.terminal == COMPLETED for r in run.records), \
            [(r.request_id, r.terminal, r.reason) for r in run.records if r.terminal != COMPLETED]
        gaps[fairness] = summarize(run, {}, Slo(math.inf, math.inf),
                                   weights=WEIGHTS).max_backlogged_gap
        ingress = [r.ingress_s for r in run.records if r.ingress_s is not None]
        assert len(ingress) == len(run.records) and all(0 <= x <= r.queue_s for x, r in
                                                        zip(ingress, run.records))
        counted = [msgspec.structs.replace(r, ingress_s=None) for r in run.records]
        print(f"{fairness}: gap {gaps[fairness]:.0f}, {gaps[fairness] / u:.2f} U (U {u:.0f}); "
              f"with the engine's ingress counted as backlog "
              f"{max_backlogged_gap(service_events(counted, WEIGHTS)):.0f}; ingress "
              f"median {1e3 * sorted(ingress)[len(ingress) // 2]:.1f} ms, max "
              f"{1e3 * max(ingress):.1f} ms")
        if fairness == "vtc":
            # budgets held all along: A's KV at the kv_manager, A's running sequences
            assert samples and max(kv for kv, _ in samples) <= A_KV, samples
            running = [t.running for _, t in samples if t is not None]
            assert running and max(running) <= A_CAP, running
            assert max(running) == A_CAP                 # the cap, not a lack of work
    assert gaps["vtc"] <= 2 * u < gaps["fcfs"], (gaps, 2 * u)
