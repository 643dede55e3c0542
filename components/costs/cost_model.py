"""The step-cost model: predicts a step's time from its shape, learned from measured steps.

time ≈ c0 + c1·tokens + c2·pairs + c3·seqs + c4·context (``FEATURES``, the order of the
simulator's cost profiles). ``pairs`` (query rows × the keys each sees) is attention's cost:
quadratic in a fresh prompt's length, and a chunk at a long context reads all of it, so a
long-context prefill costs far more per token than one at zero context. ``context`` is the
KV positions read per row (a decode's cost grows with it).

Fitted by least squares over a sliding window of recent steps. Until it has seen enough
distinct steps it predicts from its prior, scaled by how the steps it saw compare with it,
or without a prior from the average time per token. The prior is a fit of the steps the
executor measured at startup (``ExecutorReady.step_costs``): with it the model predicts
from the first request on, and a live window that cannot tell two features apart (decode
steps alone: pairs == context, tokens == seqs) keeps the prior's split of them instead of
an arbitrary one.

The kernel plan is an input: a step with a deterministic row (``StepPlan.deterministic``)
runs the batch-invariant plan, slower by a factor (``deterministic_factor``): the median
of the deterministic steps' measured time over the fast plan's prediction for the same
shape, over the last ``DET_WINDOW`` of them, or, until ``DET_MIN`` were seen, the prior
(``scheduler.deterministic_cost_factor``, or what the executor measured). Deterministic
steps teach only the factor; the fit stays the fast plan's. Pure and synchronous.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Sequence
from typing import NamedTuple

import numpy as np

from schemas.wire import StepPlan

FEATURES = ("const", "tokens", "pairs", "seqs", "context")
# how much the prior weighs in a live fit, in steps: each coefficient's departure from the
# prior costs as much as this many steps mispredicted by it (see ``_refit``). Against the
# first 8 steps it steadies a fit of five features; against a full window of 256 it moves
# a well-measured prediction by under 1%
PRIOR_STEPS = 1.0
# how far the first steps may scale the prior, either way, before the model fits them
PRIOR_SCALE_MAX = 3.0
DET_WINDOW = 64           # deterministic steps the factor is the median of
DET_MIN = 8               # ... before which the prior factor is used


class StepShape(NamedTuple):
    """What a step's time depends on: tokens computed, KV positions read (the sum over rows
    of each row's context), sequences, and attention pairs (query rows × keys they see)."""

    tokens: int
    context: int
    seqs: int
    pairs: int

    def row(self) -> tuple[float, float, float, float, float]:
        """The features, in ``FEATURES`` order."""
        return (1.0, float(self.tokens), float(self.pairs), float(self.seqs),
                float(self.context))


def row_pairs(num_tokens: int, done: int) -> int:
    """Attention pairs of a row computing ``num_tokens`` after ``done`` positions: the
    query at position ``p`` sees ``p + 1`` keys."""
    return num_tokens * done + num_tokens * (num_tokens + 1) // 2


def prefill_shape(tokens: int, done: int = 0) -> StepShape:
    """One sequence computing ``tokens`` prompt tokens after ``done`` already computed
    (cached, or earlier chunks)."""
    return StepShape(tokens, done + tokens, 1, row_pairs(tokens, done))


def decode_shape(seqs: int, context: int) -> StepShape:
    """``seqs`` sequences decoding one token each, reading ``context`` KV positions in all
    (the new tokens' included): each row's query sees its whole context."""
    return StepShape(seqs, context, seqs, context)


def joined(*shapes: StepShape) -> StepShape:
    """One step doing all of ``shapes``."""
    return StepShape(*(sum(s[i] for s in shapes) for i in range(4)))


def plan_shape(plan: StepPlan, num_computed: Callable[[int], int],
               drafted: dict[int, int] | None = None) -> StepShape:
    """The shape of ``plan``; ``num_computed(seq_id)`` is each sequence's progress before it.
    A speculating row computes its draft tokens too: as many as the plan allows
    (``draft_k``), or, given ``drafted`` (seq id -> drafts the executor verified, once the
    step answered), those."""
    tokens = context = pairs = 0
    for st in plan.steps:
        done = num_computed(st.seq_id)
        n = st.num_tokens + (st.draft_k if drafted is None else drafted.get(st.seq_id, 0))
        tokens += n
        context += done + n
        pairs += row_pairs(n, done)
    return StepShape(tokens, context, len(plan.steps), pairs)


