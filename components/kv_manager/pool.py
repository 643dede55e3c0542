"""The block pool: KV blocks in two tiers, refcounts, leases, copy-on-write forks, swap,
and a verified prefix cache scoped per tenant.

Pure and synchronous; the kv_manager service wraps it. One class past 400 lines on
purpose: the tiers, the prefix cache, forks and leases share one invariant per tier (every
block free, cached or leased, exactly once), checked in one place. The pool hands out block ids and
says which block copies must happen; the executor holds the memory and does the copies.

Ids ``0 .. num_blocks-1`` are blocks of the main pool ("gpu" tier, whatever the device);
ids ``num_blocks .. num_blocks+num_cpu_blocks-1`` are blocks of the executor's host-memory
tier ("cpu"). Each tier keeps its free blocks in two places: ``_plain`` (no reusable
content) and ``_cached`` (an O(1) LRU of unreferenced blocks whose KV is still valid under a
prefix hash). Allocation prefers plain blocks and evicts the least recently freed cached
block only when it must. An evicted gpu prefix block is *demoted* to the cpu tier when that
tier has room (a copy), and a later hit *promotes* it back (a copy) when the caller says a
transfer beats recompute.

Every hit is verified against the stored scope, parent hash and token ids, so a hash
collision is never read as a hit. A block's scope is the lease's tenant scope, except the
first ``public_blocks`` blocks of a lease, which live in ``public_scope`` (a named public
system prompt the server chose to share).

Copies are returned in order and must be done in that order, before the next forward step
writes any block: a later copy may overwrite the source of an earlier one.

A lease's scope is its tenant. A tenant may have a budget of main-tier blocks: what it holds
is the number of *distinct* main-tier blocks its leases reference (a block two of its
sequences share counts once; an unreferenced cached block counts for nobody; a public-scope
block counts for every tenant that references it, so a tenant's count never depends on what
other tenants do). ``allocate``, ``fork`` and ``swap_in`` are refused when what the tenant
holds plus the blocks the op would newly take exceeds its budget. ``write_block`` is not: its
copy makes a block private for a sequence already running, and refusing it would strand
that sequence. Each such copy of a block the tenant still holds elsewhere takes it one block
over (the count stays exact); while over, its every ``allocate``, ``fork`` and ``swap_in``
is refused until frees bring it back.
"""
from __future__ import annotations

from collections import Counter, OrderedDict, deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import msgspec

from schemas.wire import BlockCopy

GPU, CPU = "gpu", "cpu"
POOL_FULL, TENANT_KV_BUDGET = "pool_full", "tenant_kv_budget"


class Grant(msgspec.Struct, frozen=True):
    """An op's result. Refused (``ok`` false), it changed nothing, and ``reason`` says why:
    "tenant_kv_budget" (the lease's tenant would go over its budget; checked first),
    "pool_full" (the main tier, or for a swap-out the cpu tier, lacks the blocks), or ""
    (the op does not fit the lease's state: unknown or swapped lease, existing child)."""

    ok: bool
    block_ids: list[int]
    num_cached_tokens: int = 0
    copies: list[BlockCopy] = []
    reason: str = ""


class CacheEvent(msgspec.Struct, frozen=True, array_like=True):
    """A prefix block entered or left a tier of the cache."""

    kind: str                 # "stored" | "removed"
    block_hash: int
    scope: str
    tier: str                 # "gpu" (the executor's main pool) | "cpu" (its host tier)
    parent_hash: int | None


class PoolStats(msgspec.Struct, frozen=True):
    total: int
    free: int
    cached: int
    leased_seqs: int
    cpu_total: int = 0
    cpu_free: int = 0
    cpu_cached: int = 0
    swapped_seqs: int = 0
    tenant_blocks: dict[str, int] = {}     # distinct main-tier blocks each tenant holds


@dataclass
class _Lease:
    epoch: int
    blocks: list[int]
    scope: str
    hashes: list[int]
    token_ids: list[int]
    public_scope: str = ""
    public_blocks: int = 0
    swapped: bool = False

    def scope_of(self, index: int) -> str:
        return self.public_scope if index < self.public_blocks else self.scope


@dataclass(frozen=True)
class _CachedKey:
    """What a cached block must match exactly for a hit: scope, parent hash, own tokens."""

    scope: str
    parent: int | None
    tokens: tuple[int, ...]


