"""Fairness between tenants and classes, in the simulator (issue 14): the production admission
policy, SchedulerCore and BlockPool on a virtual clock, with the shipped reference CPU cost
profile, so every number below is a step time that profile predicts.

- VTC's bound on the service gap between backlogged tenants, over 10,000 requests, against
  the FCFS baseline in the same test.
- A noisy neighbour: a prefill-heavy flood does not take a light tenant's first tokens, and
  still gets the rest of the engine.
- No starvation: a batch request under sustained interactive load starts within the time its
  aging needs, plus the drain of what was admitted before it.

Strict xfails mark what fails because of the scheduler (or admission), each with what it
would need.

The measure is ``weir.replay.fairness``: weighted service (prompt × 1 when a request is first
scheduled, output × 2 per token, ÷ the tenant's weight), a tenant backlogged while it has a
request waiting (sent → first scheduled), lifted to the smallest backlogged counter when it
becomes backlogged again; the gap is the largest counter spread among tenants backlogged at
one instant."""
from __future__ import annotations

import math
import random
from pathlib import Path

import pytest

from components.costs.cost_model import StepShape
from schemas.config import load_config
from weir.replay import profile as profiles
from weir.replay.fairness import backlog_intervals, overlap_s
from weir.replay.report import percentile, summarize
from weir.replay.sim import Simulator, fast_block_hashes
from weir.replay.synth import TokenSynth
from weir.replay.types import COMPLETED, RunResult, Slo, TraceRequest
from weir.replay.workloads import TenantLoad, backlogged_tenants, noisy_neighbour

ROOT = Path(__file__).resolve().parents[3]
PROFILE = profiles.load(ROOT / "weir" / "replay" / "profiles" / "reference-cpu.json")
IN_COST, OUT_COST = 1, 2                     # VTC's cost: input × 1 + output × 2


def simulate(requests: list[TraceRequest], **sections) -> RunResult:
    # fairness alone: plain decoding (with speculation a verify emits several tokens, and
    # the bounds below are derived for one per row per step)
    sections.setdefault("speculative", {"method": "off"})
    cfg = load_config(None, topology={"run_dir": "/nonexistent"}, **sections)
    synth = TokenSynth(range(1000, 30000), 32, seed=0)
    sim = Simulator(cfg, PROFILE, tokens=synth.tokens,
                    hashes=fast_block_hashes(cfg.kv.block_size))
    return sim.run(requests)


def gap(run: RunResult) -> float:
    return summarize(run, {}, Slo(math.inf, math.inf),
                     weights=run.meta["weights"]).max_backlogged_gap


def worst_step_s(tokens: int, seqs: int, max_context: int) -> float:
    """An upper bound on one step's time under the profile: ``tokens`` computed over
    ``seqs`` sequences, none of which sees more than ``max_context`` positions (so at most
    ``tokens × max_context`` attention pairs and ``seqs × max_context`` positions read)."""
    return PROFILE.predict(StepShape(tokens, seqs * max_context, seqs, tokens * max_context))


def ttfts(run: RunResult, tenant: str) -> list[float]:
    return [r.ttft_s for r in run.records if r.tenant == tenant and r.ttft_s is not None]


# --- VTC's bound ------------------------------------------------------------------------------

VTC_TENANTS = {  # different weights and request sizes; equal arrival shares
    "A": TenantLoad(1, (200, 600), (4, 16)),       # long prompts, short answers, weight 1
    "B": TenantLoad(1, (16, 64), (16, 48)),        # short prompts, long answers, weight 2
    "C": TenantLoad(1, (64, 256), (8, 32)),        # in between, weight 0.5
}
VTC_WEIGHTS = {"A": 1.0, "B": 2.0, "C": 0.5}
VTC_REQUESTS, VTC_RATE = 10_000, 6.0               # ~1.3x what the engine completes: a queue


