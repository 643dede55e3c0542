"""BlockPool per-tenant KV budgets: what a tenant holds (distinct main-tier blocks its leases
reference), which ops the budget refuses and why, and that a refusal changes nothing."""
from __future__ import annotations

import msgspec

from components.kv_manager.ops import apply_ops
from components.kv_manager.pool import BlockCopy, BlockPool, Grant
from components.kv_manager.service import tenant_budgets
from schemas.config import AdmissionConfig, TenantConfig
from schemas.wire import AllocRequest, ForkRequest, KvGrant, KvOps

BS = 4
P = list(range(100, 110))            # 10 tokens: 2 full blocks + 2
BUDGET = Grant(False, [], reason="tenant_kv_budget")
FULL = Grant(False, [], reason="pool_full")


def hashes_of(tokens):
    return [hash(tuple(tokens[:(i + 1) * BS])) for i in range(len(tokens) // BS)]


def alloc_prompt(pool, seq_id, tokens, num_blocks, scope="a", **kw):
    hs = hashes_of(tokens)
    return pool.allocate(seq_id, num_blocks, scope=scope, block_hashes=hs,
                         token_ids=list(tokens[:len(hs) * BS]),
                         max_cached_blocks=(len(tokens) - 1) // BS, **kw)


def state(pool):
    """Everything a refused op must leave as it was."""
    return (list(pool._ref), {t: (list(x.plain), list(x.cached)) for t, x in pool._tiers.items()},
            dict(pool._hash_to_block), dict(pool._block_key),
            {s: (list(lease.blocks), lease.swapped) for s, lease in pool._leases.items()},
            {t: dict(held) for t, held in pool._held.items()}, pool.query_tokens,
            pool.hit_tokens, list(pool.events))


def test_a_tenant_at_its_budget_is_refused_while_another_is_granted():
    pool = BlockPool(16, BS, tenant_blocks={"a": 3})
    assert pool.allocate(1, 3, scope="a") == Grant(True, [0, 1, 2])
    assert pool.tenant_blocks("a") == 3
    before = state(pool)
    assert pool.allocate(1, 1) == BUDGET                          # growth
    assert pool.allocate(2, 1, scope="a") == BUDGET               # a first lease
    assert state(pool) == before and pool.num_free == 13
    assert pool.allocate(3, 5, scope="b") == Grant(True, [3, 4, 5, 6, 7])   # b: no budget
    assert pool.allocate(4, 2) == Grant(True, [8, 9])             # nor the default scope
    assert pool.stats().tenant_blocks == {"a": 3, "b": 5, "": 2}
    assert pool.refusals == {"tenant_kv_budget": 2}


def test_freeing_brings_the_tenant_back_under_its_budget():
    pool = BlockPool(16, BS, tenant_blocks={"a": 4})
    pool.allocate(1, 3, scope="a")
    pool.allocate(2, 1, scope="a")
    assert pool.allocate(3, 1, scope="a") == BUDGET
    assert pool.free(1) == 3 and pool.tenant_blocks("a") == 1
    assert pool.allocate(3, 3, scope="a") == Grant(True, [4, 5, 6])
    assert pool.allocate(2, 1) == BUDGET                          # at 4 of 4 again
    pool.free(2)
    pool.free(3)
    assert pool.tenant_blocks("a") == 0 and pool.stats().tenant_blocks == {}


def test_shared_prefix_blocks_count_once_and_cached_blocks_count_for_nobody():
    pool = BlockPool(16, BS, tenant_blocks={"a": 5})
    assert alloc_prompt(pool, 1, P, 3).block_ids == [0, 1, 2]
    pool.free(1, 10)                                              # 0, 1 cached
    assert pool.tenant_blocks("a") == 0 and pool.stats().cached == 2
    assert alloc_prompt(pool, 2, P, 3) == Grant(True, [0, 1, 3], 8)   # cached hits: held now
    assert pool.tenant_blocks("a") == 3
    assert alloc_prompt(pool, 3, P, 3) == Grant(True, [0, 1, 4], 8)   # held hits cost nothing
    assert alloc_prompt(pool, 4, P, 3) == Grant(True, [0, 1, 5], 8)
    assert pool.tenant_blocks("a") == 5 and pool.refcount(0) == 3
    before = state(pool)
    assert alloc_prompt(pool, 5, P, 3) == BUDGET                  # its tail would be the 6th
    assert state(pool) == before and pool.num_free == 11
    assert alloc_prompt(pool, 5, P, 2) == Grant(True, [0, 1], 8)  # all hits: nothing new
    pool.free(2, 10)
    pool.free(3, 10)
    assert pool.tenant_blocks("a") == 3                           # 0, 1 still held by 4 and 5


def test_a_hit_on_an_unreferenced_cached_block_counts():
    pool = BlockPool(16, BS, tenant_blocks={"a": 3})
    alloc_prompt(pool, 1, P, 3)
    pool.free(1, 10)                                              # 0, 1 cached
    assert pool.allocate(2, 2, scope="a") == Grant(True, [3, 4])
    before = state(pool)
    # both blocks would be hits, in the pool already, but a would newly hold both: 4 > 3
    assert alloc_prompt(pool, 3, P, 2) == BUDGET
    assert state(pool) == before
    pool.free(2)
    assert alloc_prompt(pool, 3, P, 2) == Grant(True, [0, 1], 8)
    assert pool.tenant_blocks("a") == 2


def test_public_blocks_count_for_every_tenant_that_holds_them():
    pool = BlockPool(16, BS, tenant_blocks={"a": 3, "b": 3})
    prompt = P[:8] + [7]                                          # 2 public full blocks + 1
    kw = {"public_scope": "public:sys", "public_blocks": 2}
    assert alloc_prompt(pool, 1, prompt, 3, **kw).block_ids == [0, 1, 2]
    pool.free(1, 8)
    assert alloc_prompt(pool, 2, prompt, 3, **kw) == Grant(True, [0, 1, 3], 8)
    assert alloc_prompt(pool, 3, prompt, 3, scope="b", **kw) == Grant(True, [0, 1, 4], 8)
    assert pool.stats().tenant_blocks == {"a": 3, "b": 3}         # 0, 1 counted for both
    assert alloc_prompt(pool, 4, prompt, 3, scope="b", **kw) == BUDGET
    pool.free(2)
    assert pool.stats().tenant_blocks == {"b": 3}                 # a leaving changes b nothing


def test_the_budget_is_checked_before_the_pool():
    pool = BlockPool(4, BS, tenant_blocks={"a": 2})
    pool.allocate(1, 2, scope="a")
    pool.allocate(2, 2, scope="b")
    assert pool.num_free == 0
    assert pool.allocate(3, 1, scope="a") == BUDGET               # freeing b would not help
    assert pool.allocate(3, 1, scope="b") == FULL
    assert pool.allocate(2, 1) == FULL
    assert pool.refusals == {"tenant_kv_budget": 1, "pool_full": 2}
    # only the hits show it: 2 cached blocks a does not hold + 1 new = 3 > 2 (the pool is
    # short too: the 2 free blocks are the hits, and a first lease must leave 2 free)
    pool = BlockPool(6, BS, watermark_blocks=2, tenant_blocks={"a": 2})
    alloc_prompt(pool, 1, P, 2)
    pool.free(1, 8)                                               # 0, 1 cached
    assert pool.allocate(2, 4, scope="b") == Grant(True, [2, 3, 4, 5])
    assert alloc_prompt(pool, 3, P, 3) == BUDGET
    assert alloc_prompt(pool, 3, P, 3, scope="b") == FULL


def test_fork_shares_for_free_and_charges_the_copy_of_a_partial_tail():
    pool = BlockPool(16, BS, tenant_blocks={"a": 4})
    assert alloc_prompt(pool, 1, P, 3).block_ids == [0, 1, 2]
    assert pool.fork(1, 2, num_tokens=8) == Grant(True, [0, 1])   # aligned: shares only
    assert pool.tenant_blocks("a") == 3
    g = pool.fork(1, 3, num_tokens=10)
    assert g == Grant(True, [0, 1, 3], 0, [BlockCopy(2, 3)])     # the tail's copy is new
    assert pool.tenant_blocks("a") == 4
    before = state(pool)
    assert pool.fork(1, 4, num_tokens=10) == BUDGET
    assert state(pool) == before
    assert pool.fork(1, 4, num_tokens=8) == Grant(True, [0, 1])   # at 4 of 4, costs nothing
    assert pool.refcount(0) == 4 and pool.tenant_blocks("a") == 4


def test_copy_on_write_is_never_refused_and_counts_exactly():
    pool = BlockPool(16, BS, tenant_blocks={"a": 3})
    alloc_prompt(pool, 1, P, 3)
    pool.fork(1, 2, num_tokens=8)
    assert pool.tenant_blocks("a") == 3
    # block 1 stays held through seq 1: the copy takes a to 4 of 3, and is still made
    assert pool.write_block(2, 1) == [BlockCopy(1, 3)]
    assert pool.tenant_blocks("a") == 4
    assert pool.allocate(1, 1) == BUDGET                          # over: every op is refused
    assert pool.fork(1, 3, num_tokens=8) == BUDGET                # even one that costs nothing
    pool.free(1, 8)                                               # 0, 1 cached; 0 still held
    assert pool.tenant_blocks("a") == 2
    # a block shared only with the cache: the copy replaces it, so the count stays
    assert pool.write_block(2, 0) == [BlockCopy(0, 4)]
    assert pool.blocks_of(2) == [4, 3] and pool.tenant_blocks("a") == 2
    assert pool.refcount(0) == 0 and list(pool._cached) == [1, 0]


def test_swap_out_releases_the_main_tier_and_swap_in_rechecks():
    pool = BlockPool(8, BS, num_cpu_blocks=4, tenant_blocks={"a": 3})
    pool.allocate(1, 3, scope="a")
    assert pool.swap_out(1, num_tokens=6).block_ids == [8, 9]     # 2 kept, all 3 released
    assert pool.tenant_blocks("a") == 0 and pool.stats().tenant_blocks == {}
    assert pool.allocate(2, 2, scope="a") == Grant(True, [3, 4])
    before = state(pool)
    assert pool.swap_in(1) == BUDGET                              # 2 + 2 > 3; 6 blocks free
    assert state(pool) == before
    pool.free(2)
    g = pool.swap_in(1)
    assert g == Grant(True, [5, 6], 0, [BlockCopy(8, 5), BlockCopy(9, 6)])
    assert pool.tenant_blocks("a") == 2


def test_without_budgets_every_tenant_is_counted_and_none_is_refused():
    pool = BlockPool(4, BS)
    assert pool.allocate(1, 3, scope="a").ok and pool.allocate(2, 1, scope="b").ok
    assert pool.stats().tenant_blocks == {"a": 3, "b": 1}
    assert pool.allocate(3, 1, scope="a") == FULL


def test_apply_ops_passes_the_reason_through():
    pool = BlockPool(8, BS, tenant_blocks={"a": 2})
    grants = apply_ops(pool, KvOps(7, [], [AllocRequest(1, 2, "a"), AllocRequest(2, 1, "a"),
                                           AllocRequest(3, 9, "b")]))
    assert grants == [KvGrant(7, 1, True, [0, 1], 0),
                      KvGrant(7, 2, False, [], 0, reason="tenant_kv_budget"),
                      KvGrant(7, 3, False, [], 0, reason="pool_full")]
    grants = apply_ops(pool, KvOps(8, [], [], forks=[ForkRequest(1, 4, 6)]))
    assert grants == [KvGrant(8, 4, False, [], 0, "fork", reason="tenant_kv_budget")]


def test_kv_grant_reason_is_a_trailing_field_old_encodings_still_decode():
    g = KvGrant(3, 1, False, [], 0, "alloc", [], "tenant_kv_budget")
    raw = msgspec.msgpack.decode(msgspec.msgpack.encode(g))
    assert raw[-1] == "tenant_kv_budget"
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(g), type=KvGrant) == g
    old = msgspec.msgpack.encode(raw[:-1])                        # as sent before the field
    assert msgspec.msgpack.decode(old, type=KvGrant) == KvGrant(3, 1, False, [], 0)


def test_budgets_come_from_the_admission_tenants():
    cfg = AdmissionConfig(tenants=(TenantConfig("a", kv_blocks=40), TenantConfig("b"),
                                   TenantConfig("c", kv_blocks=1)))
    assert tenant_budgets(cfg) == {"a": 40, "c": 1}
    assert tenant_budgets(AdmissionConfig()) == {}
