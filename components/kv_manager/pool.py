"""The block pool: fixed-size KV blocks, refcounts, leases and a verified prefix cache.

Pure and synchronous; the kv_manager service wraps it. The pool hands out block
ids only; the executor holds the memory.

Free blocks live in two places: ``_plain`` (no reusable content) and ``_cached``
(an LRU of unreferenced blocks whose KV is still valid under a prefix hash).
Allocation prefers plain blocks and evicts the least recently freed cached block
only when it must. A prefix hit is verified against the stored scope and token
ids, so a hash collision is never read as a hit.
"""
from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Sequence

import msgspec


class Grant(msgspec.Struct, frozen=True):
    ok: bool
    block_ids: list[int]
    num_cached_tokens: int = 0


class CacheEvent(msgspec.Struct, frozen=True, array_like=True):
    """A prefix block entered or left the cache. ``tier`` is where its KV lives
    ("gpu" is the executor's main pool, whatever the device)."""

    kind: str                 # "stored" | "removed"
    block_hash: int
    scope: str
    tier: str
    parent_hash: int | None


class PoolStats(msgspec.Struct, frozen=True):
    total: int
    free: int
    cached: int
    leased_seqs: int


@dataclass
class _Lease:
    epoch: int
    blocks: list[int]
    scope: str
    hashes: list[int]
    token_ids: list[int]


@dataclass(frozen=True)
class _CachedKey:
    """What a cached block must match exactly for a hit: scope, parent hash, own tokens."""

    scope: str
    parent: int | None
    tokens: tuple[int, ...]


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int, prefix_cache: bool = True) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.prefix_cache = prefix_cache
        self._ref = [0] * num_blocks
        self._plain: deque[int] = deque(range(num_blocks))
        self._cached: OrderedDict[int, None] = OrderedDict()
        self._hash_to_block: dict[int, int] = {}
        self._block_hash: dict[int, int] = {}
        self._block_key: dict[int, _CachedKey] = {}
        self._leases: dict[int, _Lease] = {}
        self.hit_tokens = 0
        self.query_tokens = 0
        self.events: list[CacheEvent] = []

    # -- queries
    @property
    def num_free(self) -> int:
        return len(self._plain) + len(self._cached)

    def stats(self) -> PoolStats:
        return PoolStats(self.num_blocks, self.num_free, len(self._block_hash), len(self._leases))

    def blocks_of(self, seq_id: int) -> list[int]:
        lease = self._leases.get(seq_id)
        return list(lease.blocks) if lease else []

    def refcount(self, block: int) -> int:
        return self._ref[block]

    # -- operations
    def allocate(self, seq_id: int, num_blocks: int, *, epoch: int = 0, scope: str = "",
                 block_hashes: Sequence[int] = (), token_ids: Sequence[int] = (),
                 max_cached_blocks: int = 0) -> Grant:
        """Lease ``num_blocks`` more blocks to ``seq_id``. The first allocation of a
        sequence may satisfy up to ``max_cached_blocks`` leading blocks from the cache."""
        lease = self._leases.get(seq_id)
        hits: list[int] = []
        if lease is None:
            lease = _Lease(epoch, [], scope, list(block_hashes), list(token_ids))
            if self.prefix_cache:
                hits = self._match(lease, min(max_cached_blocks, len(block_hashes), num_blocks))
                self.query_tokens += len(token_ids)
        need = num_blocks - len(hits)
        if need > self.num_free - sum(1 for b in hits if self._ref[b] == 0):
            return Grant(False, [])
        for b in hits:
            self._incref(b)
        fresh = [self._take_free() for _ in range(need)]
        lease.blocks.extend(hits)
        lease.blocks.extend(fresh)
        self._leases[seq_id] = lease
        cached_tokens = len(hits) * self.block_size
        self.hit_tokens += cached_tokens
        return Grant(True, hits + fresh, cached_tokens)

    def cached_tokens(self, scope: str, block_hashes: Sequence[int], token_ids: Sequence[int],
                      max_blocks: int) -> int:
        """Tokens of this prompt a new lease would get from the cache now (verified, read-only)."""
        if not self.prefix_cache:
            return 0
        probe = _Lease(0, [], scope, list(block_hashes), list(token_ids))
        return len(self._match(probe, min(max_blocks, len(block_hashes)))) * self.block_size

    def free(self, seq_id: int, num_computed_tokens: int = 0) -> int:
        """Release a sequence's lease. Full prompt blocks below ``num_computed_tokens``
        become cached (reusable by the same scope). Returns the number of blocks released."""
        lease = self._leases.pop(seq_id, None)
        if lease is None:
            return 0
        full = min(num_computed_tokens // self.block_size, len(lease.hashes), len(lease.blocks))
        if self.prefix_cache:
            for i in range(full):
                self._register(lease.blocks[i], lease.hashes[i], lease.scope,
                               lease.hashes[i - 1] if i else None,
                               lease.token_ids[i * self.block_size:(i + 1) * self.block_size])
        for b in lease.blocks:
            self._decref(b)
        return len(lease.blocks)

    def reclaim(self, older_than_epoch: int) -> list[int]:
        """Free every lease granted under an epoch older than ``older_than_epoch``."""
        stale = [s for s, lease in self._leases.items() if lease.epoch < older_than_epoch]
        for seq_id in stale:
            self.free(seq_id, 0)
        return stale

    # -- internals
    def _match(self, lease: _Lease, limit: int) -> list[int]:
        hits = []
        for i in range(limit):
            b = self._hash_to_block.get(lease.hashes[i])
            parent = lease.hashes[i - 1] if i else None
            want = _CachedKey(lease.scope, parent,
                              tuple(lease.token_ids[i * self.block_size:(i + 1) * self.block_size]))
            if b is None or self._block_key.get(b) != want:
                break
            hits.append(b)
        return hits

    def _register(self, block: int, h: int, scope: str, parent: int | None,
                  tokens: Sequence[int]) -> None:
        if h in self._hash_to_block or block in self._block_hash:
            return
        self._hash_to_block[h] = block
        self._block_hash[block] = h
        self._block_key[block] = _CachedKey(scope, parent, tuple(tokens))
        self.events.append(CacheEvent("stored", h, scope, "gpu", parent))

    def drop_cache(self) -> int:
        """Forget every cached prefix (their KV is gone, e.g. the executor restarted).
        Unreferenced cached blocks become plain free blocks. Returns how many were dropped."""
        dropped = len(self._block_hash)
        for block in list(self._block_hash):
            self._evict(block)
        while self._cached:
            block, _ = self._cached.popitem(last=False)
            self._plain.append(block)
        return dropped

    def _take_free(self) -> int:
        if self._plain:
            b = self._plain.popleft()
        else:
            b, _ = self._cached.popitem(last=False)
            self._evict(b)
        self._ref[b] = 1
        return b

    def _evict(self, block: int) -> None:
        h = self._block_hash.pop(block, None)
        if h is not None:
            del self._hash_to_block[h]
            key = self._block_key.pop(block)
            self.events.append(CacheEvent("removed", h, key.scope, "gpu", key.parent))

    def take_events(self) -> list["CacheEvent"]:
        """Cache changes since the last call, in order (for the KV event stream)."""
        events, self.events = self.events, []
        return events

    def _incref(self, block: int) -> None:
        if self._ref[block] == 0:
            del self._cached[block]
        self._ref[block] += 1

    def _decref(self, block: int) -> None:
        self._ref[block] -= 1
        if self._ref[block] == 0:
            if block in self._block_hash:
                self._cached[block] = None
            else:
                self._plain.append(block)
