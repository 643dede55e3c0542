"""Replicas found, not listed (components/router/discovery.py), with a resolver the test
controls: a name found is added, one missing ``misses`` polls in a row is retired, a
flapping one stays, one at a new address is retired and added again once let go, a failed
lookup changes nothing, and discovery touches only the replicas it added. The production
resolver against a scripted ``socket``. The service wired to a scripted resolver and
scripted replicas: test_service.py's harness, below; whole engines under load:
tests/e2e/test_router_discovery.py."""
from __future__ import annotations

import socket

import anyio
import pytest
import zmq
import zmq.asyncio

from bus.codec import encode
from bus.identity import Keyring
from components.router.discovery import Discovery, DnsResolver, plan, replica_name
from components.router.membership import Membership
from components.router.service import RouterService
from schemas.client import ChangeReplicas, ReplicaAddress, Submit
from schemas.config import ReplicaSpec, RouterConfig, Topology, WeirConfig
from tests.components.router.test_service import REPLIES, replica


def spec(name: str, host: str = "") -> ReplicaSpec:
    return ReplicaSpec(name, f"tcp://{host or name}:7450", f"tcp://{host or name}:7470")


class FakeResolver:
    """Answers whatever the test last set: a dict of specs, or None (a failed lookup)."""

    def __init__(self, *names: str) -> None:
        self.found: dict[str, ReplicaSpec] | None = {n: spec(n) for n in names}
        self.calls = 0

    def set(self, *names: str) -> None:
        self.found = {n: spec(n) for n in names}

    def __call__(self):
        self.calls += 1
        return None if self.found is None else dict(self.found)


def poll(d: Discovery, m: Membership, resolver: FakeResolver) -> tuple[list[str], list[str]]:
    """One poll made so, as the service does: (names added, names retired)."""
    d.observe(resolver())
    p = plan(d.wanted, m)
    for s in p.add:
        m.discover(s)
    for name in p.retire:
        m.retire(name)
    return [s.name for s in p.add], p.retire


def let_go_idle(m: Membership) -> list[str]:
    gone = m.idle_retired()
    for r in gone:
        m.let_go(r)
    return [r.name for r in gone]


def test_found_is_added_and_gone_is_retired_after_n_misses():
    d, m, res = Discovery(misses=3), Membership(), FakeResolver("a", "b")
    assert poll(d, m, res) == (["a", "b"], [])
    assert [r.name for r in m] == ["a", "b"] and all(r.discovered for r in m)
    assert not any(r.healthy for r in m)           # routed to only once they answer
    assert poll(d, m, res) == ([], [])
    res.set("a")
    assert poll(d, m, res) == ([], [])             # one miss
    assert poll(d, m, res) == ([], [])             # two
    assert poll(d, m, res) == ([], ["b"])          # three: retired
    assert m["b"].retiring and not m["a"].retiring
    assert poll(d, m, res) == ([], [])             # retired once only
    assert let_go_idle(m) == ["b"] and [r.name for r in m] == ["a"]
    assert d.polls == 6 and d.failed == 0


def test_a_retiring_replica_keeps_its_open_requests_until_they_end():
    d, m, res = Discovery(misses=1), Membership(), FakeResolver("a")
    poll(d, m, res)
    m["a"].open.add("req-1")
    res.set()
    assert poll(d, m, res) == ([], ["a"])
    assert let_go_idle(m) == []                    # its request runs on
    m["a"].open.discard("req-1")
    assert let_go_idle(m) == ["a"]


def test_flapping_under_n_misses_changes_nothing():
    d, m, res = Discovery(misses=3), Membership(), FakeResolver("a")
    poll(d, m, res)
    for _ in range(5):                              # gone two polls, back, again
        res.set()
        assert poll(d, m, res) == ([], [])
        assert poll(d, m, res) == ([], [])
        res.set("a")
        assert poll(d, m, res) == ([], [])
    assert [r.name for r in m] == ["a"] and not m["a"].retiring
    assert d.missed == {}


def test_back_after_being_retired_is_added_again_once_let_go():
    d, m, res = Discovery(misses=2), Membership(), FakeResolver("a")
    poll(d, m, res)
    m["a"].open.add("req-1")
    res.set()
    poll(d, m, res)
    assert poll(d, m, res) == ([], ["a"])
    res.set("a")
    d.observe(res())
    p = plan(d.wanted, m)
    assert (p.add, p.retire, p.waiting) == ([], [], ["a"])     # still retiring: wait
    m["a"].open.clear()
    assert let_go_idle(m) == ["a"]
    assert poll(d, m, res) == (["a"], [])
    assert not m["a"].retiring


