"""Synthetic multi-tenant traces for fairness experiments: a seeded random generator of
``TraceRequest`` lists that the simulator, ``weir replay`` (through ``traces.write_weir``)
and the tests share.

- ``backlogged_tenants``: Poisson arrivals, each request's tenant drawn by share, with each
  tenant's own prompt and output ranges: offered past capacity, every tenant keeps work
  waiting (VTC's setting).
- ``noisy_neighbour``: one tenant floods prefill-heavy requests (long prompts, short answers)
  far past capacity while another sends a steady trickle of short ones.

Lengths are drawn uniformly from inclusive ranges. The same arguments give the same trace."""
from __future__ import annotations

import random
from typing import NamedTuple

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
