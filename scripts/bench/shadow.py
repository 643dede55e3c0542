"""What a shadow candidate costs admission: the decision's latency, p50 and p99, with and
without a candidate deciding beside it (``components/admission/rollout.py``).

    scripts/run bench/shadow [--requests 20000] [--outstanding 64]

One admission policy (deadline, two classes, four tenants), its ledger held at
``--outstanding`` requests (each decision admits one and the oldest is released), a load
report with rates; each decision timed alone, then the same stream with a shadow
candidate (fcfs: every decision disagrees where the deadline policy queues or refuses).
Both runs interleave in blocks of 500 so a slower patch of a shared machine falls on
both. Prints the machine and the two rows.
"""
from __future__ import annotations

import argparse
import time
from collections import deque

from components.admission.policy import AdmissionPolicy
from kernels.machine import summary_line
from schemas.config import load_config
from schemas.config_change import candidate
from schemas.wire import SamplingParams, SchedulerLoad
from tests import messages as msgs

TENANTS = [{"name": f"t{i}"} for i in range(4)]
CLASSES = [{"name": "interactive", "ttft_slo_ms": 2000, "tpot_slo_ms": 300},
           {"name": "batch", "priority": 10, "max_queue_ms": 30000, "may_degrade": True}]
SHADOW = '[admission]\npolicy = "fcfs"\n[rollout]\nmode = "shadow"\n'


def _policy() -> AdmissionPolicy:
    cfg = load_config(None, topology={"run_dir": "/x"}, kv={"num_blocks": 4096},
                      engine={"max_model_len": 4096},
                      admission={"tenants": TENANTS, "classes": CLASSES})
    p = AdmissionPolicy(cfg)
    p.on_load(SchedulerLoad(running=8, waiting=2, queued_prefill_tokens=512,
                            prefill_tokens_per_s=20_000.0, decode_step_s=0.02,
                            kv_free_blocks=3000), 0.0)
    return p


def _request(i: int):
    return msgs.tokenized(f"r{i}", f"t{i % 4}", list(range(64 + (i * 37) % 900)), [],
                          SamplingParams(max_tokens=32 + i % 200), 0, (), None, 0,
                          service_class="batch" if i % 3 == 0 else None)


def _run(p: AdmissionPolicy, shadow: bool, start: int, n: int, held: deque,
         outstanding: int, out: list[float]) -> None:
    trial = p.trial if shadow else None
    for i in range(start, start + n):
        req = _request(i)
        now = i * 0.01
        t0 = time.perf_counter_ns()
        s = trial.shadow(req, 0, now) if trial is not None else None
        d = p.decide(req, 0, now)
        if trial is not None and s is not None:
            trial.compare(s, d)
        out.append((time.perf_counter_ns() - t0) / 1e3)
        if d.kind in ("accept", "degrade"):
            held.append(req.request_id)
        while len(held) > outstanding:
            p.released([held.popleft()], now)
        for _ in p.release(now):
            pass
        p.expire(now)


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(int(q * len(xs)), len(xs) - 1)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--requests", type=int, default=20000)
    ap.add_argument("--outstanding", type=int, default=64)
    args = ap.parse_args()
    plain, shadowed = _policy(), _policy()
    shadowed.try_candidate(candidate(shadowed.config, SHADOW), 1, "00" * 32)
    times: dict[bool, list[float]] = {False: [], True: []}
    held = {False: deque(), True: deque()}
    block = 500
    for start in range(0, args.requests, block):
        for shadow, p in ((False, plain), (True, shadowed)):
            _run(p, shadow, start, block, held[shadow], args.outstanding, times[shadow])
    print(summary_line())
    print(f"{args.requests} decisions each, {args.outstanding} outstanding; microseconds")
    print(f"{'':<16}{'p50':>8}{'p99':>8}{'mean':>8}")
    for shadow in (False, True):
        xs = times[shadow]
        print(f"{'with shadow' if shadow else 'without':<16}{_pct(xs, 0.5):>8.1f}"
              f"{_pct(xs, 0.99):>8.1f}{sum(xs) / len(xs):>8.1f}")
    c = shadowed.trial.counts if shadowed.trial else {}
    print(f"shadow disagreed on {c.get('shadow.disagreements', 0)} of "
          f"{c.get('shadow.decisions', 0)} decisions")


if __name__ == "__main__":
    main()
