"""Speculative decoding as the scheduler's decision, every step: how many draft tokens
(k, 0..``speculative.max_k``) each decode row may verify.

The first seed: speculation spends spare compute at small batches to emit several tokens
per model pass, and at large batches takes the compute other requests need. So k is not a
server flag (vLLM's ``num_speculative_tokens``, SGLang's ``speculative_num_steps``) but a
choice per row per step, from:

- the row's acceptance, ``a``: the chance its next draft token is accepted, measured per
  sequence (accepted draft tokens against the rejections that ended a verify), starting
  from its class's measured rate (or ``speculative.class_priors`` / ``acceptance_prior``
  before its class has any) with the weight of ``PRIOR_WEIGHT`` verifies;
- the step's predicted time from the step-cost model, with each extra verify token priced
  as the model prices a token (its attention over the row's context included), plus the
  draft source's own time per draft token as measured (a draft model's forwards; the
  step-cost model is taught the step's time without it);
- the token budget left after decodes and prefill chunks: drafts take only what prefill did
  not (k is 0 when prefill needs the budget);
- the tightest TPOT objective among the rows: a step is never stretched past it;
- priority: a row's tokens count ``1 / (1 + priority)`` (a batch class's less than an
  interactive one's); the step's other tokens (prefill chunks) count 1 each, so a step
  busy with prefill drafts only where a draft pays as well as the prefill it slows.

The rule: a row drafting k tokens emits ``1 + a + ... + a^k`` tokens on average, so its
(k+1)-th draft adds ``a^(k+1)``. Starting from plain decoding (k = 0 everywhere), the
draft token with the largest weighted gain is added while it raises the batch's weighted
expected tokens per second of step time (gain / its time > tokens / step time). When the
step is compute-bound (a token's marginal time near the step's time per token) no draft
pays and k stays 0 for every row; at batch 1 on a memory-bound step a draft costs a
fraction of a token's share and k rises to what the acceptance supports.

With ``control = "fixed"`` every decode row drafts ``max_k`` (for comparison with the
static flag). Pure: no clocks, no I/O; the planner calls ``choose`` and the output stage
``verified``.
"""
from __future__ import annotations

import heapq
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from components.costs.cost_model import StepCostModel, StepShape, row_pairs

if TYPE_CHECKING:
    from components.scheduler.sequence import Seq
    from schemas.config import SpeculativeConfig

PRIOR_WEIGHT = 4.0          # verifies' worth of evidence the class (or configured) prior has
CLASS_DECAY = 0.995         # per verify: a class's rate follows its recent sequences
EXPLORE_AFTER = 16          # decodes without a draft, after which a row is given one again


@dataclass
class SpecStats:
    """Counters for metrics, by class: drafted and accepted tokens; k per planned row."""

    drafted: Counter[str] = field(default_factory=Counter)
    accepted: Counter[str] = field(default_factory=Counter)
    k_hist: Counter[int] = field(default_factory=Counter)      # k -> decode rows planned so
    passes: int = 0                                            # speculating rows verified
    emitted: int = 0                                           # tokens those rows emitted
    reasons: Counter[str] = field(default_factory=Counter)     # steps no row drafted, by why


@dataclass
class Choice:
    """One step's decision, for its span: k per row and the inputs that set it."""

    k: dict[int, int]                       # seq id -> draft tokens (rows with k > 0)
    acceptance: dict[int, float]            # seq id -> the rate used
    base_s: float = 0.0                     # the step without drafts, predicted
    with_drafts_s: float = 0.0              # with them
    expected_tokens: float = 0.0            # weighted expected tokens with them
    budget_left: int = 0
    reason: str = ""                        # why no row drafts, when none does


