"""Structured output in the executor: each constrained sequence's llguidance matcher, fed
the sequence's output as it is sampled, and the token masks they give applied to the
logits before sampling (after penalties, so no bias or penalty can bring back a token
the language forbids; logprobs are taken before either, the model's own distribution).

The executor owns a sequence's sampled tokens, so the matcher advances here, in the step
that sampled them, and the scheduler plans the next step without knowing them (the
overlapped path needs nothing more). A sequence the executor learns again (recomputed
after preemption, or a fork of ``n`` > 1) rebuilds its matcher from the grammar and the
output so far.

The vocabulary llguidance reads (0.4-0.6 s, most of it holding the GIL) is built on a
worker thread as the executor starts (``Grammars.settle`` waits for it before the executor
is ready): built under the first constrained request, it stalled every running stream
0.6-0.7 s on 2 cores. A language's matcher is compiled on that thread from the moment its
first sequence arrives, beside the forward pass, where that leaves cores free (llguidance
lets go of the GIL: 30-40 ms for 200 properties); else on the step's thread when the
sequence first samples (``Grammars.overlap``)."""
from __future__ import annotations

import functools
import math
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING

import numpy as np
import torch

from components.executor.sampling import _native

if TYPE_CHECKING:           # (torch and numpy alone here: scripts/gpu_check runs this file)
    from schemas.client import StructuredOutput


class Constraint:
    """One sequence's place in its language: a copy of the language's fresh matcher
    (``fresh()``, which may wait for its compile), made and caught up with ``output`` when
    the sequence first needs it."""

    __slots__ = ("_matcher", "_fresh", "_output")

    def __init__(self, fresh: Callable[[], object], output: list[int]) -> None:
        self._matcher, self._fresh, self._output = None, fresh, list(output)

    def ready(self) -> int:
        """Makes the matcher if it is not there yet; the nanoseconds that took (waiting
        for, or running, the language's compile), 0 if it was there."""
        if self._matcher is not None:
            return 0
        t0 = time.perf_counter_ns()
        self._matcher = self._fresh().deep_copy()
        if self._output:                    # recomputed, or a fork: catch up
            self._matcher.consume_tokens(self._output)
        self._fresh, self._output = None, []
        return time.perf_counter_ns() - t0

    @property
    def matcher(self):
        self.ready()
        return self._matcher

    def advance(self, token: int) -> None:
        """The sequence sampled ``token``. A language that is complete allows EOS alone
        from then on (with ``ignore_eos`` the sequence samples EOS until ``max_tokens``)."""
        self.matcher.consume_token(token)

    def error(self) -> str | None:
        """Why the matcher is in its error state, or None: its language went past
        llguidance's limits on the tokens it met (``a{1000}{1000}`` on its first token), or
        it is one the tokenizer should have refused; never a sampled token, which the mask
        allowed. The first line of llguidance's message: the lines after it quote the
        output."""
        m = self.matcher
        if not m.is_error():
            return None
        return (m.get_error().strip().splitlines() or ["llguidance error"])[0][:200]

    def fill(self, row: np.ndarray) -> None:
        """The tokens allowed next as bits into ``row``, an int32 array (token ``t`` is
        bit ``t % 32`` of word ``t // 32``). A matcher in its error state (``error()``)
        allows EOS alone, so the row draws from no empty set while the scheduler, told by
        the step's result, fails the request."""
        self.matcher.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)


class Ahead:
    """A constraint as it stands after ``tokens`` more (a speculating row's draft tokens
    before the position it masks): ``fill`` consumes them, fills the mask, and rolls them
    back, so the sequence's matcher is unchanged."""

    __slots__ = ("constraint", "tokens")

    def __init__(self, constraint: Constraint, tokens: list[int]) -> None:
        self.constraint, self.tokens = constraint, tokens

    def ready(self) -> int:
        return self.constraint.ready()

    def fill(self, row: np.ndarray) -> None:
        m = self.constraint.matcher
        m.consume_tokens(self.tokens)
        try:
            m.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)
        finally:
            m.rollback(len(self.tokens))


