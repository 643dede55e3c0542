"""The signals that lead latency, per replica and fleet-wide, for an autoscaler: pure, read
from what each replica reports to the router (its ``StatusReport``, ``Replica.stat``) and
what the router itself knows (the prompts it sent since that report, the refusals it saw).
The gateway in front of the router exports them at ``/metrics`` (``weir:*``, see
components/gateway/metrics.py); deploy/k8s/overlays/autoscaling scales the replicas on them
(docs/deploy.md says which signal scales what).

Per replica that is healthy and has reported its load:

- ``queue_s``: the wait a new prompt would see there before its own prefill starts: the
  replica's admission's ``predicted_queue_s`` (its whole backlog at its measured prefill
  rate, learned bias included), corrected by the prompts the router sent since the report
  (``RoutingCore.queue_s``, the number routing ranks replicas by);
- ``headroom/<class>``: for each class with a TTFT objective, ``1 - queue_s / target``: 1
  idle, 0 at the objective, below 0 past it (not clamped: how far past is the signal);
- ``kv_used``: the fraction of the replica's KV blocks in use (used / total);
- ``prefill_backlog_tokens``, ``decode_backlog_tokens``: the scheduler's backlog
  (``components.scheduler.load.backlog_tokens``);
- ``load_rejections``: refusals for load (``routing.REROUTE``) it answered the router,
  rerouted or not; a count that only grows while the router runs.

Fleet-wide (``fleet/...``), over the replicas that take new work (healthy, reporting, not
draining, not retiring): ``replicas`` (how many), the mean ``queue_s`` and the
``headroom/<class>`` it gives, ``kv_used`` (used over total blocks of them all), the summed
backlogs, and ``load_rejections``: the requests the router refused for load to their
clients (no replica could take one, or a replica's refusal was relayed).

Keys are ``signal/<replica>/<field>`` and ``fleet/<field>``: a replica's name holds no '/'
(schemas.config.ReplicaSpec), so it is read back without ambiguity (``parse``).
"""
from __future__ import annotations

from collections.abc import Callable, Iterable

from components.router.membership import Replica
from schemas.config import ServiceClass

REPLICA = "signal"
FLEET = "fleet"


def targets_s(classes: Iterable[ServiceClass]) -> dict[str, float]:
    """Each class with a TTFT objective: its target in seconds."""
    return {c.name: c.ttft_slo_ms / 1e3 for c in classes if c.ttft_slo_ms}


def headroom(queue_s: float, target_s: float) -> float:
    return 1.0 - queue_s / target_s


def replica_signals(r: Replica, queue_s: float, targets: dict[str, float]) -> dict[str, float]:
    """``r``'s signals (its predicted queue ``queue_s`` computed by the caller), keyed by
    field; empty while it is not healthy or has not reported its load."""
    if not r.healthy or r.report is None:
        return {}
    total = r.stat("kv_manager", "total_blocks", 0.0)
    free = r.stat("kv_manager", "free_blocks", total)
    out = {"queue_s": queue_s,
           "kv_used": (total - free) / total if total else 0.0,
           "kv_total_blocks": total,
           "prefill_backlog_tokens": r.stat("scheduler", "backlog.prefill_tokens"),
           "decode_backlog_tokens": r.stat("scheduler", "backlog.decode_tokens"),
           "load_rejections": r.counts["load_rejected"]}
    out.update({f"headroom/{cls}": headroom(queue_s, t) for cls, t in targets.items()})
    return out


def signal_stats(replicas: Iterable[Replica], queue_s: Callable[[Replica], float],
                 targets: dict[str, float], fleet_load_rejections: float) -> dict[str, float]:
    """Every replica's signals and the fleet's, as ``stats`` keys."""
    out: dict[str, float] = {f"{FLEET}/load_rejections": fleet_load_rejections}
    taking: list[dict[str, float]] = []
    for r in replicas:
        sig = replica_signals(r, queue_s(r) if r.healthy and r.report is not None else 0.0,
                              targets)
        out.update({f"{REPLICA}/{r.spec.name}/{k}": v for k, v in sig.items()})
        if sig and not (r.draining or r.retiring):
            taking.append(sig)
    out[f"{FLEET}/replicas"] = len(taking)
    if taking:
        mean_queue = sum(s["queue_s"] for s in taking) / len(taking)
        total = sum(s["kv_total_blocks"] for s in taking)
        out[f"{FLEET}/queue_s"] = mean_queue
        out[f"{FLEET}/kv_used"] = (sum(s["kv_used"] * s["kv_total_blocks"] for s in taking)
                                   / total if total else 0.0)
        for field in ("prefill_backlog_tokens", "decode_backlog_tokens"):
            out[f"{FLEET}/{field}"] = sum(s[field] for s in taking)
        out.update({f"{FLEET}/headroom/{cls}": headroom(mean_queue, t)
                    for cls, t in targets.items()})
    return out


def parse(key: str) -> tuple[str | None, str, str] | None:
    """A signal key read back: (replica, or None for the fleet; field; class, or '' but for
    headroom). None: not a signal key."""
    head, _, rest = key.partition("/")
    if head == REPLICA:
        replica, _, rest = rest.partition("/")
    elif head == FLEET:
        replica = None
    else:
        return None
    field, _, cls = rest.partition("/")
    return replica, field, cls
