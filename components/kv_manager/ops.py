"""Apply one scheduler step's KV operations to a block pool: frees first, then allocations."""
from __future__ import annotations

from components.kv_manager.pool import BlockPool
from schemas.wire import KvGrant, KvOps


def apply_ops(pool: BlockPool, ops: KvOps) -> list[KvGrant]:
    """Free, then lease, under ``ops.epoch``; one grant (ok or refused) per allocation."""
    for f in ops.frees:
        pool.free(f.seq_id, f.num_computed_tokens)
    grants = []
    for a in ops.allocs:
        g = pool.allocate(a.seq_id, a.num_blocks, epoch=ops.epoch, scope=a.scope,
                          block_hashes=a.block_hashes, token_ids=a.token_ids,
                          max_cached_blocks=a.max_cached_blocks)
        grants.append(KvGrant(ops.epoch, a.seq_id, g.ok, g.block_ids, g.num_cached_tokens))
    return grants
