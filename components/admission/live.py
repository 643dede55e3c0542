"""Admission's view of the live engine, from the scheduler's load report: the pool's free KV
and the decode horizon. Pure and clock-free, like the policy that owns it.

**KV room.** The ledger reserves each admitted request's blocks (uncached prompt + n ×
expected output) against the pool less the watermark. The kv_manager's free count (its
evictable blocks included: cached prefixes no sequence references are reclaimed on demand)
says what the pool really has. The ledger's reservations are promises, not blocks: a request
mid-prefill or not yet grown holds fewer than it reserved, so its reservation less what
the pool has given out is still owed. Counted over the whole ledger, what is owed is
``max(reserved − used, 0)`` (``used``: the pool's blocks not free), and the room the pool
has is

    free − watermark − max(reserved − used, 0)

which is exactly the ledger's own room (``pool − watermark − reserved``) while the pool
holds no more than was reserved, and less when it holds more: prefix blocks a hit pinned
(a reservation counts the uncached prompt only), sequences grown past their expected
output, leases the ledger never made (a restart, fcfs work). Admission reserves against
the smaller of the two rooms; when the live one is the smaller and a request does not fit
it, the reason is ``kv_pressure``.

**The cross-check.** Reservations exceed live usage while requests are young and usage
exceeds reservations with prefix sharing, so neither number is wrong when they differ under
load; ``unreserved_blocks`` (``used − reserved``, at least 0) is a stat, what makes the live
room bind. The two must agree exactly only when the engine is idle: a load report of a
scheduler holding no request (nothing running or waiting), after another such report with
nothing admitted between them, must find the ledger empty (else a ``Released`` was lost and
the ledger leaks) and the pool with no block in use (else a lease was never freed). Either
is a ``mismatch`` (``check``).

**The decode horizon.** Every decoding sequence adds its share to each step, and every
stream waits for each step: past some batch size (the *latency knee*) the step outgrows the
tightest running TPOT target. Before admitting a request of ``n`` choices, admission
predicts the decode step with ``n`` more sequences from the cost model's decode rates
(``SchedulerLoad.decode_rates``), scaled by how far the model was off on the last seconds'
decode steps (``decode_error``), and holds the request (queue, or reject
``tpot_slo_at_risk``) when that passes the tightest TPOT target among the classes it has
running and the request's own, less ``admission.tpot_headroom``. The batch counted is the
ledger's (every admitted sequence, running or about to; the scheduler's report when it
counts more), at most ``scheduler.max_num_seqs``, each new sequence reading the request's
prompt plus half its expected output. It waits for ``MIN_DECODE_STEPS`` decode steps in
the report's window, so that the rates are scaled by what was measured. An idle engine
(nothing admitted, nothing running) checks nothing: no stream is slowed, and the first
request's steps are what correct rates learned on a machine that was slowed for a while.
Admission also admits no decoding sequence while a running class's measured TPOT
(``SchedulerLoad.tpot_s``) is over its target and the pool is nearly full (free blocks less
the watermark under ``LATE_KV_SHARE`` of it): the first seed's worked decision, "if free KV
were 5 percent and stream latency already broken, reject or degrade before doing expensive
prefill". Both, not either: late streams with room in the pool are the scheduler's to fix
(slack chunking caps the prefill beside them), and a single long step (a prompt's chunk
under fixed chunking) would otherwise refuse all work. With no rates yet, or no TPOT target
in play, nothing is checked.
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from schemas.config import WeirConfig
from schemas.wire import DecodeRates, SchedulerLoad

_EPS = 1e-9            # a step at the limit, give or take float rounding, is within it
# decode steps the report's window must hold before the horizon is checked: fewer, and its
# measured ÷ predicted is not known (the scheduler's window takes the model as is then), so
# the rates are the cost model's alone, which right after a start are its startup fit
# scaled by its first steps (slow ones: the first steps of a fresh process measured 20x)
MIN_DECODE_STEPS = 4
# the worked decision's "free KV at 5 percent": streams already late refuse new decoding
# work only while the pool's free blocks (less the watermark) are under this share of it
LATE_KV_SHARE = 0.10


def decode_step_s(rates: DecodeRates, seqs: int, context: int, error: float = 1.0) -> float:
    """A decode step of ``seqs`` sequences reading ``context`` KV positions in all."""
    return max(rates.base_s + rates.per_seq_s * seqs + rates.per_context_s * context,
               0.0) * error


def knee(rates: DecodeRates, limit_s: float, context_per_seq: float,
         error: float = 1.0) -> int | None:
    """The most decoding sequences, each reading ``context_per_seq`` positions, whose step
    stays within ``limit_s``; None when a sequence adds nothing to the step (no knee)."""
    per = rates.per_seq_s + rates.per_context_s * context_per_seq
    if per <= 0:
        return None
    return max(math.floor((limit_s / error - rates.base_s) / per + _EPS), 0)


@dataclass(frozen=True)
class Horizon:
    """The decode step a request would run in, against the TPOT it must keep."""

    step_s: float          # predicted with the request's sequences (decode_error included)
    limit_s: float         # the tightest TPOT target in play, less tpot_headroom
    tightest: str          # whose target that is
    late: str = ""         # a running class whose measured TPOT is over its target already
    seqs: int = 0          # the decoding sequences the step was predicted for
    context: int = 0       # ... and the KV positions they read
    error: float = 1.0     # the measured ÷ predicted it was scaled by

    @property
    def at_risk(self) -> bool:
        return bool(self.late) or self.step_s > self.limit_s * (1 + _EPS)

    def why(self, load: SchedulerLoad) -> str:
        if self.late:
            return (f"class {self.late!r} streams are late: measured TPOT "
                    f"{load.tpot_s[self.late] * 1e3:.0f} ms over its SLO")
        return (f"the decode step with it would be {self.step_s * 1e3:.0f} ms ({self.seqs} "
                f"sequences reading {self.context} positions, x{self.error:.2f} as measured), "
                f"past {self.limit_s * 1e3:.0f} ms (class {self.tightest!r} TPOT SLO less "
                f"headroom)")


class LiveEngine:
    """What the last load report says of the pool and the decode batch (``load``, set by
    ``AdmissionPolicy.on_load``), and the idle cross-check's state."""

    def __init__(self, config: WeirConfig) -> None:
        self.num_blocks = config.kv.num_blocks
        self.watermark = config.kv.watermark_blocks
        self.max_num_seqs = config.scheduler.max_num_seqs
        self.retune(config)
        self.load = SchedulerLoad(0, 0, 0, 0.0, 0.0)
        self.admitted_since = 0           # admitted since the last report
        self._idle_before = False         # the last report was of an idle scheduler
        self._verdict = ""                # the cross-check's, at the last report
        self.mismatches = 0

    def retune(self, config: WeirConfig) -> None:
        """The decode horizon's switch, headroom and class targets from ``config`` (at
        start, and on a live config change; the reported load is kept)."""
        adm = config.admission
        self.enabled = adm.decode_horizon
        self.headroom = adm.tpot_headroom
        self.targets = {name: c.tpot_slo_ms / 1e3
                        for name, c in adm.service_classes().items() if c.tpot_slo_ms}

    # ------------------------------------------------------------------ KV
    @property
    def used_blocks(self) -> int | None:
        free = self.load.kv_free_blocks
        return None if free < 0 else max(self.num_blocks - free, 0)

    def kv_room(self, reserved: int) -> int | None:
        """Blocks a new reservation may take by the live pool (module docstring); None
        until the kv_manager's counts have been reported."""
        used = self.used_blocks
        if used is None:
            return None
        return self.load.kv_free_blocks - self.watermark - max(reserved - used, 0)

    def unreserved_blocks(self, reserved: int) -> int:
        used = self.used_blocks
        return 0 if used is None else max(used - reserved, 0)

    def check(self, load: SchedulerLoad, outstanding: int) -> str:
        """Take a new report (``outstanding``: requests in the ledger); the cross-check's
        verdict when a mismatch begins (module docstring): ``ledger_leak`` or ``kv_leak``,
        once per idle spell, else ""."""
        self.load = load
        idle = load.running == 0 and load.waiting == 0
        settled = idle and self._idle_before and self.admitted_since == 0
        self._idle_before, self.admitted_since = idle, 0
        verdict = ""
        if settled:
            used = self.used_blocks
            verdict = "ledger_leak" if outstanding else \
                "kv_leak" if used is not None and used > 0 else ""
        onset = verdict if verdict != self._verdict else ""
        self._verdict = verdict
        self.mismatches += bool(onset)
        return onset

    # ------------------------------------------------------------------ decode horizon
    def horizon(self, cls: str, n: int, context: int,
                admitted: Mapping[str, int]) -> Horizon | None:
        """The decode step with ``n`` more sequences of class ``cls``, each reading
        ``context`` positions, beside the ledger's ``admitted`` sequences by class; None
        when nothing is checked (off, no decode rates yet, no TPOT target in play)."""
        load, rates = self.load, self.load.decode_rates
        if not self.enabled or rates is None:
            return None
        if 0 <= load.decode_steps < MIN_DECODE_STEPS:
            return None
        if load.running == 0 and not any(admitted.values()):
            # an idle engine: no stream for it to slow, and waiting does not make its own
            # step shorter; its steps are also what corrects a model that learned its rates
            # on a machine slowed for a while (refusing here would keep them stale for good)
            return None
        running = [c for c, k in admitted.items() if k > 0 and c in self.targets]
        in_play = running + ([cls] if cls in self.targets else [])
        if not in_play:
            return None
        tightest = min(in_play, key=self.targets.__getitem__)
        tight = 0 <= load.kv_free_blocks - self.watermark < LATE_KV_SHARE * self.num_blocks
        late = next((c for c in running if load.tpot_s.get(c, 0.0) > self.targets[c]),
                    "") if tight else ""
        seqs = min(max(sum(admitted.values()), load.running) + n, self.max_num_seqs)
        ctx = load.running_context + max(seqs - load.running, 0) * context
        return Horizon(decode_step_s(rates, seqs, ctx, load.decode_error),
                       self.targets[tightest] * (1 - self.headroom), tightest, late, seqs,
                       ctx, load.decode_error)

    def knee(self, admitted: Mapping[str, int]) -> int | None:
        """The batch the tightest running TPOT target allows (all configured targets' while
        none runs), at the running batch's mean context per sequence: a stat."""
        rates = self.load.decode_rates
        running = [c for c, k in admitted.items() if k > 0 and c in self.targets]
        targets = [self.targets[c] for c in running] or list(self.targets.values())
        if rates is None or not targets:
            return None
        load = self.load
        mean_context = load.running_context / load.running if load.running else 0.0
        return knee(rates, min(targets) * (1 - self.headroom), mean_context, load.decode_error)