class Grammars:
    """Matchers for constrained sequences: the vocabulary, built by ``vocab`` on a worker
    thread from construction, and a fresh matcher per language kept (up to ``keep``),
    copied for each sequence that asks for it (requests of one service send the same schema
    again and again).

    ``overlap``: a language is compiled on the worker as its first sequence arrives, while
    the step's forward pass runs. Otherwise it is compiled on the step's thread when the
    sequence first samples. Overlap pays where the forward pass leaves cores free (a GPU,
    or fewer torch threads than cores). Where it takes every core, the compile only takes
    CPU from it: on 2 cores, 8 running streams' largest gap when a new 200-property schema
    arrived was a median 78 ms with overlap and 69 ms without."""

    def __init__(self, vocab: Callable[[], object], keep: int = 64,
                 overlap: bool = True) -> None:
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="weir-grammar")
        self._vocab: Future = self._worker.submit(vocab)
        self._fresh: OrderedDict[StructuredOutput, Callable[[], object]] = OrderedDict()
        self.keep, self.overlap = keep, overlap

    def settle(self) -> BaseException | None:
        """Waits for the vocabulary's build; what it raised, if it failed (the constrained
        sequences then fail their steps, as the build would have in them)."""
        return self._vocab.exception()

    def constraint(self, so: StructuredOutput, output: list[int]) -> Constraint:
        """``so``'s constraint for a sequence whose output so far is ``output``, at once
        (its matcher is made when the sequence first needs it)."""
        fresh = self._fresh.get(so)
        if fresh is None:
            fresh = (self._worker.submit(self._compile, so).result if self.overlap
                     else functools.cache(functools.partial(self._compile, so)))
            self._fresh[so] = fresh
            while len(self._fresh) > self.keep:
                self._fresh.popitem(last=False)
        self._fresh.move_to_end(so)
        return Constraint(fresh, output)

    def _compile(self, so: StructuredOutput):
        import structlog
        from llguidance import LLMatcher

        from components.model.structured import grammar_of, limits

        vocab = self._vocab.result()
        # the tokenizer refuses what fails here before it runs; if one did, the matcher's
        # error state fails the request (the log names no part of it: a schema is the
        # user's)
        try:
            fresh = LLMatcher(vocab, grammar_of(so), log_level=0, limits=limits())
        except ValueError:
            fresh = LLMatcher(vocab, "start: (", log_level=0)
        if fresh.is_error():
            structlog.get_logger("executor").error("structured_output_unusable")
        return fresh


def apply_constraints(logits: torch.Tensor, rows: list[tuple[int, Constraint]],
                      native: bool = True) -> None:
    """Set every token ``rows``' languages forbid to -inf in ``logits`` ``[S, vocab]``
    (in place), for each ``(row, constraint)``: natively on the CPU (kernels/csrc/
    cpu_sampling.cpp), else unpacked and filled by torch (a GPU). 64 rows held to JSON
    objects, 2-core AVX512 EPYC: 0.7 ms with the masks' making, 11.8 through torch; a
    batch-64 bf16 decode step, every row held to JSON: +13.2 ms through torch, within the
    noise natively (``scripts/run bench/step --penalties 64``)."""
    vocab = logits.shape[1]
    masks = torch.empty(len(rows), (vocab + 31) // 32, dtype=torch.int32)
    words = masks.numpy()
    for j, (_, c) in enumerate(rows):
        c.fill(words[j])
    at = torch.tensor([r for r, _ in rows], dtype=torch.long)
    with torch.inference_mode():
        if (native and _native is not None and logits.device.type == "cpu"
                and logits.dtype == torch.float32 and logits.is_contiguous()):
            _native.apply_bitmask(logits, masks, at)
            return
        shifts = torch.arange(32, dtype=torch.int32, device=logits.device)
        bits = (masks.to(logits.device)[:, :, None] >> shifts) & 1
        banned = bits.reshape(len(rows), -1)[:, :vocab] == 0
        at = at.to(logits.device)
        logits[at] = logits[at].masked_fill(banned, -math.inf)
