"""The kv_manager process: owns the block pool and leases blocks to the scheduler
under the scheduler's epoch. A newer epoch reclaims every older lease."""
from __future__ import annotations

import asyncio
import time

import structlog
import zmq

from bus.component import Component
from components.kv_manager.ops import apply_ops
from components.kv_manager.pool import TENANT_KV_BUDGET, BlockPool
from schemas.config import AdmissionConfig
from schemas.wire import (
    CacheAnswer,
    CacheQuery,
    KvEvents,
    KvGrant,
    KvGrants,
    KvHello,
    KvManagerUp,
    KvMsg,
    KvOps,
)

log = structlog.get_logger("kv_manager")
_MAX_EPOCH_AHEAD_NS = 60 * 10**9


def tenant_budgets(admission: AdmissionConfig) -> dict[str, int]:
    """Each configured tenant's KV block budget; a tenant with none (0), or not configured,
    is unlimited."""
    return {t.name: t.kv_blocks for t in admission.tenants if t.kv_blocks > 0}


class KvManagerService(Component):
    name = "kv_manager"

    async def setup(self) -> None:
        kv = self.config.kv
        self.pool = BlockPool(kv.num_blocks, kv.block_size, kv.enable_prefix_cache,
                              kv.num_cpu_blocks, kv.watermark_blocks,
                              tenant_blocks=tenant_budgets(self.config.admission))
        self.epoch = 0
        self.stale_ops = 0
        self.alloc_failures = 0
        self.instance = time.time_ns()
        self.inbox_sock = self.inbox(KvMsg)
        self.to_scheduler = self.push_to("scheduler")
        self.to_admission = self.push_to("admission")
        # XPUB: a subscription (a router starting, reconnecting, or resyncing after a gap)
        # reaches this process, which answers it with a snapshot of the cache
        self.events_pub = self.socket(zmq.XPUB, "events")
        self.events_pub.set_option(zmq.XPUB_VERBOSE, 1)
        self.events_pub.bind(self.topology.kv_events(bind=True))
        self.events_seq = 0
        self.snapshots = 0
        await self.to_scheduler.send(KvManagerUp(self.instance, kv.num_blocks))

    def _advance_epoch(self, epoch: int) -> None:
        # An epoch is a scheduler's start time (ns): one far in the future is not a real
        # scheduler, and accepting it would make every real lease stale for good.
        if epoch > time.time_ns() + _MAX_EPOCH_AHEAD_NS:
            log.warning("epoch_refused", epoch=epoch)
            return
        if epoch > self.epoch:
            reclaimed = self.pool.reclaim(epoch)
            if reclaimed:
                log.warning("leases_reclaimed", count=len(reclaimed), old_epoch=self.epoch)
            self.epoch = epoch

    def handle(self, ops: KvOps) -> list[KvGrant]:
        self._advance_epoch(ops.epoch)
        if ops.epoch != self.epoch:          # older, or refused as from the future
            self.stale_ops += 1
            return []
        grants = apply_ops(self.pool, ops)
        self.alloc_failures += sum(not g.ok for g in grants)
        return grants

    async def run(self) -> None:
        """One task owns both sockets: it waits for whichever of the inbox and the event
        socket's subscriptions has something."""
        inbox = asyncio.ensure_future(self.inbox_sock.recv())
        subscription = asyncio.ensure_future(self.events_pub.recv_raw())
        try:
            while True:
                done, _ = await asyncio.wait((inbox, subscription),
                                             return_when=asyncio.FIRST_COMPLETED)
                if subscription in done:
                    if subscription.result()[:1] == b"\x01":     # subscribe, not unsubscribe
                        await self._publish_snapshot()
                    subscription = asyncio.ensure_future(self.events_pub.recv_raw())
                if inbox in done:
                    await self._handle(inbox.result().body)
                    inbox = asyncio.ensure_future(self.inbox_sock.recv())
        finally:
            inbox.cancel()
            subscription.cancel()

    async def _handle(self, body) -> None:
        match body:
            case KvOps() as ops:
                grants = self.handle(ops)
                if grants or (ops.frees and ops.epoch == self.epoch):
                    # frees alone are answered too: the scheduler's load report carries the
                    # pool's counts to admission, and a pool that drained without a later
                    # allocation would read full there
                    await self.to_scheduler.send(KvGrants(grants, self.pool.num_free,
                                                          self.pool.num_cpu_free,
                                                          self.pool.num_evictable))
                await self._publish()
            case CacheQuery() as q:
                cached = self.pool.cached_tokens(q.scope, q.block_hashes, q.token_ids,
                                                 q.max_blocks, q.public_scope, q.public_blocks)
                await self.to_admission.send(CacheAnswer(q.request_id, cached))
            case KvHello(epoch=epoch):
                self._advance_epoch(epoch)
                await self.to_scheduler.send(KvManagerUp(self.instance, self.pool.num_blocks))

    async def _publish_snapshot(self) -> None:
        await self._publish()                     # what changed so far goes out first
        self.events_seq += 1
        self.snapshots += 1
        await self.events_pub.send(KvEvents(self.events_seq, self.instance, [
            (e.kind, e.block_hash, e.scope, e.tier, e.parent_hash)
            for e in self.pool.snapshot()], snapshot=True))

    async def _publish(self) -> None:
        events = self.pool.take_events()
        if events:
            self.events_seq += 1
            await self.events_pub.send(KvEvents(self.events_seq, self.instance, [
                (e.kind, e.block_hash, e.scope, e.tier, e.parent_hash) for e in events]))

    async def peer_restarted(self, name: str) -> None:
        if name == "executor":                       # the KV tensors behind the cache are gone
            log.warning("prefix_cache_dropped", blocks=self.pool.drop_cache())
            await self._publish()

    def stats(self) -> dict[str, float]:
        s = self.pool.stats()
        return {"total_blocks": s.total, "free_blocks": s.free, "cached_blocks": s.cached,
                "cpu_total_blocks": s.cpu_total, "cpu_free_blocks": s.cpu_free,
                "cpu_cached_blocks": s.cpu_cached, "swapped_seqs": s.swapped_seqs,
                "watermark_blocks": self.pool.watermark_blocks,
                "below_watermark": int(self.pool.below_watermark),
                "promoted_blocks": self.pool.promoted_blocks,
                "demoted_blocks": self.pool.demoted_blocks,
                "leased_seqs": s.leased_seqs, "alloc_failures": self.alloc_failures,
                "tenant_kv_budget_refusals": self.pool.refusals[TENANT_KV_BUDGET],
                "prefix_query_tokens": self.pool.query_tokens,
                "prefix_hit_tokens": self.pool.hit_tokens, "stale_ops": self.stale_ops,
                "kv_event_snapshots": self.snapshots,
                **{f"tenant_kv_blocks.{t}": n for t, n in s.tenant_blocks.items()}}
