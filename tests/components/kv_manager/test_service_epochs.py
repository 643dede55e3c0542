"""The kv_manager's epochs: a newer scheduler reclaims older leases, and an epoch from far
in the future (a forged KvHello or KvOps) is refused instead of making every real lease
stale for good."""
import time

from components.kv_manager.pool import BlockPool
from components.kv_manager.service import KvManagerService
from schemas.wire import AllocRequest, KvOps


def _service() -> KvManagerService:
    svc = KvManagerService.__new__(KvManagerService)      # the decision logic, no sockets
    svc.pool, svc.epoch, svc.stale_ops, svc.alloc_failures = BlockPool(8, 16), 0, 0, 0
    return svc


def _alloc(epoch: int, seq: int) -> KvOps:
    return KvOps(epoch, [], [AllocRequest(seq, 1)])


def test_a_real_epoch_is_taken_and_an_older_one_is_stale():
    svc, now = _service(), time.time_ns()
    assert [g.ok for g in svc.handle(_alloc(now, 1))] == [True]
    assert svc.handle(_alloc(now - 1, 2)) == [] and svc.stale_ops == 1


def test_an_epoch_from_the_future_is_refused_and_real_work_goes_on():
    svc, now = _service(), time.time_ns()
    svc.handle(_alloc(now, 1))
    svc._advance_epoch(2**63 - 1)                         # a forged KvHello
    assert svc.epoch == now
    assert svc.handle(_alloc(2**63 - 1, 9)) == []         # forged ops change nothing
    assert [g.ok for g in svc.handle(_alloc(now, 2))] == [True]
