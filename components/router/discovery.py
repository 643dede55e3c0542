"""Replicas found, not listed: the router follows the replicas a name resolves to (the
replicas' headless Service in Kubernetes), pure, with the lookup behind a ``Resolver``.

- **What a poll sees.** A resolver returns the replicas it finds now, name -> ``ReplicaSpec``
  (where to reach each), or None when the lookup itself failed (a timeout, a DNS server
  that did not answer): such a poll is no evidence and changes nothing.
- **Found and gone** (``Discovery.observe``). A name is *wanted* from the first poll that
  finds it, at the address that poll gave; it stays wanted until ``misses`` polls in a row
  do not find it. A name that comes back before that is as if it had never gone
  (flapping); one found at another address is wanted at the new one at once.
- **Made so** (``plan``). Discovery owns the replicas it added, and only those: a wanted
  name not routed to is added, unless a replica of that name is still retiring (it is
  added once that one is let go) or one of that name was listed in the config or added by
  an operator (theirs: discovery leaves it alone); a discovered replica no longer wanted,
  or wanted at another address, is retired (the operator's remove path: no new request,
  let go once none is open on it). An added replica gets requests once it answers
  heartbeats, as any other (``Membership.up``): resolving is not being ready.

``DnsResolver`` is the production lookup (stdlib only): the Service name's A records, one
per pod, each named by its PTR record (docs/design/router.md says why DNS and not the
EndpointSlice API). Replica pools (a canary by pool) are one name per pool
(``router.discovery_pools``; ``discovery_name`` is the pool "default"'s): ``Pools`` asks
each and labels what it finds with that pool; one failed lookup makes the whole poll no
evidence (a pool's replicas must not look gone because its name did not answer once).
"""
from __future__ import annotations

import socket
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

from components.router.membership import Replica
from schemas.config import ConfigError, ReplicaSpec
from schemas.limits import MAX_ID_CHARS

# name -> where to reach it; None: the lookup failed (no evidence either way)
Found = Mapping[str, ReplicaSpec] | None
Resolver = Callable[[], Found]


@dataclass
class Discovery:
    """The names a resolver has found, and which of them are still wanted."""

    misses: int                                   # polls in a row without a name: gone
    wanted: dict[str, ReplicaSpec] = field(default_factory=dict)
    missed: dict[str, int] = field(default_factory=dict)
    polls: int = 0
    failed: int = 0

    def observe(self, found: Found) -> None:
        """One poll's answer."""
        if found is None:
            self.failed += 1
            return
        self.polls += 1
        for name, spec in found.items():
            self.wanted[name] = spec              # new, back, or at a new address
            self.missed.pop(name, None)
        for name in [n for n in self.wanted if n not in found]:
            self.missed[name] = self.missed.get(name, 0) + 1
            if self.missed[name] >= self.misses:
                del self.wanted[name], self.missed[name]


@dataclass(frozen=True)
class Plan:
    add: list[ReplicaSpec]
    retire: list[str]
    waiting: list[str]            # wanted, but a replica of that name is still retiring
    foreign: list[str]            # wanted, but listed or added by an operator: theirs


def plan(wanted: Mapping[str, ReplicaSpec], replicas: Iterable[Replica]) -> Plan:
    """What makes the routed replicas what discovery wants, touching only its own."""
    add: list[ReplicaSpec] = []
    retire: list[str] = []
    waiting: list[str] = []
    foreign: list[str] = []
    have = {r.spec.name: r for r in replicas}
    for name, spec in wanted.items():
        r = have.get(name)
        if r is None:
            add.append(spec)
        elif not r.discovered:
            foreign.append(name)
        elif r.retiring:
            waiting.append(name)
    for name, r in have.items():
        if r.discovered and not r.retiring and wanted.get(name) != r.spec:
            retire.append(name)
    return Plan(add, retire, waiting, foreign)


def replica_name(host: str, address: str) -> str:
    """A replica's name from the PTR name of its address: the first label (a
    StatefulSet's pod, ``weir-replica-0``), else the address with '-' for '.' and ':'."""
    label = host.split(".", 1)[0] if host and host != address else ""
    name = label or address.replace(".", "-").replace(":", "-")
    return name[:MAX_ID_CHARS]


@dataclass
class DnsResolver:
    """The replicas behind ``name``: its IPv4 addresses (a headless Service has one per
    pod; with ``publishNotReadyAddresses``, ready or not), each named by its PTR record
    (cached per address) and reached on ``port`` (KV events on ``kv_events_port``, 0:
    none). A lookup that fails for any reason but "no such name" is None: no evidence."""

    name: str
    port: int
    kv_events_port: int = 0
    pool: str = "default"                                      # what it finds is labelled
    names: dict[str, str] = field(default_factory=dict)       # address -> replica name

    def __call__(self) -> Found:
        try:
            infos = socket.getaddrinfo(self.name, None, socket.AF_INET, socket.SOCK_STREAM)
        except socket.gaierror as exc:
            if exc.errno in (socket.EAI_NONAME, getattr(socket, "EAI_NODATA", -5)):
                return {}                     # the name has no address: no replica now
            return None
        except OSError:
            return None
        found: dict[str, ReplicaSpec] = {}
        addresses = sorted({str(info[4][0]) for info in infos})
        for address in addresses:
            name = self.names.get(address)
            if name is None:
                try:
                    host = socket.gethostbyaddr(address)[0]
                except OSError:
                    host = ""                 # no PTR record: named by its address
                name = self.names[address] = replica_name(host, address)
            try:
                found[name] = ReplicaSpec(
                    name, f"tcp://{address}:{self.port}",
                    f"tcp://{address}:{self.kv_events_port}" if self.kv_events_port else "",
                    self.pool)
            except ConfigError:
                continue
        # forget the names of addresses gone (an address may come back as another pod's)
        self.names = {a: n for a, n in self.names.items() if a in addresses}
        return found


@dataclass
class Pools:
    """Several resolvers, one per pool: what they all find (a name found under two pools
    is the first's); None when any lookup failed."""

    resolvers: list[Resolver]

    def __call__(self) -> Found:
        found: dict[str, ReplicaSpec] = {}
        for resolve in self.resolvers:
            got = resolve()
            if got is None:
                return None
            for name, spec in got.items():
                found.setdefault(name, spec)
        return found


def resolver_for(name: str, pools: Mapping[str, str], port: int,
                 kv_events_port: int) -> Resolver:
    """The production lookup for ``router.discovery = "dns"``: ``name`` (the pool
    "default"; "" for none) and each of ``pools`` (pool -> name)."""
    by_pool = ({"default": name} if name else {}) | dict(pools)
    resolvers: list[Resolver] = [DnsResolver(n, port, kv_events_port, pool)
                                 for pool, n in by_pool.items()]
    return resolvers[0] if len(resolvers) == 1 else Pools(resolvers)
