"""BlockPool: exact block ids, verified prefix cache, LRU eviction, leases, and a
stateful property test of its bookkeeping."""
from __future__ import annotations

from collections import Counter

from hypothesis import settings, strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, invariant, rule

from components.kv_manager.pool import BlockPool, Grant

BS = 4


def hashes_of(tokens, salt=""):
    """Chained block hashes that ignore the scope: equal prompts in two scopes get equal
    hashes, so only the pool's scope check can keep them apart."""
    return [hash((salt, tuple(tokens[:(i + 1) * BS]))) for i in range(len(tokens) // BS)]


def alloc_prompt(pool, seq_id, tokens, num_blocks, *, scope="t1", max_cached=None, epoch=0,
                 hashes=None):
    hs = hashes_of(tokens) if hashes is None else hashes
    if max_cached is None:
        max_cached = (len(tokens) - 1) // BS
    return pool.allocate(seq_id, num_blocks, epoch=epoch, scope=scope, block_hashes=hs,
                         token_ids=list(tokens[:len(hs) * BS]), max_cached_blocks=max_cached)


def snapshot(pool):
    return (list(pool._ref), list(pool._plain), list(pool._cached), dict(pool._hash_to_block),
            dict(pool._block_hash), dict(pool._block_key),
            {s: list(lease.blocks) for s, lease in pool._leases.items()})


PROMPT = list(range(100, 110))          # 10 tokens: 2 full blocks + 2
OTHER = list(range(200, 210))


# ---------------------------------------------------------------- plain allocation

def test_fresh_allocations_hand_out_ids_in_order():
    pool = BlockPool(8, BS)
    assert pool.allocate(1, 3) == Grant(True, [0, 1, 2], 0)
    assert pool.allocate(2, 2) == Grant(True, [3, 4], 0)
    assert pool.allocate(1, 2) == Grant(True, [5, 6], 0)        # growth appends
    assert pool.blocks_of(1) == [0, 1, 2, 5, 6]
    assert pool.blocks_of(2) == [3, 4]
    assert pool.num_free == 1
    assert [pool.refcount(b) for b in range(8)] == [1, 1, 1, 1, 1, 1, 1, 0]
    assert pool.stats().leased_seqs == 2

    assert pool.free(1) == 5
    assert pool.blocks_of(1) == []
    assert pool.num_free == 6
    assert list(pool._plain) == [7, 0, 1, 2, 5, 6]             # freed go to the back
    assert pool.allocate(3, 2) == Grant(True, [7, 0], 0)
    assert pool.free(2) == 2 and pool.free(3) == 2
    assert pool.free(3) == 0                                    # unknown lease: no-op
    assert pool.num_free == pool.num_blocks == 8
    assert all(pool.refcount(b) == 0 for b in range(8))
    assert pool.stats().leased_seqs == 0


def test_exact_fit_then_failure():
    pool = BlockPool(4, BS)
    assert pool.allocate(1, 4).block_ids == [0, 1, 2, 3]
    assert pool.num_free == 0
    assert pool.allocate(2, 1) == Grant(False, [], 0, reason="pool_full")
    assert pool.allocate(1, 1) == Grant(False, [], 0, reason="pool_full")   # growth too
    assert pool.blocks_of(1) == [0, 1, 2, 3]
    assert pool.blocks_of(2) == []


# ---------------------------------------------------------------- prefix cache

def test_prefix_hit_returns_exact_blocks():
    pool = BlockPool(8, BS)
    g = alloc_prompt(pool, 1, PROMPT, 3)
    assert g == Grant(True, [0, 1, 2], 0)
    pool.free(1, num_computed_tokens=10)                        # covers 2 full blocks
    assert pool.stats().cached == 2
    assert list(pool._cached) == [0, 1]
    assert list(pool._plain) == [3, 4, 5, 6, 7, 2]              # the partial block is plain

    g = alloc_prompt(pool, 2, PROMPT, 3)
    assert g == Grant(True, [0, 1, 3], 2 * BS)
    assert [pool.refcount(b) for b in (0, 1, 3)] == [1, 1, 1]
    assert list(pool._cached) == []                             # hits left the free LRU
    assert pool.num_free == 5
    assert pool.hit_tokens == 8
    assert pool.query_tokens == 16                              # 8 hashed tokens, twice


def test_num_computed_limits_what_is_cached():
    pool = BlockPool(8, BS)
    alloc_prompt(pool, 1, PROMPT, 3)
    pool.free(1, num_computed_tokens=7)                         # only block 0 is complete
    assert list(pool._cached) == [0]
    assert alloc_prompt(pool, 2, PROMPT, 3) == Grant(True, [0, 3, 4], BS)


def test_free_without_computed_tokens_caches_nothing():
    pool = BlockPool(8, BS)
    alloc_prompt(pool, 1, PROMPT, 3)
    pool.free(1)
    assert pool.stats().cached == 0
    assert alloc_prompt(pool, 2, PROMPT, 3) == Grant(True, [3, 4, 5], 0)


def test_max_cached_blocks_caps_hits():
    pool = BlockPool(8, BS)
    alloc_prompt(pool, 1, PROMPT, 3)
    pool.free(1, 10)
    assert alloc_prompt(pool, 2, PROMPT, 3, max_cached=1) == Grant(True, [0, 3, 4], BS)
    assert list(pool._cached) == [1]
    assert alloc_prompt(pool, 3, PROMPT, 3, max_cached=0) == Grant(True, [5, 6, 7], 0)
    # hits are also capped by the number of blocks requested
    assert alloc_prompt(pool, 4, PROMPT, 1) == Grant(True, [0], BS)
    assert pool.refcount(0) == 2


def test_prefix_cache_disabled():
    pool = BlockPool(8, BS, prefix_cache=False)
    alloc_prompt(pool, 1, PROMPT, 3)
    pool.free(1, 10)
    assert pool.stats().cached == 0
    assert alloc_prompt(pool, 2, PROMPT, 3) == Grant(True, [3, 4, 5], 0)
    assert pool.query_tokens == 0 and pool.hit_tokens == 0


def test_other_scope_never_hits_even_with_equal_hashes():
    pool = BlockPool(8, BS)
    hs = hashes_of(PROMPT)                                      # forged: scope-independent
    alloc_prompt(pool, 1, PROMPT, 3, scope="t1", hashes=hs)
    pool.free(1, 10)
    g = alloc_prompt(pool, 2, PROMPT, 3, scope="t2", hashes=hs)
    assert g == Grant(True, [3, 4, 5], 0)                       # plain blocks, no hits
    assert list(pool._cached) == [0, 1]                         # t1's cache untouched
    assert pool.refcount(0) == 0 and pool.refcount(1) == 0
    # t2 computing the same prompt does not overwrite t1's registration
    pool.free(2, 10)
    assert list(pool._cached) == [0, 1]
    assert alloc_prompt(pool, 3, PROMPT, 3, scope="t1", hashes=hs) == Grant(True, [0, 1, 6], 8)


def test_hash_collision_with_different_tokens_is_a_miss():
    pool = BlockPool(8, BS)
    hs = hashes_of(PROMPT)
    alloc_prompt(pool, 1, PROMPT, 3, hashes=hs)
    pool.free(1, 10)
    # same hashes, other tokens in block 0: no hit at all
    assert alloc_prompt(pool, 2, OTHER, 3, hashes=hs) == Grant(True, [3, 4, 5], 0)
    # block 0 genuinely matches, block 1 collides with different tokens: exactly one hit
    mixed = PROMPT[:4] + OTHER[4:]
    assert alloc_prompt(pool, 3, mixed, 3, hashes=hs) == Grant(True, [0, 6, 7], BS)
    assert pool.refcount(1) == 0 and list(pool._cached) == [1]


def test_hits_stop_at_first_miss():
    pool = BlockPool(8, BS)
    alloc_prompt(pool, 1, PROMPT, 3)
    pool.free(1, 10)
    # a prompt that differs in block 0 but shares block 1's tokens: chained hash differs
    other = OTHER[:4] + PROMPT[4:]
    assert alloc_prompt(pool, 2, other, 3) == Grant(True, [3, 4, 5], 0)


# ---------------------------------------------------------------- eviction and sharing

def test_plain_blocks_are_used_before_cached_ones():
    pool = BlockPool(4, BS)
    alloc_prompt(pool, 1, PROMPT[:8], 2, max_cached=1)
    pool.free(1, 8)
    assert list(pool._plain) == [2, 3] and list(pool._cached) == [0, 1]
    assert pool.allocate(2, 2) == Grant(True, [2, 3], 0)
    assert list(pool._cached) == [0, 1]
    assert pool.stats().cached == 2


def test_cached_blocks_evicted_least_recently_freed_first():
    pool = BlockPool(4, BS)
    a, b, c = [1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12]
    alloc_prompt(pool, 1, a + [0], 1, max_cached=1)             # block 0
    alloc_prompt(pool, 2, b + [0], 1, max_cached=1)             # block 1
    alloc_prompt(pool, 3, c + [0], 1, max_cached=1)             # block 2
    pool.free(2, 4)
    pool.free(3, 4)
    pool.free(1, 4)
    assert list(pool._cached) == [1, 2, 0]                      # LRU order of frees
    assert pool.allocate(4, 1) == Grant(True, [3], 0)           # plain first
    assert pool.allocate(5, 1) == Grant(True, [1], 0)           # evicts b's block
    assert pool.stats().cached == 2
    # b's prefix is gone; a's is still there
    assert alloc_prompt(pool, 6, b + [0], 1, max_cached=1) == Grant(True, [2], 0)
    assert alloc_prompt(pool, 7, a + [0], 1, max_cached=1) == Grant(True, [0], BS)


def test_hit_removes_block_from_lru_and_refreshes_on_free():
    pool = BlockPool(3, BS)
    a, b = [1, 2, 3, 4], [5, 6, 7, 8]
    alloc_prompt(pool, 1, a + [0], 1, max_cached=1)             # block 0
    alloc_prompt(pool, 2, b + [0], 1, max_cached=1)             # block 1
    pool.free(1, 4)
    pool.free(2, 4)
    assert list(pool._cached) == [0, 1]
    assert alloc_prompt(pool, 3, a + [0], 1, max_cached=1) == Grant(True, [0], BS)
    assert list(pool._cached) == [1]                            # 0 is referenced again
    assert pool.allocate(4, 2) == Grant(True, [2, 1], 0)        # plain 2, then evict 1
    pool.free(3, 4)
    assert list(pool._cached) == [0]


def test_shared_block_refcount():
    pool = BlockPool(8, BS)
    alloc_prompt(pool, 1, PROMPT, 3)
    pool.free(1, 10)
    assert alloc_prompt(pool, 2, PROMPT, 3).block_ids == [0, 1, 3]
    assert alloc_prompt(pool, 3, PROMPT, 3).block_ids == [0, 1, 4]
    assert pool.refcount(0) == 2 and pool.refcount(1) == 2
    pool.free(2, 10)
    assert pool.refcount(0) == 1 and pool.refcount(1) == 1
    assert 0 not in pool._cached and 0 not in pool._plain
    assert list(pool._plain) == [5, 6, 7, 2, 3]
    pool.free(3, 10)
    assert pool.refcount(0) == 0
    assert list(pool._cached) == [0, 1]
    assert pool.num_free == 8


# ---------------------------------------------------------------- failure and reclaim

def test_failed_allocation_changes_nothing():
    pool = BlockPool(4, BS)
    alloc_prompt(pool, 1, PROMPT[:8] + [0], 2, max_cached=2)
    pool.free(1, 8)                                             # blocks 0,1 cached
    assert pool.allocate(2, 2) == Grant(True, [2, 3], 0)        # holds the plain ones
    before = snapshot(pool)
    # would hit 0 and 1 but still need one more block: refused, hits not taken
    assert alloc_prompt(pool, 3, PROMPT[:8] + [0], 3, max_cached=2) == Grant(
        False, [], 0, reason="pool_full")
    assert snapshot(pool) == before
    assert pool.blocks_of(3) == []
    # growth failure keeps the existing lease as it was
    assert pool.allocate(2, 3) == Grant(False, [], 0, reason="pool_full")
    assert snapshot(pool) == before
    # once memory is back the same request succeeds, with the hits
    pool.free(2)
    assert alloc_prompt(pool, 3, PROMPT[:8] + [0], 3, max_cached=2) == Grant(True, [0, 1, 2], 8)


def test_hit_on_referenced_block_needs_no_free_block_for_it():
    pool = BlockPool(3, BS)
    alloc_prompt(pool, 1, PROMPT, 3)
    pool.free(1, 10)
    assert alloc_prompt(pool, 2, PROMPT, 3).block_ids == [0, 1, 2]
    assert pool.num_free == 0
    # blocks 0,1 are shared (refcount>0): only one free block would be needed
    assert alloc_prompt(pool, 3, PROMPT, 3) == Grant(False, [], 0, reason="pool_full")
    assert alloc_prompt(pool, 3, PROMPT, 2) == Grant(True, [0, 1], 8)
    assert pool.refcount(0) == 2


def test_reclaim_frees_only_older_epochs():
    pool = BlockPool(8, BS)
    pool.allocate(1, 2, epoch=1)
    pool.allocate(2, 1, epoch=2)
    pool.allocate(3, 1, epoch=3)
    pool.allocate(1, 1, epoch=9)                                # growth keeps lease epoch 1
    assert pool.reclaim(3) == [1, 2]
    assert pool.blocks_of(1) == [] and pool.blocks_of(2) == []
    assert pool.blocks_of(3) == [3]
    assert pool.num_free == 7
    assert pool.reclaim(3) == []
    assert pool.reclaim(4) == [3]
    assert pool.num_free == 8


def test_reclaim_does_not_cache_unverified_content():
    pool = BlockPool(8, BS)
    alloc_prompt(pool, 1, PROMPT, 3, epoch=1)
    pool.reclaim(2)
    assert pool.stats().cached == 0
    assert alloc_prompt(pool, 2, PROMPT, 3, epoch=2).num_cached_tokens == 0


# ---------------------------------------------------------------- property test

SCOPES = ("a", "b", "c")
NUM_BLOCKS = 12


class PoolMachine(RuleBasedStateMachine):
    """Random allocate/grow/free/reclaim against an independent model of leases and of
    what each physical block holds. Hashes ignore the scope and collide often (mod 7),
    so only the pool's verification keeps hits correct."""

    seqs = Bundle("seqs")

    def __init__(self) -> None:
        super().__init__()
        self.pool = BlockPool(NUM_BLOCKS, BS)
        self.leases: dict[int, dict] = {}            # seq -> scope, tokens, blocks, fresh
        self.content: dict[int, tuple[str, tuple[int, ...]]] = {}   # block -> what it holds
        self.next_id = 1
        self.epoch = 1

    @rule(target=seqs, scope=st.sampled_from(SCOPES),
          tokens=st.lists(st.integers(0, 2), min_size=0, max_size=20),
          extra=st.integers(0, 3), cap=st.integers(0, 5), collide=st.booleans())
    def allocate(self, scope, tokens, extra, cap, collide):
        seq = self.next_id
        self.next_id += 1
        hs = [h % 7 if collide else h for h in hashes_of(tokens)]
        num_blocks = max(1, -(-(len(tokens) + 1) // BS)) + extra
        before = snapshot(self.pool)
        g = self.pool.allocate(seq, num_blocks, epoch=self.epoch, scope=scope, block_hashes=hs,
                               token_ids=tokens[:len(hs) * BS], max_cached_blocks=cap)
        if not g.ok:
            assert g.block_ids == [] and g.num_cached_tokens == 0
            assert snapshot(self.pool) == before
            assert self.pool.num_free < num_blocks
            return None
        assert len(g.block_ids) == num_blocks
        assert g.num_cached_tokens % BS == 0
        nhits = g.num_cached_tokens // BS
        assert nhits <= min(cap, len(hs), num_blocks)
        for i, b in enumerate(g.block_ids[:nhits]):
            # a hit holds exactly this scope's tokens for this block
            assert self.content.get(b) == (scope, tuple(tokens[i * BS:(i + 1) * BS])), (b, i)
        for b in g.block_ids[nhits:]:
            assert before[0][b] == 0                              # fresh blocks were free
            self.content.pop(b, None)                             # will be overwritten
        self.leases[seq] = dict(scope=scope, tokens=tokens, hashes=hs, blocks=list(g.block_ids),
                                fresh=set(range(nhits, num_blocks)), epoch=self.epoch)
        return seq

    @rule(seq=seqs, n=st.integers(1, 3))
    def grow(self, seq, n):
        if seq not in self.leases:
            return
        before = snapshot(self.pool)
        g = self.pool.allocate(seq, n, epoch=self.epoch)
        if not g.ok:
            assert snapshot(self.pool) == before
            return
        assert g.num_cached_tokens == 0 and len(g.block_ids) == n
        lease = self.leases[seq]
        for b in g.block_ids:
            assert before[0][b] == 0
            self.content.pop(b, None)
            lease["fresh"].add(len(lease["blocks"]))
            lease["blocks"].append(b)
        assert self.pool.blocks_of(seq) == lease["blocks"]

    def _release(self, seq, num_computed):
        lease = self.leases.pop(seq)
        full = min(num_computed // BS, len(lease["hashes"]), len(lease["blocks"]))
        for i in range(full):
            if i in lease["fresh"]:
                self.content[lease["blocks"][i]] = (lease["scope"],
                                                    tuple(lease["tokens"][i * BS:(i + 1) * BS]))
        return len(lease["blocks"])

    @rule(seq=consumes(seqs), frac=st.floats(0, 1.2))
    def free(self, seq, frac):
        if seq not in self.leases:
            return
        num_computed = int(len(self.leases[seq]["tokens"]) * frac)
        expected = self._release(seq, num_computed)
        assert self.pool.free(seq, num_computed) == expected

    @rule()
    def bump_epoch(self):
        self.epoch += 1

    @rule(back=st.integers(0, 2))
    def reclaim(self, back):
        cutoff = self.epoch - back
        stale = sorted(s for s, lease in self.leases.items() if lease["epoch"] < cutoff)
        for s in stale:
            self._release(s, 0)
        assert sorted(self.pool.reclaim(cutoff)) == stale

    @invariant()
    def bookkeeping(self):
        pool = self.pool
        ref = pool._ref
        plain, cached = list(pool._plain), list(pool._cached)
        assert all(r >= 0 for r in ref)
        held = Counter(b for lease in self.leases.values() for b in lease["blocks"])
        assert ref == [held[b] for b in range(NUM_BLOCKS)]
        free = plain + cached
        assert len(free) == len(set(free))                        # no block listed twice
        assert all(ref[b] == 0 for b in free)                     # nothing free is referenced
        referenced = {b for b in range(NUM_BLOCKS) if ref[b] > 0}
        assert set(free) | referenced == set(range(NUM_BLOCKS))  # a partition of the pool
        assert pool.num_free == len(free) == NUM_BLOCKS - len(referenced)
        assert all(b in pool._block_hash for b in cached)         # cached means registered
        assert not any(b in pool._block_hash for b in plain)
        assert {b: h for h, b in pool._hash_to_block.items()} == pool._block_hash
        assert set(pool._block_key) == set(pool._block_hash)
        for b, key in pool._block_key.items():                   # registry tells the truth
            assert self.content.get(b) == (key.scope, key.tokens)
        assert {s: pool.blocks_of(s) for s in self.leases} == {
            s: lease["blocks"] for s, lease in self.leases.items()}
        held = {}                                                 # tenant -> distinct blocks
        for lease in self.leases.values():
            held.setdefault(lease["scope"], set()).update(lease["blocks"])
        assert pool.stats().tenant_blocks == {t: len(bs) for t, bs in held.items()}
        assert [pool.tenant_blocks(t) for t in SCOPES] == [len(held.get(t, ())) for t in SCOPES]

    def teardown(self):
        for seq in list(self.leases):
            self.pool.free(seq, len(self.leases.pop(seq)["tokens"]))
        assert self.pool.num_free == NUM_BLOCKS
        assert all(r == 0 for r in self.pool._ref)
        assert self.pool.stats().leased_seqs == 0


PoolMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40,
                                         deadline=None)
TestPoolMachine = PoolMachine.TestCase


def test_cache_events_record_stores_and_evictions_in_order():
    from components.kv_manager.pool import CacheEvent

    pool = BlockPool(3, 4)
    toks = list(range(12))
    pool.allocate(1, 3, scope="t1", block_hashes=[11, 12], token_ids=toks[:8], max_cached_blocks=2)
    pool.free(1, num_computed_tokens=8)
    assert pool.take_events() == [CacheEvent("stored", 11, "t1", "gpu", None),
                                  CacheEvent("stored", 12, "t1", "gpu", 11)]
    assert pool.take_events() == []
    pool.allocate(2, 2)                       # the one plain block, then the LRU cached block
    assert pool.take_events() == [CacheEvent("removed", 11, "t1", "gpu", None)]
    pool.free(2)
    pool.drop_cache()
    assert pool.take_events() == [CacheEvent("removed", 12, "t1", "gpu", 11)]


def test_snapshot_lists_every_cached_block_and_leaves_pending_events():
    from components.kv_manager.pool import CacheEvent

    pool = BlockPool(4, 4, num_cpu_blocks=2)
    toks = list(range(12))
    pool.allocate(1, 3, scope="t1", block_hashes=[11, 12], token_ids=toks[:8], max_cached_blocks=2)
    pool.free(1, num_computed_tokens=8)
    assert sorted(pool.snapshot(), key=lambda e: e.block_hash) == [
        CacheEvent("stored", 11, "t1", "gpu", None), CacheEvent("stored", 12, "t1", "gpu", 11)]
    assert len(pool.take_events()) == 2               # the snapshot took none of them
    pool.drop_cache()
    assert pool.snapshot() == []


def test_cached_tokens_query_is_read_only_and_scoped():
    pool = BlockPool(8, 4)
    toks = list(range(100, 112))
    hashes = [21, 22, 23]
    pool.allocate(1, 4, scope="t1", block_hashes=hashes, token_ids=toks, max_cached_blocks=2)
    assert pool.cached_tokens("t1", hashes, toks, 3) == 0          # nothing registered yet
    pool.free(1, num_computed_tokens=12)
    free_before, refs_before = pool.num_free, [pool.refcount(b) for b in range(8)]
    assert pool.cached_tokens("t1", hashes, toks, 3) == 12
    assert pool.cached_tokens("t1", hashes, toks, 2) == 8           # capped like a lease
    assert pool.cached_tokens("t2", hashes, toks, 3) == 0           # other scope: no hit
    assert pool.cached_tokens("t1", hashes, toks[:4] + [0] * 8, 3) == 4   # verified per block
    assert pool.num_free == free_before
    assert [pool.refcount(b) for b in range(8)] == refs_before