def test_a_new_address_retires_the_old_and_adds_the_new_once_it_is_gone():
    d, m, res = Discovery(misses=3), Membership(), FakeResolver("a")
    poll(d, m, res)
    res.found = {"a": spec("a", "10.0.0.9")}          # the pod came back elsewhere
    assert poll(d, m, res) == ([], ["a"])             # at once, not after 3 misses
    assert m["a"].spec == spec("a") and m["a"].retiring
    assert let_go_idle(m) == ["a"]
    assert poll(d, m, res) == (["a"], [])
    assert m["a"].spec.endpoint == "tcp://10.0.0.9:7450" and not m["a"].retiring


def test_a_failed_lookup_is_no_evidence():
    d, m, res = Discovery(misses=2), Membership(), FakeResolver("a")
    poll(d, m, res)
    res.found = None
    for _ in range(10):
        assert poll(d, m, res) == ([], [])
    assert [r.name for r in m] == ["a"] and not m["a"].retiring
    assert (d.polls, d.failed) == (1, 10)
    res.set()                                      # an empty answer is: no replica now
    poll(d, m, res)
    assert poll(d, m, res) == ([], ["a"])


def test_discovery_leaves_listed_and_operator_replicas_alone():
    m = Membership((ReplicaSpec("static", "tcp://static:7450"),))
    d, res = Discovery(misses=1), FakeResolver("static", "pod-0")
    assert poll(d, m, res) == (["pod-0"], [])
    assert not m["static"].discovered
    assert plan(d.wanted, m).foreign == ["static"]
    res.set()
    assert poll(d, m, res) == ([], ["pod-0"])      # only its own
    assert not m["static"].retiring
    # an operator may not remove a discovered replica (it would be found again)
    m2 = Membership()
    poll(Discovery(misses=1), m2, FakeResolver("pod-0"))
    answer, _ = m2.change(ChangeReplicas("q", remove=("pod-0",)), Keyring(()).identify(None, "x"))
    assert answer.error is not None and "found by discovery" in answer.error
    assert not m2["pod-0"].retiring
    # but may add one of its own beside them
    answer, added = m2.change(ChangeReplicas("q", add=(ReplicaAddress("mine", "ipc:///m"),)),
                              Keyring(()).identify(None, "x"))
    assert answer.error is None and not added[0].discovered


@pytest.mark.parametrize("host, address, name", [
    ("weir-replica-0.weir-replica.weir.svc.cluster.local", "10.1.2.3", "weir-replica-0"),
    ("10-1-2-3.weir-replica.weir.svc.cluster.local", "10.1.2.3", "10-1-2-3"),
    ("", "10.1.2.3", "10-1-2-3"),
    ("10.1.2.3", "10.1.2.3", "10-1-2-3"),
])
def test_a_replica_is_named_by_its_ptr_records_first_label(host, address, name):
    assert replica_name(host, address) == name


def test_the_dns_resolver(monkeypatch):
    """A and PTR records through the stdlib, scripted: names cached per address; no such
    name is no replica; any other failure is no evidence."""
    answers: dict = {"svc": ["10.0.0.1", "10.0.0.2", "10.0.0.1"]}
    ptr = {"10.0.0.1": "weir-replica-0.svc.ns", "10.0.0.2": "weir-replica-1.svc.ns"}
    reverse: list[str] = []

    def getaddrinfo(name, port, family, kind):
        assert family == socket.AF_INET
        got = answers[name]
        if isinstance(got, Exception):
            raise got
        return [(family, kind, 6, "", (a, 0)) for a in got]

    def gethostbyaddr(address):
        reverse.append(address)
        if address not in ptr:
            raise socket.herror(1, "unknown host")
        return ptr[address], [], [address]

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    monkeypatch.setattr(socket, "gethostbyaddr", gethostbyaddr)
    res = DnsResolver("svc", 7450, 7470)
    assert res() == {"weir-replica-0": ReplicaSpec("weir-replica-0", "tcp://10.0.0.1:7450",
                                                   "tcp://10.0.0.1:7470"),
                     "weir-replica-1": ReplicaSpec("weir-replica-1", "tcp://10.0.0.2:7450",
                                                   "tcp://10.0.0.2:7470")}
    assert res() and reverse == ["10.0.0.1", "10.0.0.2"]      # PTR asked once per address
    answers["svc"] = ["10.0.0.2", "10.0.0.7"]                 # no PTR for the new one
    assert set(res()) == {"weir-replica-1", "10-0-0-7"}
    assert set(res.names) == {"10.0.0.2", "10.0.0.7"}
    answers["svc"] = socket.gaierror(socket.EAI_NONAME, "Name or service not known")
    assert res() == {}
    answers["svc"] = socket.gaierror(socket.EAI_AGAIN, "Temporary failure")
    assert res() is None
    assert DnsResolver("svc", 7450)() is None                 # (still failing)
    answers["svc"] = ["10.0.0.1"]
    assert DnsResolver("svc", 7450)() == {
        "weir-replica-0": ReplicaSpec("weir-replica-0", "tcp://10.0.0.1:7450", "")}


