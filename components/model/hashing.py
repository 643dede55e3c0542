"""Chained, scoped 64-bit hashes of full token blocks, stable across processes."""
from __future__ import annotations

import hashlib
from collections.abc import Sequence

import msgspec

_DOMAIN = "weir-block-v1"
_encode = msgspec.msgpack.Encoder().encode


def chain_hash(parent: int | None, tokens: Sequence[int], scope: str, model_id: str) -> int:
    """Hash of one block given its parent block's hash (None for the first block)."""
    key = (_DOMAIN, parent, tuple(map(int, tokens)), ("scope", scope), ("model", model_id))
    return int.from_bytes(hashlib.blake2b(_encode(key), digest_size=8).digest(), "little")


def block_hashes(token_ids: Sequence[int], block_size: int, scope: str, model_id: str,
                 parent: int | None = None) -> list[int]:
    """One hash per full block of token_ids; a trailing partial block gets none.

    Block i's hash covers every token before it, the scope and the model. To extend a known
    chain, pass the hash of the block just before token_ids[0] as parent.
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    hashes: list[int] = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = chain_hash(parent, token_ids[start:start + block_size], scope, model_id)
        hashes.append(parent)
    return hashes
