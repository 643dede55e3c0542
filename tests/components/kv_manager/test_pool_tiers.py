"""BlockPool depth: copy-on-write forks, swap to the cpu tier, demotion and promotion of
cached prefixes, public scopes, the watermark, and a stateful property test that replays
every block copy the pool asks for against a model of what each physical block holds."""
from __future__ import annotations

import copy
from collections import Counter, defaultdict

from hypothesis import settings, strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, invariant, rule

from components.kv_manager.pool import BlockCopy, BlockPool, CacheEvent, Grant

BS = 4


def hashes_of(tokens, salt=""):
    return [hash((salt, tuple(tokens[:(i + 1) * BS]))) for i in range(len(tokens) // BS)]


def alloc_prompt(pool, seq_id, tokens, num_blocks, scope="t1", **kw):
    hs = hashes_of(tokens)
    return pool.allocate(seq_id, num_blocks, scope=scope, block_hashes=hs,
                         token_ids=list(tokens[:len(hs) * BS]),
                         max_cached_blocks=(len(tokens) - 1) // BS, **kw)


P = list(range(100, 110))            # 10 tokens: 2 full blocks + 2


# ---------------------------------------------------------------- copy-on-write

def test_fork_shares_full_blocks_and_copies_the_partial_tail():
    pool = BlockPool(8, BS)
    assert alloc_prompt(pool, 1, P, 3).block_ids == [0, 1, 2]
    g = pool.fork(1, 2, num_tokens=10)
    assert g == Grant(True, [0, 1, 3], 0, [BlockCopy(2, 3)])     # tail 2 copied to 3
    assert [pool.refcount(b) for b in range(4)] == [2, 2, 1, 1]
    g = pool.fork(1, 3, num_tokens=8)                             # block-aligned: no copy
    assert g == Grant(True, [0, 1], 0, [])
    assert pool.refcount(0) == 3
    # the first write into a shared block copies it; a private block is written in place
    assert pool.write_block(3, 1) == [BlockCopy(1, 4)]
    assert pool.blocks_of(3) == [0, 4] and pool.refcount(1) == 2
    assert pool.write_block(3, 1) == []
    # refcounts reach zero only when the last user frees
    pool.free(1, 10)
    assert pool.refcount(0) == 2 and 0 not in pool._cached
    pool.free(2, 10)
    pool.free(3, 8)
    assert pool.num_free == 8 and all(pool.refcount(b) == 0 for b in range(8))


def test_fork_refused_without_a_block_for_the_copy():
    pool = BlockPool(3, BS)
    alloc_prompt(pool, 1, P, 3)
    assert pool.fork(1, 2, num_tokens=10) == Grant(False, [], reason="pool_full")
    assert pool.fork(1, 2, num_tokens=8).ok                       # aligned needs none
    assert pool.fork(1, 2, num_tokens=8) == Grant(False, [])      # child exists already
    assert pool.fork(9, 4, num_tokens=4) == Grant(False, [])      # unknown parent


# ---------------------------------------------------------------- swap

def test_swap_out_and_in_move_exactly_the_computed_blocks():
    pool = BlockPool(4, BS, num_cpu_blocks=3)
    assert pool.allocate(1, 4).block_ids == [0, 1, 2, 3]
    g = pool.swap_out(1, num_tokens=9)                             # 3 blocks hold 9 tokens
    assert g == Grant(True, [4, 5, 6], 0, [BlockCopy(0, 4), BlockCopy(1, 5), BlockCopy(2, 6)])
    assert pool.num_free == 4 and pool.num_cpu_free == 0
    assert pool.stats().swapped_seqs == 1
    assert pool.allocate(1, 1) == Grant(False, [])                 # no growth while swapped
    assert pool.allocate(2, 2).block_ids == [0, 1]
    assert pool.swap_in(1) == Grant(False, [], reason="pool_full")  # needs 3, 2 free
    pool.free(2)
    g = pool.swap_in(1)
    assert g == Grant(True, [2, 3, 0], 0, [BlockCopy(4, 2), BlockCopy(5, 3), BlockCopy(6, 0)])
    assert pool.num_cpu_free == 3 and pool.stats().swapped_seqs == 0
    pool.free(1)
    assert pool.num_free == 4


def test_swap_out_refused_when_the_cpu_tier_is_full():
    pool = BlockPool(4, BS, num_cpu_blocks=1)
    pool.allocate(1, 2)
    before = (list(pool._ref), pool.blocks_of(1))
    assert pool.swap_out(1, num_tokens=5) == Grant(False, [], reason="pool_full")
    assert (list(pool._ref), pool.blocks_of(1)) == before
    assert pool.swap_out(1, num_tokens=4).ok


# ---------------------------------------------------------------- cpu tier for prefixes

def test_evicted_prefix_is_demoted_then_promoted_on_a_hit():
    pool = BlockPool(3, BS, num_cpu_blocks=2)
    alloc_prompt(pool, 1, P, 3)
    pool.free(1, 10)                                  # blocks 0, 1 cached; 2 plain
    pool.take_events()
    g = pool.allocate(2, 3)                           # plain 2, then evicts 0 and 1 (LRU)
    assert g == Grant(True, [2, 0, 1], 0, [BlockCopy(0, 3), BlockCopy(1, 4)])
    assert pool.stats().cpu_cached == 2 and pool.stats().cached == 0
    h = hashes_of(P)
    assert pool.take_events() == [
        CacheEvent("removed", h[0], "t1", "gpu", None),
        CacheEvent("stored", h[0], "t1", "cpu", None),
        CacheEvent("removed", h[1], "t1", "gpu", h[0]),
        CacheEvent("stored", h[1], "t1", "cpu", h[0])]
    assert pool.cached_tokens("t1", h, P[:8], 2) == 8             # cpu hits count
    assert pool.cached_tokens("t2", h, P[:8], 2) == 0
    pool.free(2)
    # without promotion a cpu-tier hit is a miss
    assert alloc_prompt(pool, 3, P, 3, promote=False).num_cached_tokens == 0
    pool.free(3)
    g = alloc_prompt(pool, 4, P, 3)
    assert g.ok and g.num_cached_tokens == 8
    assert [c.src for c in g.copies] == [3, 4]                    # back from the cpu tier
    assert [c.dst for c in g.copies] == g.block_ids[:2]
    assert pool.stats().cpu_cached == 0 and pool.stats().cached == 2


def test_cpu_tier_is_bounded_and_evicts_lru():
    pool = BlockPool(2, BS, num_cpu_blocks=1)
    a, b = [1, 2, 3, 4, 0], [5, 6, 7, 8, 0]
    alloc_prompt(pool, 1, a, 2)
    pool.free(1, 4)                                   # a's block 0 cached
    pool.allocate(2, 2)                               # plain 1, then demote 0 -> cpu 2
    pool.free(2)
    alloc_prompt(pool, 3, b, 2)
    pool.free(3, 4)                                   # b cached on gpu
    pool.allocate(4, 2)                               # demoting b evicts a from the cpu tier
    assert pool.stats().cpu_cached == 1
    pool.free(4)
    assert alloc_prompt(pool, 5, a, 2).num_cached_tokens == 0
    pool.free(5)
    assert alloc_prompt(pool, 6, b, 2).num_cached_tokens == 4


# ---------------------------------------------------------------- scopes and watermark

def test_public_prefix_is_shared_across_tenants_and_nothing_else_is():
    pool = BlockPool(16, BS)
    prompt = P + [7, 7, 7]                            # 3 full blocks; first 2 are public
    kw = dict(public_scope="public:sys", public_blocks=2)
    alloc_prompt(pool, 1, prompt, 4, scope="a", **kw)
    pool.free(1, 12)
    assert alloc_prompt(pool, 2, prompt, 4, scope="b", **kw).num_cached_tokens == 8
    assert alloc_prompt(pool, 3, prompt, 4, scope="a", **kw).num_cached_tokens == 12
    assert alloc_prompt(pool, 4, prompt, 4, scope="b").num_cached_tokens == 0   # not opted in


def test_watermark_holds_back_first_leases_not_growth():
    pool = BlockPool(8, BS, watermark_blocks=2)
    assert pool.allocate(1, 6).ok
    assert pool.below_watermark is False
    assert pool.allocate(2, 1) == Grant(False, [], reason="pool_full")  # leaves 1 < 2 free
    assert pool.allocate(1, 2).ok                     # growth may use the reserve
    assert pool.below_watermark


# ---------------------------------------------------------------- property test

NUM_GPU, NUM_CPU = 10, 6
PUBLIC = [9, 9, 9, 9, 8, 8, 8, 8]                    # a 2-block public system prompt


class TieredPoolMachine(RuleBasedStateMachine):
    """allocate / append / fork / free / preempt (recompute or swap) / swap back / evict,
    against a model of every physical block's content. Each copy the pool returns is
    replayed on the model, so a wrong copy, a missing copy-on-write, a bad demotion or
    promotion, or a hit from another scope shows up as a block that reads back wrong."""

    seqs = Bundle("seqs")

    def __init__(self) -> None:
        super().__init__()
        self.pool = BlockPool(NUM_GPU, BS, num_cpu_blocks=NUM_CPU)
        self.content: dict[int, tuple] = {}                 # block -> (scope, tokens written)
        self.seqs_: dict[int, dict] = {}                    # seq -> scope, tokens, computed
        self.next_id = 1

    # -- helpers
    def apply(self, copies):
        for c in copies:
            assert c.src != c.dst
            self.content[c.dst] = self.content.get(c.src)

    def scope_at(self, s, i):
        return "public" if i < s["public"] else s["scope"]

    def expected(self, s, i):
        return (self.scope_at(s, i), tuple(s["tokens"][i * BS:min(s["computed"], (i + 1) * BS)]))

    def new_seq(self, **state):
        seq = self.next_id
        self.next_id += 1
        self.seqs_[seq] = state
        return seq

    # -- rules
    @rule(target=seqs, scope=st.sampled_from("ab"), public=st.booleans(),
          tail=st.lists(st.integers(0, 2), max_size=14), extra=st.integers(0, 2),
          promote=st.booleans())
    def allocate(self, scope, public, tail, extra, promote):
        tokens = (PUBLIC if public else []) + tail
        hs = hashes_of(tokens)
        n = -(-(len(tokens) + 1) // BS) + extra
        g = self.pool.allocate(self.next_id, n, scope=scope, block_hashes=hs,
                               token_ids=tokens[:len(hs) * BS],
                               max_cached_blocks=(len(tokens) - 1) // BS if tokens else 0,
                               public_scope="public" if public else "",
                               public_blocks=2 if public else 0, promote=promote)
        if not g.ok:
            return None
        self.apply(g.copies)
        s = dict(scope=scope, public=2 if public else 0, tokens=tokens, prompt=len(tokens),
                 computed=g.num_cached_tokens, swapped=False)
        for i in range(g.num_cached_tokens // BS):          # every hit reads back right
            assert self.content.get(g.block_ids[i]) == self.expected(s, i)
        return self.new_seq(**s)

    @rule(seq=seqs, k=st.integers(1, 6), new=st.lists(st.integers(0, 2), max_size=4))
    def compute(self, seq, k, new):
        """Compute up to k more tokens (prompt first, then sampled ones), copying a shared
        block before writing it, and growing the lease when a block runs out."""
        s = self.seqs_.get(seq)
        if s is None or s["swapped"]:
            return
        s["tokens"] = s["tokens"] + new
        for _ in range(k):
            p = s["computed"]
            if p >= len(s["tokens"]):
                return
            blocks = self.pool.blocks_of(seq)
            if p // BS >= len(blocks):
                g = self.pool.allocate(seq, 1)
                if not g.ok:
                    return
                self.apply(g.copies)
                blocks = self.pool.blocks_of(seq)
            copies = self.pool.write_block(seq, p // BS)
            if copies is None:
                return
            self.apply(copies)
            s["computed"] += 1
            self.content[self.pool.blocks_of(seq)[p // BS]] = self.expected(s, p // BS)

    @rule(target=seqs, seq=seqs)
    def fork(self, seq):
        s = self.seqs_.get(seq)
        if s is None or s["swapped"] or s["computed"] < max(s["prompt"], 1):
            return None                        # forks happen once the prompt is computed
        g = self.pool.fork(seq, self.next_id, s["computed"])
        if not g.ok:
            return None
        self.apply(g.copies)
        return self.new_seq(**dict(s, tokens=s["tokens"][:s["computed"]]))

    @rule(seq=consumes(seqs), frac=st.floats(0, 1.2))
    def free(self, seq, frac):
        """Finish, cancel, or preempt by recompute: free with some computed tokens."""
        s = self.seqs_.pop(seq, None)
        if s is not None:
            n = int(s["computed"] * frac)
            self.pool.free(seq, min(n, s["computed"]))

    @rule(seq=seqs)
    def swap_out(self, seq):
        s = self.seqs_.get(seq)
        if s is None or s["swapped"]:
            return
        g = self.pool.swap_out(seq, s["computed"])
        if g.ok:
            self.apply(g.copies)
            s["swapped"] = True
            assert all(self.pool.tier(b) == "cpu" for b in g.block_ids)

    @rule(seq=seqs)
    def swap_in(self, seq):
        s = self.seqs_.get(seq)
        if s is None or not s["swapped"]:
            return
        g = self.pool.swap_in(seq)
        if g.ok:
            self.apply(g.copies)
            s["swapped"] = False
            assert all(self.pool.tier(b) == "gpu" for b in g.block_ids)

    @rule(n=st.integers(1, 4))
    def pressure(self, n):
        """A throwaway lease that forces evictions (and demotions), then goes away."""
        g = self.pool.allocate(10_000, n, scope="c")
        if g.ok:
            self.apply(g.copies)
            self.pool.free(10_000)

    # -- invariants
    @invariant()
    def blocks_read_back_and_books_balance(self):
        pool, ref = self.pool, self.pool._ref
        assert all(r >= 0 for r in ref)
        held = Counter(b for sid in self.seqs_ for b in pool.blocks_of(sid))
        assert ref == [held[b] for b in range(NUM_GPU + NUM_CPU)]
        scopes = defaultdict(set)
        for sid, s in self.seqs_.items():
            blocks = pool.blocks_of(sid)
            for i in range(-(-s["computed"] // BS)):
                assert self.content.get(blocks[i]) == self.expected(s, i), (sid, i)
            for i, b in enumerate(blocks):
                scopes[b].add(self.scope_at(s, i))
        assert all(len(v) == 1 for v in scopes.values())       # never shared across scopes
        for tier, lo, hi in (("gpu", 0, NUM_GPU), ("cpu", NUM_GPU, NUM_GPU + NUM_CPU)):
            t = pool._tiers[tier]
            free = list(t.plain) + list(t.cached)
            assert len(free) == len(set(free)) and all(lo <= b < hi for b in free)
            assert all(ref[b] == 0 for b in free)                # never free while referenced
            assert set(free) | {b for b in range(lo, hi) if ref[b]} == set(range(lo, hi))
            assert all(b in pool._block_hash for b in t.cached)
        for b, key in pool._block_key.items():                   # registry tells the truth
            assert self.content.get(b) == (key.scope, key.tokens)
            assert scopes.get(b, {key.scope}) == {key.scope}
        held = defaultdict(set)                  # tenant -> distinct main-tier blocks
        for sid, s in self.seqs_.items():
            held[s["scope"]].update(b for b in pool.blocks_of(sid) if b < NUM_GPU)
        assert pool.stats().tenant_blocks == {t: len(bs) for t, bs in held.items() if bs}

    def teardown(self):
        for sid in list(self.seqs_):
            self.pool.free(sid, self.seqs_.pop(sid)["computed"])
        assert self.pool.num_free == NUM_GPU and self.pool.num_cpu_free == NUM_CPU
        assert all(r == 0 for r in self.pool._ref)


TieredPoolMachine.TestCase.settings = settings(max_examples=200, stateful_step_count=50,
                                               deadline=None)
TestTieredPoolMachine = TieredPoolMachine.TestCase


class BudgetOracle:
    """A pool with tenant budgets that runs every allocate, fork and swap_in also on a copy
    of itself without budgets. Granted, the two must agree exactly and leave the tenant
    within its budget; refused for the budget, nothing may change, and the copy must go
    over the budget (or find the pool full); refused otherwise, the copy is refused alike."""

    def __init__(self, pool: BlockPool) -> None:
        self.pool = pool

    def __getattr__(self, name):
        return getattr(self.pool, name)

    def allocate(self, seq_id, num_blocks, **kw):
        lease = self.pool._leases.get(seq_id)
        tenant = lease.scope if lease else kw.get("scope", "")
        return self._checked(tenant, lambda p: p.allocate(seq_id, num_blocks, **kw))

    def fork(self, parent, child, num_tokens):
        lease = self.pool._leases.get(parent)
        return self._checked(lease.scope if lease else "",
                             lambda p: p.fork(parent, child, num_tokens))

    def swap_in(self, seq_id):
        lease = self.pool._leases.get(seq_id)
        return self._checked(lease.scope if lease else "", lambda p: p.swap_in(seq_id))

    def _checked(self, tenant, op):
        unbudgeted = copy.deepcopy(self.pool)
        unbudgeted.budgets = {}
        before = state(self.pool)
        g, u = op(self.pool), op(unbudgeted)
        budget = self.pool.budgets.get(tenant)
        if g.ok:
            assert g == u and state(self.pool) == state(unbudgeted)
            assert budget is None or self.pool.tenant_blocks(tenant) <= budget
        elif g.reason == "tenant_kv_budget":
            assert g == Grant(False, [], reason="tenant_kv_budget") and budget is not None
            assert state(self.pool) == before
            assert u.reason == "pool_full" or unbudgeted.tenant_blocks(tenant) > budget
        else:
            assert g == u and state(self.pool) == before
        return g


def state(pool):
    return (list(pool._ref), {t: (list(x.plain), list(x.cached)) for t, x in pool._tiers.items()},
            dict(pool._hash_to_block), dict(pool._block_key),
            {s: (list(lease.blocks), lease.swapped) for s, lease in pool._leases.items()},
            {t: dict(held) for t, held in pool._held.items()}, pool.query_tokens,
            pool.hit_tokens, list(pool.events))


class BudgetedTieredPoolMachine(TieredPoolMachine):
    """The same random workload with tenant "a" limited to 4 of the 10 main-tier blocks
    ("b" and the pressure tenant "c" unlimited), every budgeted op checked by the oracle."""

    def __init__(self) -> None:
        super().__init__()
        self.pool = BudgetOracle(BlockPool(NUM_GPU, BS, num_cpu_blocks=NUM_CPU,
                                           tenant_blocks={"a": 4}))


BudgetedTieredPoolMachine.TestCase.settings = settings(max_examples=100, stateful_step_count=50,
                                                       deadline=None)
TestBudgetedTieredPoolMachine = BudgetedTieredPoolMachine.TestCase
