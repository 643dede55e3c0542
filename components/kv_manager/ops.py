"""Apply one scheduler step's KV operations to a block pool, in the order KvOps documents:
forks, frees, swap-outs, swap-ins, allocations. One grant (ok or refused) per op but frees."""
from __future__ import annotations

from components.kv_manager.pool import BlockPool, Grant
from schemas.wire import KvGrant, KvOps


def apply_ops(pool: BlockPool, ops: KvOps) -> list[KvGrant]:
    grants: list[KvGrant] = []

    def grant(seq_id: int, kind: str, g: Grant) -> None:
        grants.append(KvGrant(ops.epoch, seq_id, g.ok, g.block_ids, g.num_cached_tokens, kind,
                              g.copies, g.reason))

    for fork in ops.forks:
        grant(fork.child, "fork", pool.fork(fork.parent, fork.child, fork.num_tokens,
                                           epoch=ops.epoch))
    for free in ops.frees:
        pool.free(free.seq_id, free.num_computed_tokens)
    for s in ops.swap_outs:
        grant(s.seq_id, "swap_out", pool.swap_out(s.seq_id, s.num_tokens))
    for seq_id in ops.swap_ins:
        grant(seq_id, "swap_in", pool.swap_in(seq_id))
    for a in ops.allocs:
        grant(a.seq_id, "alloc", pool.allocate(
            a.seq_id, a.num_blocks, epoch=ops.epoch, scope=a.scope, block_hashes=a.block_hashes,
            token_ids=a.token_ids, max_cached_blocks=a.max_cached_blocks,
            public_scope=a.public_scope, public_blocks=a.public_blocks, promote=a.promote,
            cached_multiple=a.cached_multiple))
    return grants