def test_router_config_discovery():
    from schemas.config import ConfigError

    assert RouterConfig().discovery == "static"
    RouterConfig(discovery="dns", discovery_name="weir-replica.weir.svc.cluster.local")
    for bad in ({"discovery": "dns"},
                {"discovery": "dns", "discovery_name": "x", "discovery_port": 0},
                {"discovery": "dns", "discovery_name": "x", "discovery_misses": 0},
                {"discovery": "dns", "discovery_name": "x", "discovery_interval_s": 0}):
        with pytest.raises(ConfigError):
            RouterConfig(**bad)


@pytest.mark.anyio
async def test_the_router_service_follows_its_resolver(tmp_path):
    """No listed replica: the router routes to what the resolver finds once it answers,
    refuses an operator's remove of it, and retires and lets go one no longer found."""
    ctx = zmq.asyncio.Context()
    heard: dict[str, list[str]] = {"a": [], "b": []}
    address = {n: f"ipc://{tmp_path}/{n}.sock" for n in heard}
    resolver = FakeResolver()
    resolver.found = {}

    def found(*names: str) -> None:
        resolver.found = {n: ReplicaSpec(n, address[n]) for n in names}

    svc = RouterService(WeirConfig(
        Topology(run_dir=str(tmp_path), client_endpoint=f"ipc://{tmp_path}/client.sock"),
        router=RouterConfig(discovery="dns", discovery_name="test", discovery_interval_s=0.02,
                            discovery_misses=2)))
    svc.resolver = resolver
    await svc.setup()
    client = ctx.socket(zmq.DEALER)
    client.linger = 0
    client.connect(svc.topology.client_endpoint)

    async def replies(n: int) -> list:
        with anyio.fail_after(10):
            return [REPLIES.decode(await client.recv()).body for _ in range(n)]

    async def until(cond) -> None:
        with anyio.fail_after(10):
            while not cond():
                await anyio.sleep(0.01)

    try:
        async with anyio.create_task_group() as tg:
            for name in heard:
                tg.start_soon(replica, ctx, address[name], False, heard[name])
            tg.start_soon(svc.run)
            await until(lambda: resolver.calls >= 3)
            assert len(svc.members) == 0
            await client.send(encode(Submit("x0", prompt="hello")))
            assert (await replies(1))[0].reason == "overloaded"      # no replica yet
            found("a")
            await until(lambda: "a" in svc.members.replicas and svc.members["a"].healthy)
            await client.send(encode(Submit("x1", prompt="hello")))
            assert [type(m).__name__ for m in await replies(3)] == [
                "Accepted", "TextDelta", "Finished"]
            assert svc.members["a"].counts["routed"] == 1
            await client.send(encode(ChangeReplicas("c1", remove=("a",))))
            assert "found by discovery" in (await replies(1))[0].error
            found("b")                      # a gone, b found
            await until(lambda: "a" not in svc.links and "b" in svc.members.replicas
                        and svc.members["b"].healthy)
            await client.send(encode(Submit("x2", prompt="hello")))
            assert [type(m).__name__ for m in await replies(3)] == [
                "Accepted", "TextDelta", "Finished"]
            assert svc.members["b"].counts["routed"] == 1
            stats = svc.stats()
            assert stats["requests.discovered"] == 2 and stats["requests.undiscovered"] == 1
            assert stats["replica.b.discovered"] == 1 and stats["discovery.wanted"] == 1
            tg.cancel_scope.cancel()
    finally:
        svc.close()
        client.close(0)
        ctx.term()