@pytest.fixture(scope="module")
def vtc_runs():
    """The same 10,000 requests under VTC and under FCFS (scheduler and admission both)."""
    requests = backlogged_tenants(VTC_REQUESTS, VTC_RATE, VTC_TENANTS, seed=1)
    tenants = [{"name": u, "weight": w} for u, w in VTC_WEIGHTS.items()]
    runs = {fair: simulate(requests, scheduler={"fairness": fair},
                           admission={"policy": "fcfs", "classes": [], "tenants": tenants})
            for fair in ("vtc", "fcfs")}
    return requests, runs, {fair: gap(run) for fair, run in runs.items()}


def largest_request_cost(requests: list[TraceRequest]) -> float:
    """U: the largest weighted cost of one request, (input × 1 + output × 2) ÷ its weight."""
    return max((IN_COST * r.input_tokens + OUT_COST * r.output_tokens) / VTC_WEIGHTS[r.tenant]
               for r in requests)


def test_tenants_stay_backlogged_and_most_requests_are_served(vtc_runs):
    requests, runs, _ = vtc_runs
    for fair, run in runs.items():
        done = sum(r.terminal == COMPLETED for r in run.records)
        assert done > 0.6 * len(requests), (fair, done)
        assert run.meta["preemptions"] == 0           # the counters see each prompt once
        for tenant in VTC_WEIGHTS:
            waiting = sum(b - a for a, b in backlog_intervals(run.records, tenant))
            assert waiting > 0.7 * run.duration_s, (fair, tenant, waiting, run.duration_s)


def test_vtc_keeps_the_batch_bound_that_fcfs_breaks(vtc_runs):
    """VTC's theorem (Sheng et al., "Fairness in Serving Large Language Models", OSDI '24)
    bounds the service two backlogged clients receive over any interval by 2U, with U the
    most one client's counter can move past another's before the scheduler can pick the
    other: the prompt it is charged on admission (w_p × the longest input) or what its
    running batch is charged meanwhile (w_q × M, M the tokens a batch holds). Weighted VTC
    divides charges by the weight, so the bound on the counter spread is 2 × max over
    tenants of U_f / w_f.

    In Weir's terms, for tenant f: its counter can pass another backlogged tenant's by what
    it is charged after the last step that picked it over that tenant. That step's new
    prompts (the fair order is taken once per step, so up to the step's whole token budget
    B = max_num_batched_tokens, × 1) and the output its running sequences can still sample
    (at most max_num_seqs of them, × its longest output, × 2):
        U_f = (1 × B + 2 × max_num_seqs × max_output_f) / w_f,   bound = 2 × max_f U_f.
    Both terms are taken in full (a sum, not VTC's max), so the bound does not depend on
    which one dominates. The scheduler lifts a tenant when it has nothing waiting, as VTC
    does (``test_a_tenant_with_work_running_does_not_bank_credit``); here the tenants keep
    work waiting most of the time (checked above). FCFS serves in arrival order, whatever
    the counters and weights say, and its gap grows with the run."""
    requests, runs, gaps = vtc_runs
    cfg = load_config(None, topology={"run_dir": "/nonexistent"})
    budget, seqs = cfg.scheduler.max_num_batched_tokens, cfg.scheduler.max_num_seqs
    longest_out = {u: max(r.output_tokens for r in requests if r.tenant == u)
                   for u in VTC_WEIGHTS}
    bound = 2 * max((IN_COST * budget + OUT_COST * seqs * longest_out[u]) / w
                    for u, w in VTC_WEIGHTS.items())
    assert gaps["fcfs"] > bound, (gaps, bound)
    assert gaps["vtc"] <= bound, (gaps, bound)


