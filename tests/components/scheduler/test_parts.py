"""The core's parts built and driven without SchedulerCore, each with the real parts it
uses: the queues' fair order, the lease book's asks and answers, the preemptor's recompute
(the core's contract: core.py). Everything else drives them through the core."""
from __future__ import annotations

from components.costs.cost_model import StepCostModel
from components.kv_manager.ops import apply_ops
from components.kv_manager.pool import BlockPool
from components.scheduler.kv_requests import LeaseBook
from components.scheduler.preemption import Preemption, Preemptor
from components.scheduler.prices import Prices
from components.scheduler.queues import Queues
from components.scheduler.sequence import Seq, State
from components.scheduler.tenants import Tenants
from schemas.config import SchedulerConfig
from schemas.wire import AllocRequest, FreeRequest, KvOps, SamplingParams
from tests import messages as msgs

BS = 8
EPOCH = 3
CFG = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=32, lookahead_tokens=4)


def parts(cfg: SchedulerConfig = CFG) -> tuple[Queues, LeaseBook, Preemptor]:
    tenants = Tenants(cfg)
    queues = Queues(tenants, num_blocks=64)
    prices = Prices(StepCostModel(), BS)
    leases = LeaseBook(cfg, queues, prices, BS, grow_blocks=2, max_model_len=256, epoch=EPOCH)
    return queues, leases, Preemptor(cfg, queues, leases, prices, 256, "recompute", 0)


def seq_of(queues: Queues, rid: str, n: int, tenant: str = "t", arrival_ns: int = 1) -> Seq:
    tokens = list(range(100, 100 + n))
    seq = Seq(queues.next_id(), msgs.header(rid, tenant, SamplingParams(max_tokens=10),
                                            arrival_ns), n, tokens, [], frozenset())
    seq.group.append(seq)
    queues.admit(seq, arrival_ns)
    return seq


def test_the_queues_start_the_less_served_tenant_first():
    queues, _, _ = parts()
    a = seq_of(queues, "a1", 16, "a", arrival_ns=1)
    b = seq_of(queues, "b1", 16, "b", arrival_ns=2)    # lifted to a's counter: a tie
    assert list(queues.waiting) == [a, b]               # so arrival decides
    queues.tenants.vtc.charge("a", input_tokens=64)
    queues.fair_order(0)
    assert list(queues.waiting) == [b, a]
    assert queues.backlogged_tenants() == {"a", "b"}
    queues.start(b)
    assert queues.running == [b] and list(queues.waiting) == [a]
    assert queues.running_slots() == {"b": 1}


def test_the_lease_book_asks_a_lease_once_and_applies_its_grant():
    queues, leases, preemptor = parts()
    seq = seq_of(queues, "r1", 20)
    leases.lease_waiting()
    ops = leases.take_kv_ops()
    assert ops == KvOps(EPOCH, [], [AllocRequest(1, 3, "t", [], [], 2)])
    assert seq.state is State.LEASING and leases.take_kv_ops() is None
    pool = BlockPool(16, BS, True)
    leases.on_grants(apply_ops(pool, ops), preemptor)
    assert seq.state is State.READY and len(seq.block_ids) == 3
    assert leases.take_plan_notes() == ([], [])


def test_the_preemptor_sends_a_ready_sequence_back_under_a_fresh_id():
    queues, leases, preemptor = parts()
    seq = seq_of(queues, "r1", 20)
    leases.lease_waiting()
    leases.on_grants(apply_ops(BlockPool(16, BS, True), leases.take_kv_ops()), preemptor)
    preemptor.recompute(seq, "test", count=True)
    assert seq.state is State.WAITING and seq.seq_id == 2 and seq.block_ids == []
    assert list(queues.by_seq) == [2] and list(queues.waiting) == [seq]
    assert leases.take_kv_ops() == KvOps(EPOCH, [FreeRequest(1, 0)], [])
    assert preemptor.preemptions == 1
    assert preemptor.last_preempted == [Preemption("r1", 0, "test", "recompute", 0, 0.0, 0.0)]
    assert leases.take_plan_notes() == ([], [])      # the executor never knew it
