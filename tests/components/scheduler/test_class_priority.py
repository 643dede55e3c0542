"""Priority across tenants (``Queues.fair_order``, queues.py): new work starts by class first,
its priority aged as admission's queue ages it, then by VTC within the class; batch work
that waits long enough ranks with, then ahead of, new interactive work."""
from __future__ import annotations

from collections import deque

import msgspec

from components.scheduler.core import SchedulerCore
from schemas.config import KvConfig, SchedulerConfig, TenantConfig
from schemas.wire import Admitted, SamplingParams, StepResult
from tests import messages as msgs
from tests.components.scheduler.test_states import Kv

S = 1_000_000_000                  # ns in a second
BATCH_AGING = 1 / 60               # SLO_CLASSES' batch: a unit a minute


def admitted(rid: str, tenant: str, *, batch: bool = False, at_s: float = 0.0,
             prompt: int = 8, aging: float = BATCH_AGING, deadline_ms: int | None = None,
             ) -> Admitted:
    """An interactive (priority 0) or batch (priority 1, aging) request of one token."""
    toks = list(range(1000, 1000 + prompt))
    return msgs.admitted(rid, tenant, toks, [], SamplingParams(max_tokens=1, ignore_eos=True),
                    int(at_s * S), (), deadline_ms=deadline_ms, priority=int(batch),
                    service_class="batch" if batch else "interactive",
                    aging_per_s=aging if batch else 0.0)


def core_of(fairness: str = "vtc", tenants=(), max_num_seqs: int = 1,
            budget: int = 64) -> SchedulerCore:
    return SchedulerCore(SchedulerConfig(max_num_seqs=max_num_seqs,
                                         max_num_batched_tokens=budget, lookahead_tokens=1,
                                         fairness=fairness),
                         KvConfig(block_size=8, num_blocks=64, grow_blocks=1), 512, epoch=1,
                         tenants=tenants)


def run(core: SchedulerCore, kv: Kv, now_s: float) -> list[tuple[str, int]]:
    """Plan a step, settle KV, run it (every sampling row gets token 7): the tokens it
    computed, by request, in plan order."""
    now_ns = int(now_s * S)
    plan = core.schedule(now_ns)
    kv.settle(core)
    if plan is None:
        return []
    ran = [(core.by_seq[s.seq_id].request_id, s.num_tokens) for s in plan.steps]
    ids = [s.seq_id for s in plan.steps if s.sample]
    core.on_result(StepResult(plan.step_id, ids, [7] * len(ids), 1), now_ns)
    kv.settle(core)
    return ran


def order(core: SchedulerCore, now_s: float) -> list[str]:
    core.queues.fair_order(int(now_s * S))
    return [s.request_id for s in core.waiting]


def test_interactive_of_a_served_tenant_goes_before_batch_of_a_less_served_one():
    core = core_of()
    core.add(admitted("light-b0", "light", batch=True))
    core.add(admitted("light-b1", "light", batch=True))
    core.add(admitted("heavy-i0", "heavy", at_s=1))
    core.vtc.charge("heavy", input_tokens=100_000)
    assert order(core, 2) == ["heavy-i0", "light-b0", "light-b1"]
    # and it is the one that starts
    kv = Kv(64)
    kv.settle(core)
    assert run(core, kv, 2) == [("heavy-i0", 8)]


def test_within_a_class_vtc_orders_the_tenants():
    core = core_of()
    for rid, tenant, batch in [("heavy-b0", "heavy", True), ("heavy-i0", "heavy", False),
                               ("heavy-i1", "heavy", False), ("light-b0", "light", True),
                               ("light-i0", "light", False), ("light-i1", "light", False)]:
        core.add(admitted(rid, tenant, batch=batch))
    core.vtc.charge("heavy", input_tokens=100)
    # interactive first, light before heavy (each pick charges light its 8-token prompt:
    # 8 then 16, still under heavy's 100), then batch, light before heavy
    assert order(core, 0) == ["light-i0", "light-i1", "heavy-i0", "heavy-i1", "light-b0",
                              "heavy-b0"]
    # picks charge as they go: light's third interactive prompt would pass heavy's counter
    core.vtc.charge("light", input_tokens=95)          # 95, +8 = 103 > 100
    assert order(core, 0) == ["light-i0", "heavy-i0", "light-i1", "heavy-i1", "light-b0",
                              "heavy-b0"]


