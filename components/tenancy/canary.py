"""Which tenants a canary takes: those whose name hashes under its share. Sticky (the same
tenant lands on the same side at every request, in every process, across restarts) and
nested (a tenant in the canary at one share stays in it at any larger share), so raising
the share only adds tenants. Admission decides with it; the streamer's watchdog labels
outcomes with it.
"""
from __future__ import annotations

import hashlib


def point(tenant: str) -> float:
    """The tenant's place in [0, 1): the first 8 bytes of sha256 of its name."""
    digest = hashlib.sha256(tenant.encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def in_canary(tenant: str, share: float) -> bool:
    """Whether a canary of ``share`` (in (0, 1]) takes ``tenant``."""
    return point(tenant) < share