def test_vtc_keeps_twice_the_largest_request_cost(vtc_runs):
    """The bound the issue asks for: the gap stays within 2U, U the largest weighted cost of
    one request (input × 1 + output × 2, ÷ its tenant's weight): VTC's bound with the batch
    term taken per request. The scheduler charges a prompt whole when it starts and output
    as tokens are sampled, as the measure does. FCFS breaks it in the same test. Note that
    with continuous batching this is not a theorem: a tenant's many running requests keep
    sampling after others are picked (VTC's M term), so a different trace may exceed it."""
    requests, _, gaps = vtc_runs
    bound = 2 * largest_request_cost(requests)
    assert gaps["fcfs"] > bound, (gaps, bound)
    assert gaps["vtc"] <= bound, (gaps, bound)


def test_a_tenant_with_work_running_does_not_bank_credit():
    """B keeps one long request running while A takes the rest of the engine for two
    minutes; then B sends 1,000 short requests at once. B was not backlogged (nothing
    waiting) while A was served, so VTC lifts B to A's counter when the flood arrives and
    the two share from there: the gap stays within 2U plus one step's prompts (B tokens),
    and A, backlogged throughout, keeps
    getting new work started, at worst every three full steps (one in flight, one whose
    prompts went to B, one to start A's)."""
    rng = random.Random(7)
    rows, t = [], 0.0
    while t < 240:
        t += rng.expovariate(2.0)
        rows.append((t, "A", 1000, 8))
    rows.append((0.0, "B", 32, 200))                           # streams for ~4 minutes
    rows += [(120.0 + i * 0.01, "B", 32, 16) for i in range(1000)]
    rows.sort()
    requests = [TraceRequest(index=i, arrival_s=t, input_tokens=p, output_tokens=o, tenant=u)
                for i, (t, u, p, o) in enumerate(rows)]
    run = simulate(requests, admission={"policy": "fcfs", "classes": [],
                                        "max_outstanding": 100_000,
                                        "tenants": [{"name": u, "max_outstanding": 100_000}
                                                    for u in "AB"]})
    budget = load_config(None, topology={"run_dir": "/nonexistent"}) \
        .scheduler.max_num_batched_tokens
    u = max(IN_COST * r.input_tokens + OUT_COST * r.output_tokens for r in requests)
    starts = sorted(r.sent_s + r.queue_s for r in run.records
                    if r.tenant == "A" and r.queue_s is not None)
    stall = max(b - a for a, b in zip(starts, starts[1:]) if a > 115)
    full_step = worst_step_s(budget, 128, 1008)        # every slot a row, A's longest context
    assert gap(run) <= 2 * u + IN_COST * budget, (gap(run), 2 * u + budget)
    assert stall <= 3 * full_step, (stall, full_step)


# --- a noisy neighbour ------------------------------------------------------------------------

# What an operator would run for a shared engine with a bulk tenant: the deadline policy
# (decide on a cost estimate, queue what does not fit, reserve KV for admitted work so it
# never thrashes), the bulk tenant's class allowed to queue for minutes and its queue deep
# enough to hold the flood rather than refuse it, and the bulk tenant's KV reservations
# capped (kv_blocks, 75% of the pool) so its backlog cannot hold every block the light
# tenant's next request needs. No TPOT SLO: steps use the full token budget (stall-free
# chunking would shorten them), the worst case for the light tenant's first token.
NN_CLASSES = [{"name": "interactive", "priority": 0, "max_queue_ms": 5000},
              {"name": "bulk", "priority": 0, "max_queue_ms": 600_000}]
NN_TENANTS = [{"name": "A", "classes": ["bulk"], "max_queued": 1000, "kv_blocks": 1536},
              {"name": "B", "classes": ["interactive"]}]


def nn_config(fair: str, policy: str) -> dict:
    return {"engine": {"max_model_len": 4096}, "scheduler": {"fairness": fair},
            "admission": {"policy": policy, "max_queued": 1000, "classes": NN_CLASSES,
                          "tenants": NN_TENANTS}}


