"""The replicas a router routes to, and what it knows of each: no sockets, no clock of its
own (the service passes ``now``), so every rule here is tested by building it directly.

- **Health.** A replica is healthy from its first heartbeat answer; one silent for the
  heartbeat timeout, or one whose answer names another instance (it
  restarted), is lost (``lose``): its open requests are the service's to fail, its prefix
  index and load report are dropped.
- **Load.** A load report (a ``StatusReport`` answering the router's own query, whose id
  says when it was asked) replaces the last one unless it answers an older query; the
  prompts prefilled since that query stay counted against it (routing.py).
- **Membership.** An operator's ``ChangeReplicas`` is made whole or not at all
  (``change``): an added replica is routed to at once; a removed one is *retiring*, takes
  no new request and is let go once nothing is open on it (``idle_retired``, ``let_go``).
  Discovery (discovery.py) adds and retires its own replicas the same way (``discover``,
  ``retire``); an operator cannot remove one of those (it would be found again): the
  replica goes when its name stops resolving.
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import msgspec

from bus.identity import Identity, Refusal
from components.router.index import ReplicaIndex
from schemas.client import (
    ChangeReplicas,
    ComponentStatus,
    ReplicasChanged,
    ServerHeartbeat,
    StatusReport,
)
from schemas.config import ConfigError, ReplicaSpec
from schemas.limits import MAX_ID_CHARS

MAX_CHANGES = 64                     # replicas added and removed in one ChangeReplicas
LOAD_QUERY = "router-load"           # a load query's id: this, ':', when it was sent (ns)


def load_query_id(now_ns: int) -> str:
    """The id of a load query sent at ``now_ns`` (monotonic nanoseconds)."""
    return f"{LOAD_QUERY}:{now_ns}"


def asked_at(query_id: str) -> float:
    """When the router sent the load query ``query_id`` (monotonic seconds; 0 if the id
    is not one of its own)."""
    try:
        return int(query_id.rpartition(":")[2]) / 1e9
    except ValueError:
        return 0.0


@dataclass
class Replica:
    """One replica's state at the router (its sockets and loops are the service's)."""

    spec: ReplicaSpec
    index: ReplicaIndex = field(default_factory=ReplicaIndex)
    instance: int | None = None
    last_heard: float = 0.0
    healthy: bool = False
    draining: bool = False
    report: StatusReport | None = None
    report_asked: float = 0.0           # when the query that ``report`` answers was sent
    # prompts prefilled since ``report_asked``: (tokens, accepted at, prefilled at)
    prefilled: list[tuple[int, float, float]] = field(default_factory=list)
    open: set[str] = field(default_factory=set)
    counts: Counter[str] = field(default_factory=Counter)
    retiring: bool = False              # removed: no new requests; let go once none is open
    discovered: bool = False            # added by discovery, which alone retires it
    found_at: float = 0.0               # when discovery found it (the service's clock)
    up_at: float = 0.0                  # when it first answered

    @property
    def name(self) -> str:
        return self.spec.name

    def stat(self, component: str, key: str, default: float = 0.0) -> float:
        if self.report is None:
            return default
        for c in self.report.components:
            if c.name == component:
                return c.stats.get(key, default)
        return default

    def tenant_blocks(self, tenant: str) -> int:
        if self.report is None:
            return 0
        return sum(c.tenants[tenant].kv_blocks for c in self.report.components
                   if tenant in c.tenants)


class Membership:
    """name -> ``Replica``, in the order they were added."""

    def __init__(self, specs: tuple[ReplicaSpec, ...] = ()) -> None:
        self.replicas: dict[str, Replica] = {}
        for spec in specs:
            self.add(spec)

    def __iter__(self) -> Iterator[Replica]:
        return iter(self.replicas.values())

    def __len__(self) -> int:
        return len(self.replicas)

    def get(self, name: str) -> Replica | None:
        return self.replicas.get(name)

    def __getitem__(self, name: str) -> Replica:
        return self.replicas[name]

    def add(self, spec: ReplicaSpec) -> Replica:
        r = self.replicas[spec.name] = Replica(spec)
        return r

    def discover(self, spec: ReplicaSpec) -> Replica:
        """Discovery found ``spec``: routed to once it answers a heartbeat."""
        r = self.add(spec)
        r.discovered = True
        return r

    def retire(self, name: str) -> None:
        """No new request for ``name``; let go once none is open on it."""
        self.replicas[name].retiring = True

    # ------------------------------------------------------------------ health
    @staticmethod
    def heard(r: Replica, body: Any, now: float) -> bool:
        """``r`` sent ``body`` at ``now``: a load report is kept unless it answers an older
        query than the one kept. True for a heartbeat answer from another instance than
        before (``r`` restarted): the caller loses it (``lose``), then calls ``up``."""
        r.last_heard = now
        match body:
            case ServerHeartbeat(instance=instance):
                return r.instance is not None and instance != r.instance
            case StatusReport(query_id=qid) as report if qid.startswith(LOAD_QUERY):
                asked = asked_at(qid)
                if asked >= r.report_asked:       # not an older answer come late
                    r.report, r.report_asked = report, asked
                    r.prefilled = [p for p in r.prefilled if p[2] > asked]
        return False

    @staticmethod
    def up(r: Replica, answer: ServerHeartbeat) -> bool:
        """``r`` answered a heartbeat: it is healthy, of that instance, draining or not.
        True when it was not healthy before."""
        r.instance, r.draining = answer.instance, answer.draining
        came_up = not r.healthy
        r.healthy = True
        return came_up

    @staticmethod
    def lose(r: Replica) -> list[str]:
        """``r`` is out (silent, or restarted): its cache view and load report are
        dropped, and the requests open on it (returned, to be failed) are no longer."""
        r.healthy = False
        r.counts["lost"] += 1
        r.index.clear()
        r.report = None
        lost = list(r.open)
        r.open.clear()
        r.prefilled.clear()
        return lost

    def excuse(self, stalled_s: float, now: float) -> None:
        """The router did not run for ``stalled_s``: each replica is heard that much later
        than it was (never later than now)."""
        for r in self.replicas.values():
            r.last_heard = min(r.last_heard + stalled_s, now)

    # ------------------------------------------------------------------ membership
    def change(self, c: ChangeReplicas, who: Identity | Refusal) -> tuple[ReplicasChanged,
                                                                          list[Replica]]:
        """An operator's change of replicas: all of it, or (with the reason) none of it.
        ``who`` is the change's key, identified. Returns the answer and the replicas
        added (the caller connects them)."""
        error = "changing replicas needs an operator's key" if not (
            isinstance(who, Identity) and who.sees_all) else self.check(c)
        added: list[Replica] = []
        if error is None:
            added = [self.add(ReplicaSpec(a.name, a.endpoint, a.kv_events, a.pool))
                     for a in c.add]
            for name in c.remove:
                self.replicas[name].retiring = True
        return ReplicasChanged(
            c.query_id, error, tuple(n for n, r in self.replicas.items() if not r.retiring),
            tuple(n for n, r in self.replicas.items() if r.retiring),
            {n: r.spec.pool for n, r in self.replicas.items()}), added

    def pool(self, name: str) -> list[Replica]:
        """The replicas of pool ``name`` (retiring ones included: what runs there runs the
        pool's config)."""
        return [r for r in self.replicas.values() if r.spec.pool == name]

    def pools(self) -> dict[str, int]:
        """Each pool, with how many replicas it has."""
        out: dict[str, int] = {}
        for r in self.replicas.values():
            out[r.spec.pool] = out.get(r.spec.pool, 0) + 1
        return out

    def check(self, c: ChangeReplicas) -> str | None:
        """Why ``c`` cannot be made (None: it can)."""
        names = [a.name for a in c.add]
        if len(c.add) + len(c.remove) > MAX_CHANGES:
            return f"at most {MAX_CHANGES} replicas in one change"
        if len(set(names)) != len(names):
            return "add names one replica twice"
        for a in c.add:
            if a.name in self.replicas:
                return f"replica {a.name[:64]!r} is already routed to" + (
                    " (retiring: add it again once it is gone)"
                    if self.replicas[a.name].retiring else "")
            try:
                ReplicaSpec(a.name, a.endpoint, a.kv_events, a.pool)    # its own checks
            except ConfigError as exc:
                return str(exc)[:300]
            if len(a.name) > MAX_ID_CHARS:
                return f"a replica's name must be at most {MAX_ID_CHARS} characters"
        for name in c.remove:
            r = self.replicas.get(name)
            if r is None or r.retiring or name in names:
                return f"no replica {name[:64]!r} to remove"
            if r.discovered:
                return (f"replica {name[:64]!r} was found by discovery: it goes when its name "
                        f"stops resolving (scale or delete its pod)")
        return None

    def idle_retired(self) -> list[Replica]:
        """Retiring replicas with nothing open on them: to be let go."""
        return [r for r in self.replicas.values() if r.retiring and not r.open]

    def let_go(self, r: Replica) -> None:
        del self.replicas[r.spec.name]

    # ------------------------------------------------------------------ status
    def components(self, own: Iterable[ComponentStatus], router: str) -> list[ComponentStatus]:
        """What the router's status shows: its own cluster's components (``own``; the
        router, named ``router``, is ``no_replica`` rather than ready while no replica is
        healthy), then each healthy replica's components as ``replica/component``."""
        up = any(r.healthy for r in self.replicas.values())
        comps: list[ComponentStatus] = []
        for c in own:
            if c.name == router and c.state == "ready" and not up:
                c = msgspec.structs.replace(c, state="no_replica")
            comps.append(c)
        for r in self.replicas.values():
            if r.healthy and r.report is not None:
                comps += [msgspec.structs.replace(c, name=f"{r.spec.name}/{c.name}")
                          for c in r.report.components]
        return comps

    def stats(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for name, r in self.replicas.items():
            out.update({f"replica.{name}.healthy": int(r.healthy),
                        f"replica.{name}.retiring": int(r.retiring),
                        f"replica.{name}.open": len(r.open),
                        f"replica.{name}.index_blocks": len(r.index.blocks),
                        f"replica.{name}.index_gaps": r.index.gaps,
                        f"replica.{name}.index_stored": r.index.stored,
                        f"replica.{name}.index_snapshots": r.index.snapshots,
                        **{f"replica.{name}.{k}": v for k, v in r.counts.items()}})
            if r.discovered:
                out[f"replica.{name}.discovered"] = 1
        for pool, n in self.pools().items():
            out[f"pool.{pool}.replicas"] = n
        return out

    def info(self) -> dict[str, str]:
        """Each replica's pool (``replica.NAME.pool``), for the router's status."""
        return {f"replica.{name}.pool": r.spec.pool for name, r in self.replicas.items()}
