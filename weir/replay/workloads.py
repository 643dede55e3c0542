"""Synthetic multi-tenant traces for fairness experiments: a seeded random generator of
``TraceRequest`` lists that the simulator, ``weir replay`` (through ``traces.write_weir``)
and the tests share.

- ``backlogged_tenants``: Poisson arrivals, each request's tenant drawn by share, with each
  tenant's own prompt and output ranges: offered past capacity, every tenant keeps work
  waiting (VTC's setting).
- ``noisy_neighbour``: one tenant floods prefill-heavy requests (long prompts, short answers)
  far past capacity while another sends a steady trickle of short ones.
- ``agent_sessions``: multi-turn agent loops (the first seed's "system plus tools plus
  history plus tool result …"): each turn's prompt is the previous one plus a delta, so
  its leading prefix blocks (``hash_ids``) repeat; for prefix caching and routing.

Lengths are drawn uniformly from inclusive ranges. The same arguments give the same trace."""
from __future__ import annotations

import random
from typing import NamedTuple

import msgspec

from weir.replay.types import TraceRequest


class TenantLoad(NamedTuple):
    """One tenant's share of the arrivals and the (inclusive) ranges of its lengths."""

    share: float
    prompt: tuple[int, int]
    output: tuple[int, int]


def backlogged_tenants(n: int, rate: float, tenants: dict[str, TenantLoad],
                       seed: int = 0) -> list[TraceRequest]:
    """``n`` requests arriving as a Poisson process of ``rate`` per second, each from a tenant
    drawn by its share, with lengths drawn from that tenant's ranges."""
    if n < 0 or not rate > 0 or not tenants:
        raise ValueError(f"need n >= 0, rate > 0 and tenants (got {n}, {rate}, {tenants})")
    rng = random.Random(seed)
    names = sorted(tenants)
    shares = [tenants[u].share for u in names]
    out, t = [], 0.0
    for i in range(n):
        t += rng.expovariate(rate)
        u = rng.choices(names, shares)[0]
        load = tenants[u]
        out.append(TraceRequest(index=i, arrival_s=t, input_tokens=rng.randint(*load.prompt),
                                output_tokens=rng.randint(*load.output), tenant=u))
    return out


def noisy_neighbour(duration_s: float = 60.0, *, flood_rate: float = 6.0,
                    flood_prompt: tuple[int, int] = (1500, 1900),
                    flood_output: tuple[int, int] = (8, 16),
                    light_every_s: float = 1.0, light_prompt: tuple[int, int] = (32, 64),
                    light_output: tuple[int, int] = (16, 32), flood: str = "A",
                    light: str = "B", flood_class: str | None = None,
                    light_class: str | None = None, seed: int = 1,
                    only: str | None = None) -> list[TraceRequest]:
    """Tenant ``flood`` sends prefill-heavy requests as a Poisson process of ``flood_rate``
    per second; tenant ``light`` sends one short request every ``light_every_s`` (from
    ``light_every_s`` on), both for ``duration_s``. ``only`` keeps one tenant's requests,
    drawn exactly as in the full trace (the light tenant running alone, for comparison)."""
    rng = random.Random(seed)
    rows = []
    for tenant, cls, prompt, output in ((flood, flood_class, flood_prompt, flood_output),
                                        (light, light_class, light_prompt, light_output)):
        t = 0.0
        while True:
            t += rng.expovariate(flood_rate) if tenant == flood else light_every_s
            if t > duration_s:
                break
            rows.append((t, tenant, cls, rng.randint(*prompt), rng.randint(*output)))
    rows.sort(key=lambda row: (row[0], row[1]))
    rows = [row for row in rows if only is None or row[1] == only]
    return [TraceRequest(index=i, arrival_s=t, input_tokens=p, output_tokens=o, tenant=u,
                         service_class=c) for i, (t, u, c, p, o) in enumerate(rows)]


def agent_sessions(sessions: int, turns: int, *, tenants: tuple[str, ...] = ("default",),
                   system_blocks: int = 4, shared_system: bool = True,
                   turn_blocks: tuple[int, int] = (1, 2), output: tuple[int, int] = (4, 8),
                   block_tokens: int = 16, session_gap_s: float = 0.2,
                   think_s: float = 0.0, seed: int = 2) -> list[TraceRequest]:
    """``sessions`` agent loops of ``turns`` turns each. A session belongs to a tenant
    (round robin over ``tenants``) and starts ``session_gap_s`` after the previous one;
    its first prompt is a system prompt of ``system_blocks`` blocks (the tenant's own,
    shared by its sessions, with ``shared_system``; else the session's), and each later
    turn adds ``turn_blocks`` blocks of history and tool results. ``hash_ids`` name the
    blocks, so with ``Scaling(block_size=block_tokens)`` the prompt synthesizer makes turn
    k+1 start with exactly turn k's tokens. Turns are ``think_s`` apart (replay them
    closed-loop so a turn waits for the previous answer)."""
    if sessions < 0 or turns < 1 or not tenants or system_blocks < 0:
        raise ValueError("need sessions >= 0, turns >= 1, tenants and system_blocks >= 0")
    rng = random.Random(seed)
    out: list[TraceRequest] = []
    next_id = 1 << 20
    for s in range(sessions):
        tenant = tenants[s % len(tenants)]
        base = 1000 * (tenants.index(tenant) + 1) if shared_system else next_id
        if not shared_system:
            next_id += system_blocks
        ids = [base + b for b in range(system_blocks)]
        t = s * session_gap_s
        for k in range(turns):
            grow = rng.randint(*turn_blocks) if k else max(rng.randint(*turn_blocks), 1)
            ids += range(next_id, next_id + grow)
            next_id += grow
            out.append(TraceRequest(index=0, arrival_s=t, input_tokens=len(ids) * block_tokens,
                                    output_tokens=rng.randint(*output), hash_ids=tuple(ids),
                                    tenant=tenant, session_id=f"{tenant}-s{s}"))
            t += think_s
    out.sort(key=lambda r: (r.arrival_s, r.session_id or ""))
    return [msgspec.structs.replace(r, index=i) for i, r in enumerate(out)]
