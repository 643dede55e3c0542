"""The step-cost model: predicts a step's time from its shape, learned from measured steps.

time ≈ a + b · batch_tokens + c · context_tokens + d · num_seqs, fitted by least squares over
a sliding window of recent steps. Until it has seen enough distinct steps it predicts from
the average time per token. Pure and synchronous.
"""
from __future__ import annotations

from collections import deque
from typing import Callable, NamedTuple

import numpy as np

from schemas.wire import StepPlan


class StepShape(NamedTuple):
    """What a step's time depends on: tokens computed, KV positions read (the sum over rows
    of each row's context), sequences, and attention pairs (query rows × keys they see)."""

    tokens: int
    context: int
    seqs: int
    pairs: int


def plan_shape(plan: StepPlan, num_computed: Callable[[int], int]) -> StepShape:
    """The shape of ``plan``; ``num_computed(seq_id)`` is each sequence's progress before it."""
    tokens = context = pairs = 0
    for st in plan.steps:
        done = num_computed(st.seq_id)
        tokens += st.num_tokens
        context += done + st.num_tokens
        pairs += st.num_tokens * done + st.num_tokens * (st.num_tokens + 1) // 2
    return StepShape(tokens, context, len(plan.steps), pairs)


class StepCostModel:
    def __init__(self, window: int = 256, min_samples: int = 8) -> None:
        self._x: deque[tuple[float, float, float, float]] = deque(maxlen=window)
        self._y: deque[float] = deque(maxlen=window)
        self._coef: list[float] = []
        self._ratios: deque[float] = deque(maxlen=64)     # measured / predicted, recent steps
        self._dirty = False
        self.min_samples = min_samples

    def observe(self, batch_tokens: int, context_tokens: int, num_seqs: int, seconds: float) -> None:
        if len(self._y) >= self.min_samples:   # how the step compares with what was predicted
            predicted = self.predict(batch_tokens, context_tokens, num_seqs)
            if predicted > 0:
                self._ratios.append(seconds / predicted)
        self._x.append((1.0, float(batch_tokens), float(context_tokens), float(num_seqs)))
        self._y.append(seconds)
        self._dirty = True

    def slowdown(self, q: float = 0.9) -> float:
        """How much slower than predicted recent steps ran, at quantile ``q`` (at least 1):
        what a step must be planned against to finish in time that often."""
        if len(self._ratios) < 8:
            return 1.0
        ordered = sorted(self._ratios)
        return max(ordered[min(int(q * len(ordered)), len(ordered) - 1)], 1.0)

    def mean_per_token(self) -> float:
        """Seconds per token over the window, fixed costs included: an upper bound on the
        marginal cost of a token, for when the fit cannot tell it (only decode steps seen,
        so tokens and sequences move together)."""
        tokens = sum(x[1] for x in self._x)
        return sum(self._y) / tokens if tokens else 0.0

    def predict(self, batch_tokens: int, context_tokens: int, num_seqs: int) -> float:
        """Predicted seconds for a step; 0.0 before any observation."""
        if not self._y:
            return 0.0
        if len(self._y) < self.min_samples:
            per_token = sum(self._y) / max(sum(x[1] for x in self._x), 1.0)
            return per_token * batch_tokens
        if self._dirty:
            x, y = np.array(self._x), np.array(self._y)
            self._coef = [float(c) for c in np.linalg.lstsq(x, y, rcond=None)[0]]
            self._dirty = False
        a, b, c, d = self._coef             # plain floats: predict runs per lease request
        return max(a + b * batch_tokens + c * context_tokens + d * num_seqs, 0.0)
