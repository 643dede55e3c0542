"""The replay harness's shared records: what a trace asks for, how it was scaled, and what
happened to each request (live or simulated). Plain data; every other module of
``weir.replay`` reads or writes these."""
from __future__ import annotations

import msgspec


class TraceRequest(msgspec.Struct, frozen=True, kw_only=True):
    """One request of a trace, as loaded (unscaled).

    Either ``prompt`` (text) or ``input_tokens`` (a length, with optional ``hash_ids``) says
    what to send. ``hash_ids`` name the trace's prefix blocks: two requests whose leading
    ids agree share that many blocks of prompt."""

    index: int                          # position in the trace (0-based, after sorting)
    arrival_s: float                    # seconds from the trace's start
    input_tokens: int | None = None
    output_tokens: int | None = None    # tokens the trace says were generated
    hash_ids: tuple[int, ...] = ()
    prompt: str | None = None
    tenant: str | None = None
    api_key: str | None = None
    service_class: str | None = None
    session_id: str | None = None
    deadline_ms: int | None = None      # time-to-first-token deadline, from arrival
    max_tokens: int | None = None       # the cap sent; defaults to output_tokens
    cancel_after_s: float | None = None  # the client cancels this long after sending
    n: int = 1
    source: str = ""                    # "file:line", for errors and reports


class Scaling(msgspec.Struct, frozen=True, kw_only=True):
    """How a trace is fitted to the machine: lengths × ``length``, inter-arrival gaps ×
    ``time`` (> 1 stretches), and the trace's prefix block of ``block_size`` tokens
    (before ``length`` scaling). Every report prints these."""

    length: float = 1.0
    time: float = 1.0
    block_size: int = 512
    seed: int = 0

    @property
    def scaled_block(self) -> int:
        return max(1, round(self.block_size * self.length))


class Slo(msgspec.Struct, frozen=True):
    """A service objective in milliseconds: time to first token and time per output token."""

    ttft_ms: float
    tpot_ms: float


# terminal states of a request, as reports count them
COMPLETED, REJECTED, FAILED, CANCELLED = "completed", "rejected", "failed", "cancelled"


class RequestRecord(msgspec.Struct, kw_only=True):
    """What happened to one request. Times are seconds from the run's start (arrival_s,
    sent_s) or durations in seconds; None where the request never got that far."""

    index: int
    request_id: str
    tenant: str = "default"
    service_class: str = "default"
    session_id: str | None = None
    arrival_s: float                    # when the (scaled) trace says it arrives
    sent_s: float                       # when it was actually sent (live) / = arrival (sim)
    decision: str = "accept"            # "accept" | "reject"
    reason: str = ""                    # the admission reason code, or the failure's
    queue_s: float | None = None        # arrival → first scheduled, as the engine reports
    ttft_s: float | None = None         # sent → first token
    prefill_s: float | None = None      # first scheduled → first token, as the engine reports
    ingress_s: float | None = None      # of queue_s, arrival → the engine's queues, less
                                        # admission's queue (tokenizer, lookup, hops)
    itl_s: list[float] = []             # gaps between consecutive output tokens (choice 0)
    e2e_s: float | None = None          # sent → terminal event
    prompt_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int = 0
    preemptions: int = 0
    terminal: str = COMPLETED           # COMPLETED | REJECTED | FAILED | CANCELLED
    finish_reason: str = ""             # "stop" | "length" | ... for completed requests
    deadline_ms: float | None = None    # this request's own TTFT deadline, if it had one
    trace_id: str = ""                  # the OpenTelemetry trace id (find it in Jaeger)
    n: int = 1

    @property
    def tpot_s(self) -> float | None:
        """Mean time per output token after the first; None with fewer than two tokens."""
        if self.ttft_s is None or self.e2e_s is None or self.output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)

    @property
    def token_times(self) -> list[float]:
        """When each output token (choice 0) arrived, in seconds from the run's start."""
        if self.ttft_s is None:
            return []
        t = self.sent_s + self.ttft_s
        times = [t]
        for gap in self.itl_s:
            t += gap
            times.append(t)
        return times


class TimelinePoint(msgspec.Struct, frozen=True, array_like=True):
    """Engine state at one moment of a run, for the timeline plot."""

    t_s: float
    running: int
    waiting: int                        # queued in the scheduler (and admission)
    kv_used_blocks: int
    kv_total_blocks: int


class RunResult(msgspec.Struct, kw_only=True):
    """One run (a target live, or a config simulated) over one trace."""

    label: str                          # the config file or target, as shown in tables
    mode: str                           # "live" | "simulated"
    records: list[RequestRecord]
    timeline: list[TimelinePoint] = []
    scaling: Scaling = Scaling()
    duration_s: float = 0.0             # first arrival → last terminal event
    meta: dict = {}                     # target, config, machine, profile, seed, ...
    valid: bool = True
    invalid_reasons: list[str] = []
    lag_p50_ms: float | None = None     # live: how late requests went out vs the schedule
    lag_p99_ms: float | None = None