class Speculation:
    def __init__(self, cfg: SpeculativeConfig) -> None:
        self.cfg = cfg
        self.on = cfg.on
        # per class: (accepted, rejections), decayed
        self._class: dict[str, list[float]] = {}
        self.stats = SpecStats()
        # the draft source's own seconds per draft token (a draft model's forwards; prompt
        # lookup's search), measured from the executor's reports: the step-cost model
        # prices the target's tokens, this prices proposing them
        self.draft_s_per_token = 0.0
        self._draft_s = 0.0
        self._draft_tokens = 0.0

    def drafting_took(self, seconds: float, tokens: int) -> None:
        """A step's drafting took ``seconds`` for ``tokens`` draft tokens (decayed mean)."""
        if tokens <= 0:
            return
        self._draft_s = self._draft_s * 0.98 + seconds
        self._draft_tokens = self._draft_tokens * 0.98 + tokens
        self.draft_s_per_token = self._draft_s / self._draft_tokens

    # ---------------------------------------------------------------- acceptance
    def prior(self, cls: str) -> float:
        """The class's measured rate, with the configured prior as ``PRIOR_WEIGHT``
        verifies (one unlucky verify does not set a class to 0)."""
        a0 = self.cfg.class_priors.get(cls, self.cfg.acceptance_prior)
        c = self._class.get(cls)
        if c is None:
            return a0
        return (c[0] + PRIOR_WEIGHT * a0) / (c[0] + c[1] + PRIOR_WEIGHT)

    def acceptance(self, seq: Seq) -> float:
        """The chance ``seq``'s next draft token is accepted: its own verifies' accepted
        tokens and rejections, with its class's rate as ``PRIOR_WEIGHT`` verifies. A
        sequence that has not drafted for ``EXPLORE_AFTER`` decodes is given its class's
        rate again, once: what it produces changes (a copy starts), and an estimate that
        keeps it from drafting would never learn that."""
        a0 = self.prior(seq.service_class)
        if seq.spec_idle >= EXPLORE_AFTER:
            return a0
        hits, misses = seq.spec_hits, seq.spec_misses
        return (hits + PRIOR_WEIGHT * a0) / (hits + misses + PRIOR_WEIGHT)

    def verified(self, seq: Seq, drafted: int, accepted: int) -> None:
        """A verify of ``drafted`` draft tokens for ``seq`` kept ``accepted``."""
        miss = int(accepted < drafted)
        if drafted and seq.spec_idle >= EXPLORE_AFTER:
            seq.spec_hits, seq.spec_misses = 0, 0      # explored: start its estimate again
        if drafted:
            seq.spec_idle = 0
        seq.spec_hits += accepted
        seq.spec_misses += miss
        c = self._class.setdefault(seq.service_class, [0.0, 0.0])
        c[0] = c[0] * CLASS_DECAY + accepted
        c[1] = c[1] * CLASS_DECAY + miss
        st = self.stats
        st.drafted[seq.service_class] += drafted
        st.accepted[seq.service_class] += accepted
        st.passes += 1
        st.emitted += accepted + 1

    # ---------------------------------------------------------------- the decision
    def choose(self, rows: list[tuple[Seq, int, int]], shape: StepShape,
               cost: StepCostModel, budget: int, tpot_cap_s: float | None = None) -> Choice:
        """k for each decode row ``(seq, context, room)`` (its computed length before this
        step; the draft tokens its blocks have room for) of a step of ``shape`` (its plan
        without drafts), with ``budget`` tokens left; ``tpot_cap_s``: the tightest TPOT
        objective of the step's rows (the step's predicted time with drafts stays under
        it). Rows not in the result draft nothing."""
        choice = Choice({}, {})
        choice.budget_left = budget
        cands = [(seq, ctx, min(room, self.cfg.max_k)) for seq, ctx, room in rows
                 if room > 0 and seq.header.speculate]
        if not self.on or not cands:
            choice.reason = "off" if not self.on else "no_row"
            self._count(rows, choice)
            return choice
        if self.cfg.control == "fixed":
            for seq, _, kmax in cands:
                k = min(kmax, budget)
                if k > 0:
                    choice.k[seq.seq_id] = k
                    budget -= k
            self._count(rows, choice)
            return choice
        base = cost.predict(shape)
        choice.base_s = base
        if base <= 0.0 or budget <= 0:
            choice.reason = "no_cost_model" if base <= 0.0 else "budget"
            self._count(rows, choice)
            return choice
        acc = {seq.seq_id: self.acceptance(seq) for seq, _, _ in cands}
        choice.acceptance = acc
        weight = {seq.seq_id: 1.0 / (1.0 + max(seq.priority, 0)) for seq, _, _ in rows}
        # the step's work without drafts: each candidate decode row's token, weighted, and
        # every other token it computes (prefill chunks, other decodes) at 1: a step busy
        # with prefill gives a draft token the budget only if it pays as a prefill token
        # would (the first seed: speculation takes the compute other requests need)
        value = sum(weight[seq.seq_id] for seq, _, _ in rows) + max(shape.tokens - len(rows), 0)
        tokens, context, seqs, pairs = shape
        t = base
        k = {seq.seq_id: 0 for seq, _, _ in cands}
        drafted = 0
        # each row's next draft by its gain, best first (ties: the earlier row); a row's
        # gain only falls as it drafts more (acceptance < 1), so its next one is pushed
        # back after it is taken: O(drafts · log rows) where a rescan was O(drafts · rows)
        heap = [(-weight[seq.seq_id] * acc[seq.seq_id], i) for i, (seq, _, kmax) in
                enumerate(cands) if kmax > 0]
        heapq.heapify(heap)
        while budget > 0 and heap:
            neg_gain, i = heap[0]
            gain = -neg_gain
            seq, ctx, kmax = cands[i]
            sid = seq.seq_id
            q = 1 + k[sid]                 # the row's query tokens before this draft
            more = StepShape(tokens + 1, context + 1, seqs,
                             pairs - row_pairs(q, ctx) + row_pairs(q + 1, ctx))
            t_more = cost.predict(more) + self.draft_s_per_token * (drafted + 1)
            dt = max(t_more - t, 1e-9)
            if gain * t <= value * dt:
                choice.reason = choice.reason or "no_gain"
                break                      # the best draft left does not pay: none does
            if tpot_cap_s is not None and t_more > tpot_cap_s:
                choice.reason = "tpot"
                break
            k[sid] += 1
            drafted += 1
            if k[sid] < kmax:
                heapq.heapreplace(heap, (-weight[sid] * acc[sid] ** (k[sid] + 1), i))
            else:
                heapq.heappop(heap)
            budget -= 1
            value += gain
            t = t_more
            tokens, context, pairs = more.tokens, more.context, more.pairs
        choice.k = {sid: n for sid, n in k.items() if n > 0}
        choice.with_drafts_s = t
        choice.expected_tokens = value
        if not choice.k and not choice.reason:
            choice.reason = "budget"
        self._count(rows, choice)
        return choice

    def _count(self, rows: list[tuple[Seq, int, int]], choice: Choice) -> None:
        if not choice.k:
            self.stats.reasons[choice.reason or "none"] += 1
        for seq, _, _ in rows:
            k = choice.k.get(seq.seq_id, 0)
            self.stats.k_hist[k] += 1
            if not k:
                seq.spec_idle += 1
