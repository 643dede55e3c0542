"""Who may change a router's replicas, and which changes are refused whole (the router's
own ``_change`` and ``_check_change`` over a real Keyring; no sockets are made, since every
change here is refused or removes nothing). Adding and retiring live: tests/e2e/test_router.py."""
import hashlib
from collections import Counter

import pytest

from components.router.service import MAX_CHANGES, RouterService
from bus.identity import Keyring
from schemas.client import ChangeReplicas, ReplicaAddress
from schemas.config import ApiKey


def router(keys=()) -> RouterService:
    r = RouterService.__new__(RouterService)          # its state for these two methods
    r.keys = Keyring(tuple(keys), service_key="service-secret")
    r.replicas, r.counts = {}, Counter()
    return r


def key(secret: str, tenant: str, role: str = "tenant") -> ApiKey:
    return ApiKey(hashlib.sha256(secret.encode()).hexdigest(), tenant, role)


def change(api_key=None, **kw) -> ChangeReplicas:
    return ChangeReplicas("q1", api_key=api_key, **kw)


@pytest.mark.parametrize("api_key, allowed", [
    (None, False), ("wrong", False), ("tenant-secret", False),
    ("operator-secret", True), ("service-secret", True)])
def test_only_an_operator_changes_replicas(api_key, allowed):
    r = router([key("tenant-secret", "acme"), key("operator-secret", "ops", "operator")])
    answer = r._change(change(api_key, remove=("r9",)))
    assert answer.query_id == "q1" and answer.replicas == () and answer.retiring == ()
    # past the key, the change itself is checked (r9 does not exist)
    assert answer.error == ("no replica 'r9' to remove" if allowed
                            else "changing replicas needs an operator's key")
    assert r.counts["replica_changes"] == 0


def test_without_keys_anyone_may():
    assert router()._change(change(remove=("r9",))).error == "no replica 'r9' to remove"


@pytest.mark.parametrize("kw, words", [
    ({"add": (ReplicaAddress("a", "ipc:///a"), ReplicaAddress("a", "ipc:///b"))}, "twice"),
    ({"add": (ReplicaAddress("", "ipc:///a"),)}, "a name is required"),
    ({"add": (ReplicaAddress("a/b", "ipc:///a"),)}, "without '/'"),
    ({"add": (ReplicaAddress("a", "http://a"),)}, "tcp:// or ipc://"),
    ({"add": (ReplicaAddress("a" * 300, "ipc:///a"),)}, "at most 256"),
    ({"add": tuple(ReplicaAddress(f"r{i}", "ipc:///a") for i in range(MAX_CHANGES + 1))},
     f"at most {MAX_CHANGES}"),
    ({"remove": ("nope",)}, "no replica 'nope'"),
])
def test_a_bad_change_is_refused_whole(kw, words):
    answer = router()._change(change(**kw))
    assert answer.error is not None and words in answer.error, answer.error