def test_aged_batch_ranks_with_then_ahead_of_interactive():
    core = core_of()
    core.add(admitted("bulk-b", "bulk", batch=True, at_s=0))
    core.add(admitted("chat-i", "chat", at_s=10))
    core.vtc.charge("bulk", input_tokens=1000)        # bulk is the more served
    assert order(core, 59.999) == ["chat-i", "bulk-b"]       # batch, 1
    assert order(core, 60) == ["chat-i", "bulk-b"]           # 0, tied: VTC has chat first
    assert order(core, 119.999) == ["chat-i", "bulk-b"]
    assert order(core, 120) == ["bulk-b", "chat-i"]          # -1: ahead of any interactive
    assert [core.by_request[r].aged_priority(120 * S) for r in ("bulk-b", "chat-i")] == [-1, 0]
    # an unknown clock (0) ages nothing
    assert core.by_request["bulk-b"].aged_priority(0) == 1


def test_back_from_preemption_the_more_important_class_first():
    core = core_of()
    core.add(admitted("a-b", "a", batch=True))
    core.add(admitted("b-i", "b"))
    core.add(admitted("c-i", "c"))
    for rid in ("a-b", "b-i"):
        core.by_request[rid].preemptions = 1
    # as preemption leaves them (b-i first, then a-b, each to the queue's head)
    core.queues.waiting = deque(core.by_request[r] for r in ("a-b", "b-i", "c-i"))
    # preempted work goes before fresh work (it holds work), by class among itself
    assert order(core, 1) == ["b-i", "a-b", "c-i"]
    core.by_request["a-b"].rescued = True             # rescued by urgency: first of all
    assert order(core, 1) == ["a-b", "b-i", "c-i"]


def test_tenants_tied_in_service_share_a_step_only_within_a_class():
    """Tied counters share the step's new-prompt budget, but a batch prompt takes no share
    beside an interactive one: the interactive prompt takes the step."""
    core = core_of(max_num_seqs=2, budget=16)
    kv = Kv(64)
    core.add(admitted("a-i", "a", prompt=24))
    core.add(admitted("b-b", "b", batch=True))
    kv.settle(core)
    assert core.vtc.of("a") == core.vtc.of("b") == 0.0
    assert run(core, kv, 1) == [("a-i", 16)]
    # the same two of one class: a share each (8 and 8)
    core = core_of(max_num_seqs=2, budget=16)
    kv = Kv(64)
    core.add(admitted("a-i", "a", prompt=24))
    core.add(admitted("b-i", "b"))
    kv.settle(core)
    assert run(core, kv, 1) == [("a-i", 8), ("b-i", 8)]


def run_stream(core: SchedulerCore, batch: Admitted, tenant: str, seconds: int,
               deadline_ms: int | None = None) -> int | None:
    """One slot; an interactive request of ``tenant`` arrives every second and takes the
    step (one token), so one always waits beside ``batch``. The second ``batch`` started
    at, or None."""
    kv = Kv(64)
    core.add(batch)
    for t in range(seconds):
        core.add(admitted(f"i{t}", tenant, at_s=t, deadline_ms=deadline_ms))
        kv.settle(core)                                # leases granted before the plan
        ran = run(core, kv, t)
        if (batch.request_id, 8) in ran:
            return t
        assert ran == [(f"i{t}", 8)]
        assert f"i{t}" not in core.by_request          # it ran, and finished
    return None


