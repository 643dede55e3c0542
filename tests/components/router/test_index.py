"""The router's prefix index: scoped matching, tiers, gaps and snapshots (pure)."""
from components.router.index import PrefixMatch, ReplicaIndex
from schemas.wire import KvEvents


def ev(seq, *events, instance=7, snapshot=False):
    return KvEvents(seq, instance, list(events), snapshot)


def test_snapshot_then_in_order_events():
    ix = ReplicaIndex()
    assert ix.apply(ev(4, ("stored", 1, "acme", "gpu", None), snapshot=True))
    assert ix.synced and ix.seq == 4
    assert ix.apply(ev(5, ("stored", 2, "acme", "gpu", 1), ("stored", 3, "acme", "cpu", 2)))
    assert ix.match([1, 2, 3, 4], "", 0, "acme") == PrefixMatch(2, 1)


def test_the_first_miss_ends_the_prefix():
    ix = ReplicaIndex()
    ix.apply(ev(1, ("stored", 1, "acme", "gpu", None), ("stored", 3, "acme", "gpu", 2),
                snapshot=True))
    assert ix.match([1, 2, 3], "", 0, "acme") == PrefixMatch(1, 0)
    assert ix.match([9, 1], "", 0, "acme").blocks == 0


def test_scope_is_checked_per_block():
    ix = ReplicaIndex()
    ix.apply(ev(1, ("stored", 10, "public:lib", "gpu", None), ("stored", 11, "acme", "gpu", 10),
                snapshot=True))
    assert ix.match([10, 11], "public:lib", 1, "acme") == PrefixMatch(2, 0)
    # another tenant shares the public block, never acme's own
    assert ix.match([10, 11], "public:lib", 1, "globex") == PrefixMatch(1, 0)
    # without the public scope, block 0 does not count as the tenant's
    assert ix.match([10, 11], "", 0, "acme").blocks == 0


def test_removed_only_from_its_tier():
    ix = ReplicaIndex()
    ix.apply(ev(1, ("stored", 1, "t", "gpu", None), snapshot=True))
    # a demotion: removed from gpu, stored on cpu
    assert ix.apply(ev(2, ("removed", 1, "t", "gpu", None), ("stored", 1, "t", "cpu", None)))
    assert ix.match([1], "", 0, "t") == PrefixMatch(0, 1)
    # a stray removal for the other tier leaves it
    assert ix.apply(ev(3, ("removed", 1, "t", "gpu", None)))
    assert ix.match([1], "", 0, "t") == PrefixMatch(0, 1)
    assert ix.apply(ev(4, ("removed", 1, "t", "cpu", None)))
    assert ix.blocks == {}


def test_a_gap_asks_for_a_resync_and_a_snapshot_replaces_the_view():
    ix = ReplicaIndex()
    ix.apply(ev(1, ("stored", 1, "t", "gpu", None), snapshot=True))
    assert not ix.apply(ev(3, ("stored", 2, "t", "gpu", 1)))      # seq 2 was lost
    assert ix.gaps == 1 and not ix.synced
    assert 2 in ix.blocks                      # applied anyway: stale beats empty
    assert not ix.apply(ev(4, ("stored", 3, "t", "gpu", 2)))      # still unsynced
    assert ix.apply(ev(9, ("stored", 5, "t", "gpu", None), snapshot=True))
    assert ix.synced and set(ix.blocks) == {5}
    assert ix.apply(ev(10, ("stored", 6, "t", "gpu", 5)))


def test_a_new_instance_is_a_gap():
    ix = ReplicaIndex()
    ix.apply(ev(1, ("stored", 1, "t", "gpu", None), snapshot=True))
    assert not ix.apply(ev(2, ("stored", 2, "t", "gpu", None), instance=8))
    ix.clear()
    assert ix.blocks == {} and not ix.synced
