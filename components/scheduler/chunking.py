"""Stall-free chunked prefill: the step's token budget, chosen so that the running streams
keep their time per output token.

While sequences are decoding, a step that also prefills a long chunk makes every stream
wait for it. A stream's TPOT SLO is the mean time per output token it is promised (as TPOT
is measured: from its first token on), with no single gap over ``GAP`` times it. So the
step's budget is the largest whose predicted time (the step-cost model, divided by how much
slower than predicted recent steps ran at p90) keeps, for every decoding stream with a TPOT
SLO:

- the gap: the step within ``GAP`` x its SLO (the slowdown is the margin for error);
- its mean: what it has spent since its first token, this step, and its next ``HORIZON``
  tokens at the pace of a decode step, within its SLO less ``headroom`` per token. A
  stream that has banked time (decoding faster than its SLO) lends it to a burst's
  prompts; one that has spent it gets steps that prefill little until its mean recovers.

With no decodes, or no TPOT SLO among them, the full budget is used. Pure: the caller
passes the cost model and the clock."""
from __future__ import annotations

from typing import NamedTuple

from components.costs.cost_model import (
    StepCostModel,
    StepShape,
    decode_shape,
    joined,
    prefill_shape,
)
from components.scheduler.core import SchedulerCore
from components.scheduler.sequence import Seq

MIN_CHUNK = 16            # prefill tokens a step may always take, so prompts still progress
GAP = 1.5                 # one gap may reach this many times a stream's TPOT SLO; its mean may not
HORIZON = 16              # tokens ahead, at the decode pace, over which a stream's mean is kept
_PROBE = 256              # tokens over which the marginal cost of prefill is measured


class StepBudget(NamedTuple):
    tokens: int
    reason: str           # "full" | "no_decodes" | "no_tpot_slo" | "cost_unknown" | "tpot_slo"
    #                       | "tpot_slo_mean" (the fit could not price the decodes)
    tightest_tpot_s: float | None = None
    predicted_s: float | None = None       # the step at this budget, as the model predicts


def step_budget(core: SchedulerCore, cost: StepCostModel, full: int,
                headroom: float = 0.2, now_ns: int | None = None) -> StepBudget:
    """``now_ns``: the clock the sequences' ``first_token_ns`` are on; without it a stream
    is taken to be exactly on its SLO so far (neither banked nor owed)."""
    decoding = [s for s in core.running if s.remaining == 1 and s.num_output > 0]
    if not decoding:
        return StepBudget(full, "no_decodes")
    slos = [s.tpot_slo_s for s in decoding if s.tpot_slo_s]
    if not slos:
        return StepBudget(full, "no_tpot_slo")
    tightest = min(slos)
    n, ctx = len(decoding), sum(s.num_tokens for s in decoding)
    # a deterministic row among the running makes the step run the batch-invariant plan
    det = any(s.deterministic for s in core.running)

    def predict(shape: StepShape) -> float:
        return cost.predict(shape, det)

    decodes = joined(decode_shape(n, ctx), StepShape(0, 0, 1, 0))   # and a prefilling row
    done = prefill_context(core)

    def with_chunk(tokens: int) -> StepShape:
        return joined(decode_shape(n, ctx), prefill_shape(tokens, done))

    base = predict(decodes)
    marginal = (predict(with_chunk(_PROBE)) - base) / _PROBE
    mean = cost.mean_per_token() if base <= 0 or marginal <= 0 else 0.0
    if mean <= 0 and (base <= 0 or marginal <= 0):
        return StepBudget(full, "cost_unknown", tightest)
    # plan against the model's recent p90 error too: steps that run slower than predicted
    # would otherwise put the streams' p99 over their SLO
    slowdown = cost.slowdown()
    pace = (base if base > 0 else mean * n) * slowdown      # a decode step's time
    limit = min(stream_room(s, s.tpot_slo_s, headroom, pace, now_ns)
                for s in decoding if s.tpot_slo_s) / slowdown
    if base <= 0:
        # the fit prices these decodes at nothing: decode steps (tokens == sequences) and a
        # few prefill chunks leave it free to extrapolate to a context it has not seen. It
        # is not trusted for this step at all: every token at the window's mean cost (an
        # upper bound of a token's marginal cost). Taking the full budget instead stalled
        # live streams for 1.6-2.8 s a step (2048 prefill tokens beside 20 decodes at a
        # 500 ms TPOT SLO: worst stream TPOT 594 ms, gap p90 1586 ms)
        tokens = min(full, n + max(int((limit - mean * n) / mean), MIN_CHUNK))
        return StepBudget(tokens, "tpot_slo_mean", tightest, mean * tokens)
    if marginal <= 0:                      # the fit cannot tell yet: bound it from above
        marginal = mean
    room = int((limit - base) / marginal)
    tokens = min(full, n + max(room, MIN_CHUNK))
    if tokens >= full:
        return StepBudget(full, "full", tightest, predict(with_chunk(full - n)))
    return StepBudget(tokens, "tpot_slo", tightest, predict(with_chunk(tokens - n)))


def stream_room(s: Seq, slo: float, headroom: float, pace: float,
                now_ns: int | None) -> float:
    """The longest next step (seconds) that keeps stream ``s`` within its TPOT SLO of
    ``slo`` seconds: one gap at most ``GAP`` x ``slo``, and its mean, from its first token
    through this step and its next ``HORIZON`` tokens at ``pace`` a token, within ``slo``
    less ``headroom``. Negative when it is already behind (the step should prefill
    little)."""
    target = slo * (1 - headroom)
    gaps = max(s.num_output - 1, 0)                 # gaps after its first token so far
    if now_ns is not None and s.first_token_ns:
        spent = max(now_ns - s.first_token_ns, 0) / 1e9
    else:
        spent = gaps * target
    left = s.params.max_tokens
    ahead = HORIZON if left is None else min(HORIZON, max(left - s.num_output - 1, 0))
    mean_room = target * (gaps + 1 + ahead) - spent - ahead * pace
    return min(GAP * slo, mean_room)


def prefill_context(core: SchedulerCore) -> int:
    """Where the step's prefill chunk starts: the computed context of the first running
    sequence still prefilling, else 0 (a new prompt; its cached prefix is not known
    before its lease). A chunk deep in a long prompt costs more per token: its attention
    reads everything before it."""
    for s in core.running:
        if s.remaining > 1:
            return s.num_computed
    return 0