def test_batch_of_another_tenant_is_not_starved_by_a_stream_of_interactive():
    """Its class ranks with interactive at 60 s waited; chat, served at every step, is then
    the more served (a tenant's arrival lifts it to the backlogged bulk's counter, never
    lowers it), so VTC starts the batch request at once. Without aging it never starts."""
    core = core_of()
    assert run_stream(core, admitted("bulk-b", "bulk", batch=True), "chat", 200) == 60
    core = core_of()
    assert run_stream(core, admitted("bulk-b", "bulk", batch=True, aging=0.0), "chat",
                      200) is None
    assert core.by_request["bulk-b"].first_scheduled_ns == 0


def test_batch_is_not_starved_by_its_own_tenants_interactive_stream():
    """Within a tenant, a tie of classes goes to the earlier deadline (the interactive
    request's); at 120 s waited the batch request ranks ahead and starts."""
    core = core_of()
    assert run_stream(core, admitted("b", "t", batch=True), "t", 200, deadline_ms=3000) == 120


def test_an_interactive_prompt_in_progress_goes_before_a_less_served_tenants_batch():
    """Prefill chunks of running prompts that rank after the queue's head go after its new
    work; an interactive prompt does not rank after batch work, however served its tenant."""
    core = core_of(max_num_seqs=2, budget=16)
    kv = Kv(64)
    core.add(admitted("heavy-i", "heavy", prompt=40))
    kv.settle(core)
    assert run(core, kv, 1) == [("heavy-i", 16)]
    core.vtc.charge("heavy", input_tokens=1000)
    core.add(admitted("light-b", "light", batch=True, at_s=1))
    kv.settle(core)
    assert core.vtc.of("light") < core.vtc.of("heavy")
    assert run(core, kv, 2) == [("heavy-i", 16)]
    # batch work of the same class as the head would have gone first (the flood rule)
    core2 = core_of(max_num_seqs=2, budget=16)
    kv2 = Kv(64)
    core2.add(admitted("heavy-b", "heavy", batch=True, prompt=40))
    kv2.settle(core2)
    assert run(core2, kv2, 1) == [("heavy-b", 16)]
    core2.vtc.charge("heavy", input_tokens=1000)
    core2.add(admitted("light-b", "light", batch=True, at_s=1))
    kv2.settle(core2)
    assert run(core2, kv2, 2) == [("light-b", 8), ("heavy-b", 8)]


def test_fcfs_keeps_arrival_order_across_tenants_and_classes():
    core = core_of("fcfs")
    core.add(admitted("light-b", "light", batch=True, at_s=0))
    core.add(admitted("heavy-i", "heavy", at_s=1))
    core.vtc.charge("heavy", input_tokens=100_000)
    assert [s.request_id for s in core.waiting] == ["light-b", "heavy-i"]
    kv = Kv(64)
    kv.settle(core)
    assert run(core, kv, 2) == [("light-b", 8)]
    # ordered (tenants with token rates): within rate first, then arrival; classes stay
    # within a tenant
    rated = core_of("fcfs", tenants=(TenantConfig("light", token_rate=1e6),
                                     TenantConfig("heavy", token_rate=1e6)))
    rated.add(admitted("light-b", "light", batch=True, at_s=0))
    rated.add(admitted("heavy-b", "heavy", batch=True, at_s=1))
    rated.add(admitted("heavy-i", "heavy", at_s=2))
    assert order(rated, 3) == ["light-b", "heavy-i", "heavy-b"]


def test_an_older_sender_decodes_with_no_aging():
    enc = msgspec.msgpack.encode(admitted("r", "t", batch=True))
    fields = msgspec.msgpack.decode(enc)
    del fields["aging_per_s"]
    old = msgspec.msgpack.decode(msgspec.msgpack.encode(fields), type=Admitted)
    assert (old.header.priority, old.aging_per_s) == (1, 0.0)
