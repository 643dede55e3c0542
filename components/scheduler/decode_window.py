"""The decode steps of the last few seconds, as the running streams saw them.

Each finished step that decoded a sequence is kept with its measured and predicted time
and the classes of the sequences it decoded. The load report reads from them the decode
batch's measured step time, how far the cost model is off on those steps (measured ÷
predicted), and each class's time per output token: the mean time of the steps its
decoding sequences were in, prefill chunks beside them included, since its streams wait
for those too.

O(classes in the step) per step and amortized O(1) to expire: running sums, never a scan
of the batch or of the queue. Pure; the caller passes the clock."""
from __future__ import annotations

from collections import deque
from collections.abc import Iterable

LIVE_WINDOW_S = 2.0        # how far back the live numbers look
MIN_ERROR_STEPS = 4        # fewer decode steps in the window: the cost model is taken as is


class DecodeWindow:
    def __init__(self, window_s: float = LIVE_WINDOW_S) -> None:
        self.window_ns = round(window_s * 1e9)
        self._steps: deque[tuple[int, float, float, frozenset[str], bool]] = deque()
        self._measured = 0.0
        self._predicted = 0.0
        # the same over the steps that decoded only (no prefill row beside): what the error
        # is taken from, as the decode horizon predicts a decode-only step; a step with a
        # prefill chunk carries costs the model prices less well (a prompt's logprobs over
        # the vocabulary, a grammar's first mask), and a few of them read as the whole
        # batch running 7x slow
        self._pure = 0
        self._pure_measured = 0.0
        self._pure_predicted = 0.0
        self._by_class: dict[str, tuple[float, int]] = {}   # class -> (seconds, steps)

    def step(self, now_ns: int, measured_s: float, predicted_s: float,
             classes: frozenset[str], pure: bool = True) -> None:
        """A step ended at ``now_ns`` that decoded sequences of ``classes`` (none: it
        decoded nothing, and is not kept); ``pure``: it decoded only, no prefill beside."""
        if not classes:
            return
        self._steps.append((now_ns, measured_s, predicted_s, classes, pure))
        self._measured += measured_s
        self._predicted += predicted_s
        if pure:
            self._pure += 1
            self._pure_measured += measured_s
            self._pure_predicted += predicted_s
        for c in classes:
            seconds, steps = self._by_class.get(c, (0.0, 0))
            self._by_class[c] = (seconds + measured_s, steps + 1)
        self.expire(now_ns)

    def expire(self, now_ns: int) -> None:
        """Forget the steps that ended ``LIVE_WINDOW_S`` or more before ``now_ns``."""
        horizon = now_ns - self.window_ns
        while self._steps and self._steps[0][0] <= horizon:
            _, measured, predicted, classes, pure = self._steps.popleft()
            self._measured -= measured
            self._predicted -= predicted
            if pure:
                self._pure -= 1
                self._pure_measured -= measured
                self._pure_predicted -= predicted
            for c in classes:
                seconds, steps = self._by_class[c]
                if steps == 1:
                    del self._by_class[c]
                else:
                    self._by_class[c] = (seconds - measured, steps - 1)
        if not self._steps:                  # no drift of the running sums past an idle spell
            self._measured = self._predicted = 0.0
        if not self._pure:
            self._pure_measured = self._pure_predicted = 0.0

    @property
    def steps(self) -> int:
        return len(self._steps)

    @property
    def pure_steps(self) -> int:
        """The window's decode-only steps: what ``error`` is measured on."""
        return self._pure

    def measured_s(self) -> float:
        """The mean measured time of the window's decode steps; 0.0 with none."""
        return self._measured / len(self._steps) if self._steps else 0.0

    def error(self) -> float:
        """Measured ÷ predicted over the window's decode-only steps; 1.0 with fewer than
        ``MIN_ERROR_STEPS`` of them or nothing predicted."""
        if self._pure < MIN_ERROR_STEPS or self._pure_predicted <= 0:
            return 1.0
        return self._pure_measured / self._pure_predicted

    def tpot_s(self) -> dict[str, float]:
        """Per class, the mean time of the steps that decoded its sequences."""
        return {c: seconds / steps for c, (seconds, steps) in self._by_class.items()}


def decode_classes(rows: Iterable[tuple[int, int, int, str]]) -> frozenset[str]:
    """The classes of a step's decoding sequences, from its rows ``(tokens computed,
    position before the step, prompt length, class)``: those computing one token past
    their prompt, not a prefill chunk."""
    return frozenset(cls for tokens, start, prompt, cls in rows
                     if tokens == 1 and start >= prompt)