@pytest.fixture(scope="module")
def nn_runs():
    """B alone and B beside A's flood, under VTC and under FIFO (fcfs policies)."""
    return {"alone": simulate(noisy_neighbour(only="B"), **nn_config("vtc", "deadline")),
            "vtc": simulate(noisy_neighbour(), **nn_config("vtc", "deadline")),
            "fifo": simulate(noisy_neighbour(), **nn_config("fcfs", "fcfs"))}


def flood_step_s(run: RunResult, longest: int = 1900 + 16) -> float:
    """A full-budget step of the flood at its batch size, under the profile: the run's
    largest batch (``max_step_seqs`` rows), one row a fresh prompt chunk taking what the
    others leave of the token budget, the others decoding at the flood's longest context
    (prompt 1900 + output 16)."""
    budget = load_config(None, topology={"run_dir": "/nonexistent"}) \
        .scheduler.max_num_batched_tokens
    rows = run.meta["max_step_seqs"]
    chunk = budget - (rows - 1)
    return PROFILE.predict(StepShape(budget, chunk + (rows - 1) * longest, rows,
                                     chunk * (chunk + 1) // 2 + (rows - 1) * longest))


def test_a_flood_does_not_take_the_light_tenants_first_tokens(nn_runs):
    """B's first token waits for the step in flight when it arrives and the step that
    prefills it, so B's TTFT p99 stays within B alone's p99 plus two full-budget steps of
    the flood at its batch size (and no step of the run was longer than that).

    Three things in the scheduler keep it there: a request's lease is asked when it
    arrives (so it is ready for the next step); B, lifted to A's counter when it becomes
    backlogged again, is tied with A, and tied tenants share the step's new-prompt budget
    (``_step_shares``), so A's long prompt picked first does not take the whole step; and
    A's prompts already in progress go after B's new work while A is the more served."""
    alone, vtc = nn_runs["alone"], nn_runs["vtc"]
    step = flood_step_s(vtc)
    assert vtc.meta["max_step_s"] <= step, (vtc.meta["max_step_s"], step)
    assert sum(r.tenant == "A" for r in vtc.records) > 5 * 60       # A: 6/s for a minute
    light = [r for r in vtc.records if r.tenant == "B"]
    assert len(light) == 60 and all(r.terminal == COMPLETED for r in light)
    p99_alone, p99 = percentile(ttfts(alone, "B"), 99), percentile(ttfts(vtc, "B"), 99)
    assert p99 <= p99_alone + 2 * step, (p99, p99_alone, step)


def test_fifo_makes_the_light_tenant_wait_for_the_flood(nn_runs):
    p99_vtc = percentile(ttfts(nn_runs["vtc"], "B"), 99)
    p99_fifo = percentile(ttfts(nn_runs["fifo"], "B"), 99)
    assert p99_vtc * 5 <= p99_fifo, (p99_vtc, p99_fifo)


def test_the_flood_still_gets_the_rest_of_the_engine(nn_runs):
    """Whenever A has a request waiting (in admission's queue or the scheduler's), a step is
    running: the simulator's idle intervals (no step in flight) overlap A's backlog by no
    more than a millisecond in all."""
    run = nn_runs["vtc"]
    waiting = backlog_intervals(run.records, "A")
    assert sum(b - a for a, b in waiting) > 0.9 * run.duration_s    # A was backlogged
    assert overlap_s(waiting, run.meta["idle_intervals"]) <= 1e-3
    assert sum(r.tenant == "A" and r.terminal == COMPLETED for r in run.records) > 100


def test_admission_does_not_refuse_the_light_tenant_behind_the_flood():
    """B's class with a TTFT SLO (10 s, above the two-step bound this engine keeps for it):
    admission should accept B's requests, not predict them behind A's backlog. It prices
    each where VTC starts it, from the per-tenant counters and backlog in the
    scheduler's load report (``TtftModel.prefill_ahead``)."""
    cfg = nn_config("vtc", "deadline")
    cfg["admission"]["classes"] = [{**NN_CLASSES[0], "ttft_slo_ms": 10_000}, NN_CLASSES[1]]
    run = simulate(noisy_neighbour(), **cfg)
    light = [r for r in run.records if r.tenant == "B"]
    refused = [r for r in light if r.reason == "deadline_unmeetable"]
    assert not refused, (len(refused), len(light))


# --- no starvation ----------------------------------------------------------------------------

STARVE_IN, STARVE_OUT = (200, 400), (16, 32)        # the interactive load's lengths
STARVE_OUTSTANDING = 16                             # admission.max_outstanding


def starvation_run(aging_per_s: float) -> RunResult:
    """One tenant: interactive requests at 4/s (about 2x what the engine completes) for a
    minute, and one batch request at 20 s, when the queue is deep. Deadline admission runs
    at most 16 requests at once and queues the rest by class priority with aging."""
    rng = random.Random(5)
    rows, t = [], 0.0
    while True:
        t += rng.expovariate(4.0)
        if t > 60:
            break
        rows.append((t, "interactive", rng.randint(*STARVE_IN), rng.randint(*STARVE_OUT)))
    rows.append((20.0, "batch", 300, 24))
    rows.sort()
    requests = [TraceRequest(index=i, arrival_s=t, input_tokens=p, output_tokens=o,
                             service_class=c) for i, (t, c, p, o) in enumerate(rows)]
    classes = [{"name": "interactive", "priority": 0, "max_queue_ms": 30_000},
               {"name": "batch", "priority": 1, "max_queue_ms": 300_000,
                "aging_per_s": aging_per_s}]
    return simulate(requests, admission={
        "policy": "deadline", "max_outstanding": STARVE_OUTSTANDING, "max_queued": 1000,
        "classes": classes, "tenants": [{"name": "default", "max_queued": 1000,
                                         "classes": ["interactive", "batch"]}]})


def test_a_batch_request_starts_within_its_aging_bound():
    """Admission orders its queue by aged priority: priority − aging_per_s × time queued.
    The batch request (1) passes the interactive class (0, no aging) after
    T_age = (1 − 0) / aging_per_s; from then it heads the queue, and a new interactive
    request that fits queues behind it instead of starting. Nothing is admitted until it
    is, so it waits for the drain of what is already admitted (at most N = 16 requests):
    the step in flight, the prefill of their prompts (≤ N × 400 tokens, at least B − N of
    them a step), then their outputs (≤ 32 decode steps); one finishing frees its slot.
    Released, it is the oldest arrival in the scheduler's queue (one tenant: arrival
    order), so it starts at the next plan but one (its KV lease is asked at a plan, and
    the step planned meanwhile runs first). With every step bounded by the profile:
        wait ≤ T_age + (1 + ⌈N·400 / (B − N)⌉ + 1) × full step + 32 × decode step.
    The same load without aging (aging_per_s = 0) starves it past that bound: it starts
    only when the interactive load ends."""
    aging = 0.25
    budget = load_config(None, topology={"run_dir": "/nonexistent"}) \
        .scheduler.max_num_batched_tokens
    n, longest = STARVE_OUTSTANDING, STARVE_IN[1] + STARVE_OUT[1]
    full = worst_step_s(budget, n, longest)
    decode = worst_step_s(n, n, longest)
    prefill_steps = math.ceil(n * STARVE_IN[1] / (budget - n))
    bound = (1 - 0) / aging + (2 + prefill_steps) * full + STARVE_OUT[1] * decode

    def waited(run: RunResult) -> float:              # arrival → first scheduled
        (rec,) = [r for r in run.records if r.service_class == "batch"]
        assert rec.terminal == COMPLETED and rec.queue_s is not None
        return rec.queue_s

    wait, wait_unaged = waited(starvation_run(aging)), waited(starvation_run(0.0))
    assert wait <= bound, (wait, bound)
    assert wait_unaged > bound, (wait_unaged, bound)
    assert wait >= 1 / aging                  # it did wait for its aging: the load is real