def fit_relative(rows: Sequence[Sequence[float]], seconds: Sequence[float]) -> list[float]:
    """Coefficients, every one >= 0 (a step never gets cheaper with more work), fitted by
    least squares on *relative* error, so a 10 ms decode step counts as much as a 500 ms
    prefill; by active set: fit, drop the most negative coefficient's feature, refit."""
    x, y = np.asarray(rows, dtype=np.float64), np.asarray(seconds, dtype=np.float64)
    xw, yw = x / y[:, None], np.ones_like(y)
    active = list(range(x.shape[1]))
    coef = np.zeros(x.shape[1])
    while active:
        sol = np.linalg.lstsq(xw[:, active], yw, rcond=None)[0]
        if (sol >= 0).all():
            coef[active] = sol
            break
        active.pop(int(np.argmin(sol)))
    return [float(c) for c in coef]


def prior_vote(ratios: Sequence[float]) -> float:
    """The median of ``ratios`` (steps' measured ÷ the prior's prediction) with the prior's
    own vote of 1 among them; an even count takes the geometric mean of the middle two. One
    step alone moves the scale halfway (in log) from 1 to its ratio; from the third step on
    the steps outvote the prior."""
    r = sorted([1.0, *ratios])
    n = len(r)
    return r[n // 2] if n % 2 else float(np.sqrt(r[n // 2 - 1] * r[n // 2]))


class StepCostModel:
    def __init__(self, window: int = 256, min_samples: int = 8,
                 prior: Sequence[float] | None = None,
                 deterministic_factor: float = 1.0) -> None:
        self.det_prior = deterministic_factor
        self._det: deque[float] = deque(maxlen=DET_WINDOW)   # measured / fast prediction
        self._x: deque[tuple[float, ...]] = deque(maxlen=window)
        self._y: deque[float] = deque(maxlen=window)
        self._coef: list[float] = []
        self._ratios: deque[float] = deque(maxlen=64)     # measured / predicted, recent steps
        self._dirty = False
        self.min_samples = min_samples
        self.prior: list[float] | None = None
        self._prior_scale = np.zeros(len(FEATURES))
        if prior is not None:
            self.set_prior(prior)

    def set_prior(self, coef: Sequence[float],
                  shapes: Sequence[StepShape] = ()) -> None:
        """Start from ``coef`` (seconds per unit of each of ``FEATURES``), fitted to steps
        of ``shapes`` (what it knows about: see ``_refit``)."""
        if len(coef) != len(FEATURES):
            raise ValueError(f"a prior needs {len(FEATURES)} coefficients, got {len(coef)}")
        self.prior = [float(c) for c in coef]
        x = np.array([s.row() for s in shapes]) if shapes else np.zeros((1, len(FEATURES)))
        self._prior_scale = np.sqrt((x * x).mean(axis=0))
        self._dirty = True

    def prior_from(self, samples: Iterable[tuple[StepShape, float]]) -> bool:
        """Start from a fit of measured ``(shape, seconds)`` steps (the executor's startup
        probe); False, and no prior, when they are too few to fit every feature."""
        good = [(shape, s) for shape, s in samples if s > 0 and shape.tokens > 0]
        if len(good) < len(FEATURES):
            return False
        self.set_prior(fit_relative([shape.row() for shape, _ in good], [s for _, s in good]),
                       [shape for shape, _ in good])
        return True

    def deterministic_factor(self) -> float:
        """How much slower the batch-invariant plan runs a step than the fast plan: the
        median over the recent deterministic steps, else the prior."""
        if len(self._det) < DET_MIN:
            return self.det_prior
        ordered = sorted(self._det)
        return ordered[len(ordered) // 2]

    def observe(self, shape: StepShape, seconds: float, deterministic: bool = False) -> None:
        if deterministic:
            fast = self.predict(shape)
            if fast > 0:
                self._det.append(seconds / fast)
                return
            # nothing to compare with yet (no prior, no fast step): the fit learns the
            # step as the fast plan would have run it, at the factor known now
            seconds /= self.deterministic_factor()
        if self.prior is not None or self._fitted():   # how it compares with its prediction
            predicted = self.predict(shape)
            if predicted > 0:
                # (rounded: a fit's float noise is no slowdown)
                self._ratios.append(round(seconds / predicted, 6))
        self._x.append(shape.row())
        self._y.append(seconds)
        self._dirty = True

    def _fitted(self) -> bool:
        return len(self._y) >= self.min_samples

    def slowdown(self, q: float = 0.9) -> float:
        """How much slower than predicted recent steps ran, at quantile ``q`` (at least 1):
        what a step must be planned against to finish in time that often. Over fewer than 8
        steps, the slowest but one of them (1 for one step): a quantile of so few is no
        estimate, and the first live steps are the ones a prior fitted on the startup probe
        knows least (on a 2-core Zen 4 the first mixed steps beside 16 streams ran
        1.04-1.13x the prior-led prediction, and planned at 1.0 they took 596-677 ms
        against a 600 ms gap cap); but not the slowest, which is an engine's first step,
        cold (2.5x and 8.5x seen), nor from 8 steps on, where the p90 of the window is
        taken below its slowest. Ratios are kept from the first step where a prior
        predicts, not only once the window is fitted; at most ``PRIOR_SCALE_MAX`` before 8
        steps."""
        if len(self._ratios) < 2:
            return 1.0
        ordered = sorted(self._ratios)
        # never the slowest of the window: below 11 steps the p90's index would be the last,
        # the cold first step (2.0-5.9x: at 8-10 steps it held the 9th-11th steps of a
        # rate-inf burst to 39-233 tokens between steps of 420-660); below 8 this is the
        # slowest but one
        got = max(ordered[min(int(q * len(ordered)), len(ordered) - 2)], 1.0)
        return min(got, PRIOR_SCALE_MAX) if len(ordered) < 8 else got

    def mean_per_token(self) -> float:
        """Seconds per token over the window, fixed costs included: an upper bound on the
        marginal cost of a token, for when the fit cannot tell it (only decode steps seen,
        so tokens and sequences move together)."""
        tokens = sum(x[1] for x in self._x)
        return sum(self._y) / tokens if tokens else 0.0

    def predict(self, shape: StepShape, deterministic: bool = False) -> float:
        """Predicted seconds for a step (``deterministic``: in the batch-invariant plan):
        0.0 before any observation and without a prior."""
        if deterministic:
            return self.predict(shape) * self.deterministic_factor()
        coef = self._current()
        if coef is None:
            if not self._y:
                return 0.0
            per_token = sum(self._y) / max(sum(x[1] for x in self._x), 1.0)
            return per_token * shape.tokens
        c0, c1, c2, c3, c4 = coef           # plain floats: predict runs per lease request
        return max(c0 + c1 * shape.tokens + c2 * shape.pairs + c3 * shape.seqs
                   + c4 * shape.context, 0.0)

    def pair_s(self) -> float:
        """Attention's seconds per pair as the model prices it now (0 when it cannot, and
        never below 0)."""
        coef = self._current()
        return max(coef[2], 0.0) if coef is not None else 0.0

    def decode_rates(self) -> tuple[float, float, float] | None:
        """A decode step's price as the model has it now, ``(base, per sequence, per KV
        position read)`` in seconds: a decode row's token and sequence terms together, and
        its attention and context terms together (``decode_shape``: tokens == sequences,
        pairs == context; a window of decode steps tells only these sums apart, so they are
        what it knows best). Without coefficients yet, the window's mean time per token
        per sequence; None before any step or prior."""
        coef = self._current()
        if coef is None:
            per_token = self.mean_per_token()
            return (0.0, per_token, 0.0) if per_token > 0 else None
        return (coef[0], coef[1] + coef[3], coef[2] + coef[4])

    def _current(self) -> list[float] | None:
        """The coefficients predictions use now; None while the model predicts from the
        time per token (no prior, too few steps) or not at all."""
        if self.prior is None and not self._fitted():
            return None
        if not self._y:
            return self.prior
        if self._dirty:
            self._refit()
        return self._coef

    def _refit(self) -> None:
        """Without a prior: least squares over the window. With one, fewer than
        ``min_samples`` steps scale it (the median step's measured ÷ predicted, the prior
        voting once at 1: :func:`prior_vote`; within
        ``PRIOR_SCALE_MAX`` either way);
        more fit ``coef = prior × (1 + e) + delta``: the prior scaled as a whole (within
        ``PRIOR_SCALE_MAX`` either way) and moved by a delta per feature, each of ``e`` and
        the deltas weighed ``PRIOR_STEPS`` × its square in seconds of a typical step (for a
        delta, over the mean square of its feature over the window, or over the prior's
        own steps where larger; for ``e``, of the prior's prediction over the window): a
        direction the window pins down follows the window, one it cannot tell (a feature it
        never varies, or two it only sees move together, or a feature it sees only small:
        the window's short prompts say little about a long prompt's attention) stays at the
        prior, scaled with the rest."""
        x, y = np.array(self._x), np.array(self._y)
        self._dirty = False
        # each feature in units of its own size over the window (pairs run to millions,
        # the constant is 1): the solve is well conditioned
        scale = np.sqrt((x * x).mean(axis=0))
        scale[scale == 0] = 1.0
        if self.prior is None:
            self._coef = [float(c) for c in np.linalg.lstsq(x / scale, y, rcond=None)[0]
                          / scale]
            return
        p = np.array(self.prior)
        if not self._fitted():
            # the median step's measured ÷ predicted, the prior voting once at 1 (an even
            # count takes the geometric mean of the middle two), within PRIOR_SCALE_MAX
            # either way: the prior was measured on this machine, so one step far off it is
            # a transient (an engine's first step, cold, read 8.5x and scaled every
            # prediction of the burst behind it by that: a TTFT p99 of 2.5 s where 1.8 was
            # the machine's). Without the prior's vote a first step alone set the scale: at
            # rate inf a 128-token first step ran 3.2x its prediction beside the burst's
            # own arrival, and the next 771-token step, planned at 3x, ran in 296 ms of a
            # predicted 447 (the steps after it ran 1.2-2.0x the prior)
            expected = x @ p
            ratio = prior_vote([yi / ei for yi, ei in zip(y, expected) if ei > 0])
            ratio = min(max(ratio, 1 / PRIOR_SCALE_MAX), PRIOR_SCALE_MAX)
            self._coef = [float(c) for c in p * ratio]
            return
        # coef = p * (1 + e) + delta: the prior scaled as a whole (e) and moved a term at a
        # time (delta), both held alike. A served engine shares its cores with its other
        # processes and its clients, which slows every term alike; with deltas alone that
        # went to the terms the window moves freely (the constant, the sequences), not to
        # a token's cost, which the prior's long steps pin: on a 2-core Zen 4 a burst's
        # mixed steps ran ~1.5x the prior, and the step of 64 decodes after it (which the
        # stall-free budget paces the streams' next tokens at) was priced at 130-300 ms
        # where it took 75-100
        held = np.maximum(scale, self._prior_scale)
        base = x @ p
        unit = float(np.sqrt((base * base).mean())) or 1.0
        a = np.vstack([np.column_stack([x / held, base / unit]),
                       np.sqrt(PRIOR_STEPS) * np.eye(len(p) + 1)])
        b = np.concatenate([y - base, np.zeros(len(p) + 1)])
        sol = np.linalg.lstsq(a, b, rcond=None)[0]
        grow = 1.0 + sol[-1] / unit
        if not 1 / PRIOR_SCALE_MAX <= grow <= PRIOR_SCALE_MAX:   # the deltas about the bound
            grow = min(max(grow, 1 / PRIOR_SCALE_MAX), PRIOR_SCALE_MAX)
            a = np.vstack([x / held, np.sqrt(PRIOR_STEPS) * np.eye(len(p))])
            b = np.concatenate([y - grow * base, np.zeros(len(p))])
            sol = np.append(np.linalg.lstsq(a, b, rcond=None)[0], 0.0)
        self._coef = [float(c) for c in p * grow + sol[:-1] / held]
