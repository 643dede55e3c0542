"""Structured output in the executor: each constrained sequence's llguidance matcher, fed
the sequence's output as it is sampled, and the token masks they give applied to the
logits before sampling (after penalties, so no bias or penalty can bring back a token
the language forbids; logprobs are taken before either, the model's own distribution).

The executor owns a sequence's sampled tokens, so the matcher advances here, in the step
that sampled them, and the scheduler plans the next step without knowing them (the
overlapped path needs nothing more). A sequence the executor learns again (recomputed
after preemption, or a fork of ``n`` > 1) rebuilds its matcher from the grammar and the
output so far. llguidance is imported on the first constrained sequence."""
from __future__ import annotations

import math
from collections import OrderedDict
from typing import TYPE_CHECKING, Callable

import numpy as np
import torch

from components.executor.sampling import _native

if TYPE_CHECKING:           # (torch and numpy alone here: scripts/gpu_check runs this file)
    from schemas.client import StructuredOutput


class Constraint:
    """One sequence's place in its language."""

    __slots__ = ("matcher",)

    def __init__(self, matcher, output: list[int]) -> None:
        self.matcher = matcher
        if output:                          # recomputed, or a fork: catch up
            matcher.consume_tokens(output)

    def advance(self, token: int) -> None:
        """The sequence sampled ``token``. A language that is complete allows EOS alone
        from then on (with ``ignore_eos`` the sequence samples EOS until ``max_tokens``)."""
        self.matcher.consume_token(token)

    def fill(self, row: np.ndarray) -> None:
        """The tokens allowed next as bits into ``row``, an int32 array (token ``t`` is
        bit ``t % 32`` of word ``t // 32``). A matcher in its error state (its language
        past llguidance's limits on the tokens it met, or one the tokenizer should have
        refused; never a sampled token, which the mask allowed) allows EOS alone, so the
        sequence ends instead of drawing from an empty row."""
        self.matcher.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)


class Grammars:
    """Matchers for constrained sequences: the vocabulary built once (``vocab()``, on first
    use), and a fresh matcher per language kept (up to ``keep``), copied for each sequence
    that asks for it (requests of one service send the same schema again and again)."""

    def __init__(self, vocab: Callable[[], object], keep: int = 64) -> None:
        self._vocab_fn, self._vocab = vocab, None
        self._fresh: OrderedDict[StructuredOutput, object] = OrderedDict()
        self.keep = keep

    def constraint(self, so: StructuredOutput, output: list[int]) -> Constraint:
        import structlog
        from llguidance import LLMatcher

        from components.tokenizer.structured import grammar_of, limits

        log = structlog.get_logger("executor")

        if self._vocab is None:
            self._vocab = self._vocab_fn()
        fresh = self._fresh.get(so)
        if fresh is None:
            # the tokenizer refuses what fails here before it runs; if one did, the
            # matcher's error state ends the sequence (the log names no part of it: a
            # schema is the user's)
            try:
                fresh = LLMatcher(self._vocab, grammar_of(so), log_level=0, limits=limits())
            except ValueError:
                fresh = LLMatcher(self._vocab, "start: (", log_level=0)
            if fresh.is_error():
                log.error("structured_output_unusable")
            self._fresh[so] = fresh
            while len(self._fresh) > self.keep:
                self._fresh.popitem(last=False)
        self._fresh.move_to_end(so)
        return Constraint(fresh.deep_copy(), output)


def apply_constraints(logits: torch.Tensor, rows: list[tuple[int, Constraint]],
                      native: bool = True) -> None:
    """Set every token ``rows``' languages forbid to -inf in ``logits`` ``[S, vocab]``
    (in place), for each ``(row, constraint)``: natively on the CPU (kernels/csrc/
    cpu_sampling.cpp), else unpacked and filled by torch (a GPU). 64 rows held to JSON
    objects, 2-core AVX512 EPYC: 0.7 ms with the masks' making, 11.8 through torch; a
    batch-64 bf16 decode step, every row held to JSON: +13.2 ms through torch, within the
    noise natively (``scripts/bench_step.py --penalties 64``)."""
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
