"""The router's approximate view of each replica's prefix cache, kept from the replica's
KV event stream (``KvEvents``, published by its kv_manager).

It is off the hot path: it is updated as events arrive and read with one dict lookup per
prompt block. It is approximate by design: events take a moment to arrive, and a gap (a
PUB socket drops messages past its high-water mark, or the replica restarted) leaves the
view stale until the snapshot that a fresh subscription brings. The view is scoped as the
cache is: a block matches only under the scope it was stored with (a tenant, or a public
system prompt's scope)."""
from __future__ import annotations

from dataclasses import dataclass, field

from schemas.wire import KvEvents

GPU, CPU = "gpu", "cpu"


@dataclass(frozen=True)
class PrefixMatch:
    """How many of a prompt's leading full blocks a replica holds, by tier."""

    gpu_blocks: int = 0
    cpu_blocks: int = 0

    @property
    def blocks(self) -> int:
        return self.gpu_blocks + self.cpu_blocks


@dataclass
class ReplicaIndex:
    blocks: dict[int, tuple[str, str]] = field(default_factory=dict)   # hash -> (scope, tier)
    instance: int | None = None
    seq: int = 0
    synced: bool = False            # a snapshot arrived and no gap since
    gaps: int = 0
    snapshots: int = 0
    stored: int = 0                 # "stored" events applied (snapshots not counted)

    def apply(self, msg: KvEvents) -> bool:
        """Take one message; False when it shows a gap, so the caller must resync
        (subscribe again, which makes the replica publish a snapshot). The events of a
        message after a gap are still applied: a stale view routes better than none."""
        if msg.snapshot:
            self.blocks = {h: (scope, tier) for _, h, scope, tier, _ in msg.events}
            self.instance, self.seq, self.synced = msg.instance, msg.seq, True
            self.snapshots += 1
            return True
        in_order = self.synced and msg.instance == self.instance and msg.seq == self.seq + 1
        for kind, h, scope, tier, _ in msg.events:
            if kind == "stored":
                self.blocks[h] = (scope, tier)
                self.stored += 1
            elif self.blocks.get(h, (None, None))[1] == tier:   # removed from that tier
                del self.blocks[h]
        self.instance, self.seq = msg.instance, msg.seq
        if not in_order:
            self.synced = False
            self.gaps += 1
        return in_order

    def clear(self) -> None:
        """The replica restarted or was lost: its cache is gone."""
        self.blocks.clear()
        self.synced = False

    def match(self, hashes: list[int], public_scope: str, public_blocks: int,
              tenant: str) -> PrefixMatch:
        """The prompt's leading blocks this replica holds: block i must be stored under
        the public scope for i < public_blocks and under the tenant after. The first miss
        ends the prefix (a block's hash covers everything before it)."""
        gpu = cpu = 0
        for i, h in enumerate(hashes):
            entry = self.blocks.get(h)
            if entry is None or entry[0] != (public_scope if i < public_blocks else tenant):
                break
            if entry[1] == GPU:
                gpu += 1
            else:
                cpu += 1
        return PrefixMatch(gpu, cpu)
