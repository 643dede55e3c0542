"""Admission's ledger: what the requests it admitted hold until the scheduler lets them go.

One entry per admitted request (``HeldRequest``: its tenant, class, ``n`` and reserved KV
blocks, and the TTFT predicted for it), and the counts the policy's caps read, kept with
the entries: outstanding requests per tenant, reserved blocks in all and per tenant,
sequences per tenant and per class. ``release`` subtracts exactly the entry ``hold``
added, so the counts return to zero when every request is released, whatever happened in
between (a restart of admission: ``holding``; of the scheduler: ``forget_all``).

The entry itself crosses the bus (``Admitted.held`` to the scheduler, ``Holding`` back
after admission restarts), which is how a restarted ledger equals the one that admitted.
Pure; no clock.
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from types import MappingProxyType

from schemas.wire import HeldRequest


class Ledger:
    def __init__(self) -> None:
        self._entries: dict[str, HeldRequest] = {}     # by request id, in admission order
        self._reserved = 0
        self._tenant_requests: Counter[str] = Counter()
        self._tenant_blocks: Counter[str] = Counter()
        self._tenant_seqs: Counter[str] = Counter()
        self._class_seqs: Counter[str] = Counter()

    # ------------------------------------------------------------------ changes
    def hold(self, entry: HeldRequest) -> None:
        """Count an admitted request; ``release`` subtracts this entry. An id already held
        is replaced: its old entry's counts are subtracted first."""
        self.release(entry.request_id)
        self._entries[entry.request_id] = entry
        self._reserved += entry.kv_blocks
        self._tenant_requests[entry.tenant] += 1
        self._tenant_blocks[entry.tenant] += entry.kv_blocks
        self._tenant_seqs[entry.tenant] += entry.n
        self._class_seqs[entry.service_class] += entry.n

    def release(self, request_id: str) -> HeldRequest | None:
        """Let a request go: its entry, its counts subtracted; None (and nothing changed)
        if it is not held, so a repeated release subtracts nothing."""
        entry = self._entries.pop(request_id, None)
        if entry is None:
            return None
        self._reserved -= entry.kv_blocks
        self._tenant_requests[entry.tenant] -= 1
        self._tenant_blocks[entry.tenant] -= entry.kv_blocks
        self._tenant_seqs[entry.tenant] -= entry.n
        self._class_seqs[entry.service_class] -= entry.n
        return entry

    def holding(self, entries: Iterable[HeldRequest]) -> list[HeldRequest]:
        """After a restart of admission: the scheduler's requests, each with the entry the
        ledger before the restart made for it, counted again as it was. A request already
        held keeps its own entry (it was decided again first, and its release subtracts
        that one). Returns the entries added."""
        added = []
        for entry in entries:
            if entry.request_id not in self._entries:
                self.hold(entry)
                added.append(entry)
        return added

    def forget_all(self) -> None:
        """The scheduler restarted and dropped everything it held."""
        self._entries.clear()
        self._reserved = 0
        self._tenant_requests.clear()
        self._tenant_blocks.clear()
        self._tenant_seqs.clear()
        self._class_seqs.clear()

    # ------------------------------------------------------------------ reading
    def __len__(self) -> int:
        """Outstanding requests: admitted and not yet released."""
        return len(self._entries)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._entries

    def entry(self, request_id: str) -> HeldRequest | None:
        return self._entries.get(request_id)

    @property
    def entries(self) -> Mapping[str, HeldRequest]:
        """Every entry by request id, in admission order (read-only view)."""
        return MappingProxyType(self._entries)

    @property
    def reserved_blocks(self) -> int:
        """The KV blocks reserved for every outstanding request."""
        return self._reserved

    def tenant_requests(self, tenant: str) -> int:
        """Outstanding requests of ``tenant``."""
        return self._tenant_requests[tenant]

    def tenant_blocks(self, tenant: str) -> int:
        """KV blocks reserved for ``tenant``'s outstanding requests."""
        return self._tenant_blocks[tenant]

    def tenant_seqs(self, tenant: str) -> int:
        """Sequences (each request's ``n``) of ``tenant``'s outstanding requests."""
        return self._tenant_seqs[tenant]

    @property
    def class_seqs(self) -> Mapping[str, int]:
        """Sequences of the outstanding requests by service class (read-only view)."""
        return MappingProxyType(self._class_seqs)

    def stats(self) -> dict[str, float]:
        """The ledger by tenant (``ledger.outstanding|kv_blocks|seqs.<tenant>``) and by
        class (``ledger.class_outstanding|class_kv_blocks.<class>``). A tenant or class
        with nothing held is left out, so an idle engine reports none and a count that
        went wrong (negative) shows."""
        out: dict[str, float] = {}
        for tenant in self._tenant_requests.keys() | self._tenant_blocks.keys() | \
                self._tenant_seqs.keys():
            counts = (self._tenant_requests[tenant], self._tenant_blocks[tenant],
                      self._tenant_seqs[tenant])
            if any(counts):
                for key, v in zip(("outstanding", "kv_blocks", "seqs"), counts, strict=True):
                    out[f"ledger.{key}.{tenant}"] = v
        by_class: Counter[str] = Counter()
        for entry in self._entries.values():
            by_class[f"ledger.class_outstanding.{entry.service_class}"] += 1
            by_class[f"ledger.class_kv_blocks.{entry.service_class}"] += entry.kv_blocks
        out.update(by_class)
        return out