@dataclass
class _Tier:
    plain: deque[int]
    cached: OrderedDict[int, None] = field(default_factory=OrderedDict)

    @property
    def free(self) -> int:
        return len(self.plain) + len(self.cached)


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int, prefix_cache: bool = True,
                 num_cpu_blocks: int = 0, watermark_blocks: int = 0,
                 emit_events: bool = True, tenant_blocks: dict[str, int] | None = None) -> None:
        self.num_blocks = num_blocks
        self.num_cpu_blocks = num_cpu_blocks
        self.block_size = block_size
        self.prefix_cache = prefix_cache
        self.watermark_blocks = watermark_blocks
        self._ref = [0] * (num_blocks + num_cpu_blocks)
        self._tiers = {GPU: _Tier(deque(range(num_blocks))),
                       CPU: _Tier(deque(range(num_blocks, num_blocks + num_cpu_blocks)))}
        self._hash_to_block: dict[int, int] = {}
        self._block_hash: dict[int, int] = {}
        self._block_key: dict[int, _CachedKey] = {}
        self._leases: dict[int, _Lease] = {}
        self._copies: list[BlockCopy] = []
        self.hit_tokens = 0
        self.query_tokens = 0
        self.promoted_blocks = 0
        self.demoted_blocks = 0
        self.emit_events = emit_events          # off where nothing reads the event stream
        self.events: list[CacheEvent] = []
        self.budgets = dict(tenant_blocks or {})    # tenant -> main-tier blocks; absent: any
        self._held: dict[str, Counter[int]] = {}    # tenant -> its leases' refs per gpu block
        self.refusals: Counter[str] = Counter()     # refused ops by reason

    # -- compatibility views of the main tier (tests and stats read these)
    @property
    def _plain(self) -> deque[int]:
        return self._tiers[GPU].plain

    @property
    def _cached(self) -> OrderedDict[int, None]:
        return self._tiers[GPU].cached

    # -- queries
    def tier(self, block: int) -> str:
        return GPU if block < self.num_blocks else CPU

    @property
    def num_free(self) -> int:
        return self._tiers[GPU].free

    @property
    def num_evictable(self) -> int:
        """Of ``num_free``, the main-tier blocks that hold a cached prefix no sequence
        references (taken, the oldest first, only when no plain block is left)."""
        return len(self._tiers[GPU].cached)

    @property
    def num_cpu_free(self) -> int:
        return self._tiers[CPU].free

    def stats(self) -> PoolStats:
        cached = sum(1 for b in self._block_hash if b < self.num_blocks)
        return PoolStats(self.num_blocks, self.num_free, cached, len(self._leases),
                         self.num_cpu_blocks, self.num_cpu_free, len(self._block_hash) - cached,
                         sum(1 for lease in self._leases.values() if lease.swapped),
                         {t: len(held) for t, held in self._held.items()})

    def tenant_blocks(self, tenant: str) -> int:
        """Distinct main-tier blocks the tenant's leases reference now."""
        held = self._held.get(tenant)
        return len(held) if held else 0

    @property
    def below_watermark(self) -> bool:
        return self.num_free < self.watermark_blocks

    def blocks_of(self, seq_id: int) -> list[int]:
        lease = self._leases.get(seq_id)
        return list(lease.blocks) if lease else []

    def refcount(self, block: int) -> int:
        return self._ref[block]

    # -- operations
    def allocate(self, seq_id: int, num_blocks: int, *, epoch: int = 0, scope: str = "",
                 block_hashes: Sequence[int] = (), token_ids: Sequence[int] = (),
                 max_cached_blocks: int = 0, public_scope: str = "", public_blocks: int = 0,
                 promote: bool = True, cached_multiple: int = 1) -> Grant:
        """Lease ``num_blocks`` more main-tier blocks to ``seq_id``. The first allocation of
        a sequence may satisfy up to ``max_cached_blocks`` leading blocks from the cache
        (cpu-tier hits only if ``promote``: each costs a copy back), in a multiple of
        ``cached_multiple`` blocks (a deterministic prompt's chunk). A first allocation
        must also leave ``watermark_blocks`` free; growth may dip below. Refused if the
        blocks the lease's tenant would newly hold (fresh blocks, and hits it does not hold
        yet) take it over its budget."""
        lease = self._leases.get(seq_id)
        if lease is not None and lease.swapped:
            return Grant(False, [])
        hits: list[int] = []
        first = lease is None
        tenant = scope if lease is None else lease.scope
        room = self._room(tenant)
        reserve = self.watermark_blocks if first else 0
        best = min(max_cached_blocks, len(block_hashes), num_blocks) if first else 0
        # Refuse early only where the answer is sure without the hits. The budget is checked
        # first: a refusal says tenant_kv_budget whenever the budget refuses, pool full or not.
        if num_blocks - best > room:                    # even if every hit were held
            return self._refuse(TENANT_KV_BUDGET)
        if num_blocks <= room and num_blocks - best > self.num_free - reserve:
            return self._refuse(POOL_FULL)              # even if every hit were pinned
        if lease is None:
            lease = _Lease(epoch, [], scope, list(block_hashes), list(token_ids), public_scope,
                           public_blocks)
            if self.prefix_cache:
                hits = self._match(lease, best, promote)
                del hits[len(hits) - len(hits) % max(cached_multiple, 1):]
        resident = [b for b in hits if b < self.num_blocks]
        need = num_blocks - len(resident)
        held: Mapping[int, int] = self._held.get(tenant, {})
        if need + sum(1 for b in resident if b not in held) > room:
            return self._refuse(TENANT_KV_BUDGET)
        if need > self.num_free - sum(1 for b in resident if self._ref[b] == 0) - reserve:
            return self._refuse(POOL_FULL)
        if first and self.prefix_cache:
            self.query_tokens += len(token_ids)
        self._copies = []
        for b in hits:                          # pin every hit before anything is evicted
            self._incref(b)
        blocks = [self._promote(b, lease, i) if b >= self.num_blocks else b
                  for i, b in enumerate(hits)]
        blocks += [self._take_free(GPU) for _ in range(num_blocks - len(hits))]
        lease.blocks.extend(blocks)
        for b in blocks:
            self._hold(tenant, b)
        self._leases[seq_id] = lease
        cached_tokens = len(hits) * self.block_size
        self.hit_tokens += cached_tokens
        return Grant(True, blocks, cached_tokens, self._take_copies())

    def fork(self, parent: int, child: int, num_tokens: int, *, epoch: int = 0) -> Grant:
        """Give ``child`` the blocks holding ``parent``'s first ``num_tokens`` tokens,
        shared (refcounted). A shared block is copied on the first write into it: the
        child's copy of a partial last block is made now, since its next token goes there.
        Returns the child's whole block table."""
        src = self._leases.get(parent)
        n = -(-num_tokens // self.block_size)
        if src is None or src.swapped or child in self._leases or n > len(src.blocks):
            return Grant(False, [])
        partial = num_tokens % self.block_size != 0
        if partial > self._room(src.scope):     # only the copy is new: its tenant holds the rest
            return self._refuse(TENANT_KV_BUDGET)
        if partial and self.num_free < 1:
            return self._refuse(POOL_FULL)
        lease = _Lease(epoch, list(src.blocks[:n]), src.scope, list(src.hashes),
                       list(src.token_ids), src.public_scope, src.public_blocks)
        for b in lease.blocks:
            self._incref(b)
            self._hold(lease.scope, b)
        self._leases[child] = lease
        self._copies = []
        if partial:
            self._cow(lease, n - 1)
        return Grant(True, list(lease.blocks), 0, self._take_copies())

    def write_block(self, seq_id: int, index: int) -> list[BlockCopy] | None:
        """Make block ``index`` of ``seq_id`` private before it is written (copy-on-write).
        Returns the copies to do (none if it was not shared), or None if no block is free.
        Never refused for the tenant's budget (see the module docstring)."""
        lease = self._leases[seq_id]
        if self._shared(lease.blocks[index]) and self.num_free < 1:
            return None
        self._copies = []
        self._cow(lease, index)
        return self._take_copies()

    def swap_out(self, seq_id: int, num_tokens: int) -> Grant:
        """Move the blocks holding a sequence's first ``num_tokens`` tokens to the cpu tier
        (copies) and free all its main-tier blocks. Refused, changing nothing, if the cpu
        tier cannot take them. Returns the cpu block ids."""
        lease = self._leases.get(seq_id)
        n = -(-num_tokens // self.block_size)
        if lease is None or lease.swapped or n > len(lease.blocks):
            return Grant(False, [])
        if n > self.num_cpu_free:
            return self._refuse(POOL_FULL)
        return self._move(lease, lease.blocks[:n], CPU)

    def swap_in(self, seq_id: int) -> Grant:
        """Bring a swapped sequence's blocks back to the main tier (copies); refused if the
        main tier cannot hold them or its tenant's budget cannot. Returns the new block
        table."""
        lease = self._leases.get(seq_id)
        if lease is None or not lease.swapped:
            return Grant(False, [])
        if len(lease.blocks) > self._room(lease.scope):
            return self._refuse(TENANT_KV_BUDGET)
        if len(lease.blocks) > self.num_free:
            return self._refuse(POOL_FULL)
        return self._move(lease, lease.blocks, GPU)

    def _move(self, lease: _Lease, blocks: list[int], tier: str) -> Grant:
        """Copy ``blocks`` into fresh blocks of ``tier``, which become the whole lease; every
        block the lease held is released (a swap, either way)."""
        self._copies = []
        moved = []
        for b in blocks:
            d = self._take_free(tier)
            self._copies.append(BlockCopy(b, d))
            moved.append(d)
            self._hold(lease.scope, d)
        for b in lease.blocks:
            self._release(lease.scope, b)
            self._decref(b)
        lease.blocks, lease.swapped = moved, tier == CPU
        return Grant(True, list(moved), 0, self._take_copies())

    def cached_tokens(self, scope: str, block_hashes: Sequence[int], token_ids: Sequence[int],
                      max_blocks: int, public_scope: str = "", public_blocks: int = 0) -> int:
        """Tokens of this prompt a new lease would get from the cache now (verified, read-only;
        cpu-tier blocks count, as they would be promoted)."""
        if not self.prefix_cache:
            return 0
        probe = _Lease(0, [], scope, list(block_hashes), list(token_ids), public_scope,
                       public_blocks)
        return len(self._match(probe, min(max_blocks, len(block_hashes)), True)) * self.block_size

    def free(self, seq_id: int, num_computed_tokens: int = 0) -> int:
        """Release a sequence's lease. Full prompt blocks below ``num_computed_tokens``
        become cached (reusable by the same scope). Returns the number of blocks released."""
        lease = self._leases.pop(seq_id, None)
        if lease is None:
            return 0
        full = min(num_computed_tokens // self.block_size, len(lease.hashes), len(lease.blocks))
        if self.prefix_cache:
            for i in range(full):
                self._register(lease.blocks[i], lease.hashes[i], lease.scope_of(i),
                               lease.hashes[i - 1] if i else None,
                               lease.token_ids[i * self.block_size:(i + 1) * self.block_size])
        for b in lease.blocks:
            self._release(lease.scope, b)
            self._decref(b)
        return len(lease.blocks)

    def reclaim(self, older_than_epoch: int) -> list[int]:
        """Free every lease granted under an epoch older than ``older_than_epoch``."""
        stale = [s for s, lease in self._leases.items() if lease.epoch < older_than_epoch]
        for seq_id in stale:
            self.free(seq_id, 0)
        return stale

    def drop_cache(self) -> int:
        """Forget every cached prefix in both tiers (their KV is gone, e.g. the executor
        restarted). Unreferenced cached blocks become plain. Returns how many were dropped."""
        dropped = len(self._block_hash)
        for block in list(self._block_hash):
            self._unregister(block)
        for t in self._tiers.values():
            while t.cached:
                t.plain.append(t.cached.popitem(last=False)[0])
        return dropped

    def snapshot(self) -> list[CacheEvent]:
        """Every block in the prefix cache now, as ``stored`` events (a subscriber's fresh
        view, see KvEvents.snapshot); pending events are not taken."""
        return [CacheEvent("stored", h, key.scope, self.tier(b), key.parent)
                for b, h in self._block_hash.items() for key in (self._block_key[b],)]

    def take_events(self) -> list[CacheEvent]:
        """Cache changes since the last call, in order (for the KV event stream)."""
        events, self.events = self.events, []
        return events

    # -- internals
    def _refuse(self, reason: str) -> Grant:
        self.refusals[reason] += 1
        return Grant(False, [], reason=reason)

    def _take_copies(self) -> list[BlockCopy]:
        copies, self._copies = self._copies, []
        return copies

    def _match(self, lease: _Lease, limit: int, promote: bool) -> list[int]:
        hits = []
        for i in range(limit):
            b = self._hash_to_block.get(lease.hashes[i])
            parent = lease.hashes[i - 1] if i else None
            want = _CachedKey(lease.scope_of(i), parent,
                              tuple(lease.token_ids[i * self.block_size:(i + 1) * self.block_size]))
            if (b is None or self._block_key.get(b) != want
                    or (b >= self.num_blocks and not promote)):
                break
            hits.append(b)
        return hits

    def _shared(self, block: int) -> bool:
        return self._ref[block] > 1 or block in self._block_hash

    def _cow(self, lease: _Lease, index: int) -> None:
        b = lease.blocks[index]
        if self._shared(b):
            new = self._take_free(GPU)
            self._copies.append(BlockCopy(b, new))
            self._hold(lease.scope, new)
            self._release(lease.scope, b)
            self._decref(b)
            lease.blocks[index] = new

    def _promote(self, cpu_block: int, lease: _Lease, index: int) -> int:
        """Copy a (pinned) cpu-tier prefix hit into a fresh main-tier block, which takes over
        its cache entry; the cpu block is released."""
        g = self._take_free(GPU)
        self._copies.append(BlockCopy(cpu_block, g))
        h, key = self._block_hash[cpu_block], self._block_key[cpu_block]
        self._unregister(cpu_block)
        self._register(g, h, key.scope, key.parent, key.tokens)
        self._decref(cpu_block)
        self.promoted_blocks += 1
        return g

    def _register(self, block: int, h: int, scope: str, parent: int | None,
                  tokens: Sequence[int]) -> None:
        if h in self._hash_to_block or block in self._block_hash:
            return
        self._hash_to_block[h] = block
        self._block_hash[block] = h
        self._block_key[block] = _CachedKey(scope, parent, tuple(tokens))
        if self.emit_events:
            self.events.append(CacheEvent("stored", h, scope, self.tier(block), parent))

    def _unregister(self, block: int) -> None:
        h = self._block_hash.pop(block, None)
        if h is not None:
            del self._hash_to_block[h]
            key = self._block_key.pop(block)
            if self.emit_events:
                self.events.append(CacheEvent("removed", h, key.scope, self.tier(block),
                                              key.parent))

    def _take_free(self, tier: str) -> int:
        """A free block of ``tier`` with refcount 1: plain if any, else the least recently
        freed cached block, evicted (a main-tier one is demoted to the cpu tier if it can)."""
        t = self._tiers[tier]
        if t.plain:
            b = t.plain.popleft()
        else:
            b, _ = t.cached.popitem(last=False)
            if tier == GPU and self.num_cpu_blocks and self._tiers[CPU].free:
                self._demote(b)
            else:
                self._unregister(b)
        self._ref[b] = 1
        return b

    def _demote(self, block: int) -> None:
        """Move a main-tier cache entry to a cpu block (the entry itself moves: same hash,
        same verified key)."""
        c = self._take_free(CPU)
        self._copies.append(BlockCopy(block, c))
        h, key = self._block_hash.pop(block), self._block_key.pop(block)
        self._hash_to_block[h] = c
        self._block_hash[c] = h
        self._block_key[c] = key
        if self.emit_events:
            self.events.append(CacheEvent("removed", h, key.scope, GPU, key.parent))
            self.events.append(CacheEvent("stored", h, key.scope, CPU, key.parent))
        self._decref(c)
        self.demoted_blocks += 1

    def _room(self, tenant: str) -> float:
        """Main-tier blocks the tenant may still newly hold (inf without a budget)."""
        budget = self.budgets.get(tenant)
        return float("inf") if budget is None else budget - self.tenant_blocks(tenant)

    def _hold(self, tenant: str, block: int) -> None:
        """One more reference by the tenant's leases to ``block`` (main tier only)."""
        if block < self.num_blocks:
            self._held.setdefault(tenant, Counter())[block] += 1

    def _release(self, tenant: str, block: int) -> None:
        if block < self.num_blocks:
            held = self._held[tenant]
            held[block] -= 1
            if not held[block]:
                del held[block]
                if not held:
                    del self._held[tenant]

    def _incref(self, block: int) -> None:
        if self._ref[block] == 0:
            del self._tiers[self.tier(block)].cached[block]
        self._ref[block] += 1

    def _decref(self, block: int) -> None:
        self._ref[block] -= 1
        if self._ref[block] == 0:
            t = self._tiers[self.tier(block)]
            if block in self._block_hash:
                t.cached[block] = None
            else:
                t.plain.append(block)
