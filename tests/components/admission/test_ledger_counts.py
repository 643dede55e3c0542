"""The ledger alone, exact: each count after each hold and release, a repeated release,
an entry replaced, ``holding`` after a restart of admission, ``forget_all`` after one of
the scheduler, and the stats it reports (nothing for what holds nothing)."""
from __future__ import annotations

import pytest

from components.admission.ledger import Ledger
from schemas.wire import HeldRequest


def counts(led: Ledger, tenant: str) -> tuple[int, int, int]:
    return led.tenant_requests(tenant), led.tenant_blocks(tenant), led.tenant_seqs(tenant)


def two() -> Ledger:
    """a: r1 (interactive, n 2, 6 blocks) and r2 (batch, n 1, 4); b: r3 (batch, n 3, 5)."""
    led = Ledger()
    led.hold(HeldRequest("r1", "a", "interactive", 2, 6, 0.25))
    led.hold(HeldRequest("r2", "a", "batch", 1, 4))
    led.hold(HeldRequest("r3", "b", "batch", 3, 5))
    return led


def test_hold_counts_each_entry_by_tenant_and_class():
    led = two()
    assert len(led) == 3 and "r2" in led and "r9" not in led
    assert led.reserved_blocks == 15
    assert counts(led, "a") == (2, 10, 3) and counts(led, "b") == (1, 5, 3)
    assert counts(led, "c") == (0, 0, 0)
    assert dict(led.class_seqs) == {"interactive": 2, "batch": 4}
    assert led.class_seqs["bulk"] == 0                   # a class with none reads 0
    assert list(led.entries) == ["r1", "r2", "r3"]       # admission order
    assert led.entry("r1") == HeldRequest("r1", "a", "interactive", 2, 6, 0.25)
    assert led.entry("r9") is None


def test_release_subtracts_exactly_its_entry_once():
    led = two()
    assert led.release("r1") == HeldRequest("r1", "a", "interactive", 2, 6, 0.25)
    assert (len(led), led.reserved_blocks) == (2, 9)
    assert counts(led, "a") == (1, 4, 1) and dict(led.class_seqs) == {"interactive": 0,
                                                                         "batch": 4}
    assert led.release("r1") is None                     # a repeat subtracts nothing
    assert led.release("never") is None
    assert (len(led), led.reserved_blocks, counts(led, "a")) == (2, 9, (1, 4, 1))
    led.release("r2")
    led.release("r3")
    assert (len(led), led.reserved_blocks) == (0, 0)
    assert counts(led, "a") == counts(led, "b") == (0, 0, 0)
    assert not any(led.class_seqs.values()) and led.stats() == {}


def test_an_id_held_again_replaces_its_entry():
    led = two()
    led.hold(HeldRequest("r2", "b", "interactive", 2, 1))
    assert (len(led), led.reserved_blocks) == (3, 12)
    assert counts(led, "a") == (1, 6, 2) and counts(led, "b") == (2, 6, 5)
    assert dict(led.class_seqs) == {"interactive": 4, "batch": 3}
    led.release("r2")
    assert counts(led, "b") == (1, 5, 3) and led.reserved_blocks == 11


def test_holding_adds_the_entries_not_held_and_keeps_those_held():
    """After a restart of admission: r2 was decided again (1 block) before the scheduler's
    Holding came with its old entry (4 blocks); it keeps the new one."""
    led = Ledger()
    led.hold(HeldRequest("r2", "a", "batch", 1, 1))
    old = list(two().entries.values())
    added = led.holding(old + [old[0]])                  # a repeat in the list adds once
    assert [e.request_id for e in added] == ["r1", "r3"]
    assert led.entry("r2").kv_blocks == 1 and led.reserved_blocks == 6 + 1 + 5
    assert counts(led, "a") == (2, 7, 3) and counts(led, "b") == (1, 5, 3)
    assert led.holding(old) == []                        # all held: nothing changes
    for rid in ("r1", "r2", "r3"):
        led.release(rid)
    assert (len(led), led.reserved_blocks, led.stats()) == (0, 0, {})


def test_forget_all_empties_every_count():
    led = two()
    led.forget_all()
    assert (len(led), led.reserved_blocks, dict(led.entries)) == (0, 0, {})
    assert counts(led, "a") == counts(led, "b") == (0, 0, 0)
    assert dict(led.class_seqs) == {} and led.stats() == {}
    assert led.release("r1") is None                     # its Released comes later: nothing
    assert led.reserved_blocks == 0


def test_stats_by_tenant_and_class_leave_out_what_holds_nothing():
    led = two()
    led.release("r3")
    assert led.stats() == {
        "ledger.outstanding.a": 2, "ledger.kv_blocks.a": 10, "ledger.seqs.a": 3,
        "ledger.class_outstanding.interactive": 1, "ledger.class_kv_blocks.interactive": 6,
        "ledger.class_outstanding.batch": 1, "ledger.class_kv_blocks.batch": 4}


def test_a_fcfs_entry_counts_requests_and_sequences_without_blocks():
    led = Ledger()
    led.hold(HeldRequest("x", "a", "", 4, 0))
    assert (len(led), led.reserved_blocks, counts(led, "a")) == (1, 0, (1, 0, 4))
    assert led.stats() == {"ledger.outstanding.a": 1, "ledger.kv_blocks.a": 0,
                           "ledger.seqs.a": 4, "ledger.class_outstanding.": 1,
                           "ledger.class_kv_blocks.": 0}


def test_the_views_cannot_change_the_ledger():
    led = two()
    with pytest.raises(TypeError):
        led.entries["r9"] = HeldRequest("r9", "a", "", 1, 0)        # type: ignore[index]
    with pytest.raises(TypeError):
        led.class_seqs["batch"] = 0                                 # type: ignore[index]
    assert led.class_seqs["batch"] == 4 and len(led) == 3
