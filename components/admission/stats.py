"""Admission's counters for ``weir status`` and the gateway's metrics, read from the
policy's parts: its decisions, the TTFT model, the queue, the ledger and the live engine.
Reads only."""
from __future__ import annotations

from collections import Counter

from components.admission.ledger import Ledger
from components.admission.live import LiveEngine
from components.admission.ttft import TtftModel


def decision_stats(decisions: Counter[tuple[str, str]], rejections: Counter[tuple[str, str]],
                   queue_depth: Counter[str]) -> dict[str, float]:
    """``decisions.<kind>.<class>``, ``rejections.<reason>.<class>`` and
    ``queue_depth.<class>``."""
    out: dict[str, float] = {f"decisions.{kind}.{cls}": v
                             for (kind, cls), v in decisions.items()}
    out.update({f"rejections.{reason}.{cls}": v for (reason, cls), v in rejections.items()})
    out.update({f"queue_depth.{cls}": v for cls, v in queue_depth.items()})
    return out


def ttft_stats(ttft: TtftModel) -> dict[str, float]:
    """A router's load signal: the wait a new prompt would see before its own prefill (the
    whole backlog, learned bias included), and the measured prefill rate; none until the
    scheduler has measured its rates."""
    ahead = ttft.predicted_s(0)
    if ahead is None:
        return {}
    return {"predicted_queue_s": max(ahead + ttft.bias_s, 0.0),
            "ttft_bias_s": round(ttft.bias_s, 4),
            "prefill_tokens_per_s": ttft.load.prefill_tokens_per_s}


def live_stats(live: LiveEngine, ledger: Ledger, horizon: bool) -> dict[str, float]:
    """The live engine as admission sees it: the pool's free and evictable blocks, the
    room a reservation has by it, the blocks it holds beyond the ledger's reservations
    and the cross-check's mismatches (``live.py``); the decode batch's measured step,
    each class's live TPOT, the cost model's decode rates and the knee (the batch the
    tightest running TPOT target allows; -1 without rates; only where ``horizon``: the
    deadline policy checks it)."""
    load, reserved = live.load, ledger.reserved_blocks
    out: dict[str, float] = {"kv.crosscheck_mismatches": live.mismatches}
    if (room := live.kv_room(reserved)) is not None:          # the pool has been reported
        out["kv.live_free_blocks"] = load.kv_free_blocks
        out["kv.live_evictable_blocks"] = load.kv_evictable_blocks
        out["kv.live_room_blocks"] = room
        out["kv.unreserved_blocks"] = live.unreserved_blocks(reserved)
    if horizon and live.enabled:
        knee = live.knee(ledger.class_seqs)
        out["horizon.knee_seqs"] = knee if knee is not None else -1
    if (rates := load.decode_rates) is not None:
        out["horizon.decode_base_ms"] = round(rates.base_s * 1e3, 3)
        out["horizon.decode_per_seq_ms"] = round(rates.per_seq_s * 1e3, 4)
        out["horizon.decode_per_position_us"] = round(rates.per_context_s * 1e6, 4)
    out["horizon.decode_measured_ms"] = round(load.decode_measured_s * 1e3, 2)
    out["horizon.decode_error"] = round(load.decode_error, 3)
    out.update({f"horizon.tpot_ms.{c}": round(v * 1e3, 2) for c, v in load.tpot_s.items()})
    return out
