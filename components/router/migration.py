"""Continuing a request on another replica, pure: whether it can be, what it is sent as,
what its client hears of it, and whether a draining replica's request moves or finishes
where it is. No sockets and no clock of its own (the service passes ``now``).

**Where the state lives.** The router: each ``Flight`` keeps the prompt's token ids (intake
tokenizes every prompt as a replica would, to hash its blocks) and the output token ids it
has relayed to the client (``TextDelta.token_ids``), besides the client's ``Submit`` (its
sampling parameters and seed). A replica that dies takes nothing the router needs with it.

**Recompute.** A continuation is a ``Submit`` whose ``prompt_token_ids`` are the prompt's
ids then the output relayed so far (``k`` tokens), with ``max_tokens`` and ``min_tokens``
less ``k`` and ``SamplingParams.output_offset`` = ``k``: the executor draws output token
``i`` of the continuation as token ``k + i`` of the original (sampling.py: a seeded draw's
noise depends on (seed, output index) alone), so a seeded request continues the same random
stream and a greedy one the same argmax. Its placement is the routing core's, cache-aware,
with the continuation's own block hashes (a replica that holds the prompt's prefix is
preferred). Why a longer prompt and not a "resumed output" the replica appends after the
prompt: a prompt is the one thing every replica already takes, checks, hashes, reserves for
and prefills; the offset is the one place the output index is read.

**The invariant.** The last ``output_offset`` tokens of a continuation's prompt are output
the request already emitted (``SamplingParams.output_offset``; clamped to the prompt). A
replica treats them as output wherever output matters: the presence and frequency
penalties count them (the repetition penalty reads prompt and output alike); the
structured-output matcher is advanced over them before the first new token (a language
that rejects them fails the request, never samples past them silently); the detokenizer
takes their tail as text already emitted, so its first new text is exactly the text that
follows (a character split across the handover, a decoder's left context) and a stop
string that began in them is still caught, and a ``min_tokens`` is less what they
already count. So a request with stop strings, penalties or structured output continues
exactly as it would have run, and the replica, not the router, matches its stop strings
(the router's terminal counts what it relayed, as for any other).

**What does not move.** Prompt logprobs are the prompt's, sent with the first output: once
any output was relayed the client has them and the continuation does not ask again;
before, it is the same prompt and asks. ``n`` > 1 moves only before its first output is
relayed (the continuation is then the request itself): after, each choice has its own
output, and one Submit has one prompt, so continuing them is one continuation per choice
(choice ``j`` seeded ``seed + j`` as the executor seeds it), each its own placement under
one client request: a lease per choice, the terminals and usage merged, which this lease
does not hold. Such a request fails ``replica_lost`` as before. A request not tokenized at
the router cannot be continued either.

**The lease.** Each placement is (replica, wire id): the first is the client's request id,
each migration takes a fresh one (``wire_id``) that no client can name. An event is taken
only from the flight's replica under its current wire id; anything else is an old
placement's (counted ``late_events``, dropped), so two replicas never both feed a stream,
and the router cancels the old placement before it submits the new one.

**The client's view.** One ``Accepted``; deltas from the old placement, then from the new,
each token once (the continuation starts at the first token not relayed); one terminal,
whose usage counts the original prompt and every output token.

**Drain: migrate or finish in place** (``drain_choice``). Staying costs the expected
remaining time ``remaining x tpot`` on the draining replica, and loses the stream outright
if that passes the replica's drain deadline; moving costs the recompute of prompt + output
on the target (its prefill rate) and the handover. A request moves when it would be lost,
or when its remaining time exceeds the full cost of the move (short ones finish in place).
"""
from __future__ import annotations

import math
from typing import Any

import msgspec

from components.router.routing import Flight
from schemas.client import ChoiceEnd, Finished, Submit, Usage

WIRE_ID_CHARS = 200                  # of the client's id in a migration's wire id
HANDOVER_S = 0.05                    # the client-visible stall of a move, besides prefill
UNBOUNDED_TOKENS = 1 << 20           # remaining tokens of a request with no max_tokens


def resumable(f: Flight) -> str | None:
    """Why ``f`` cannot be continued on another replica (None: it can)."""
    if f.prompt_ids is None:
        return "its prompt was not tokenized"
    if f.cancelled:
        return "cancelled"
    if f.submit.params.n != 1 and f.out_ids:
        return "n > 1 with output relayed"
    return None


def remaining_tokens(f: Flight) -> int:
    """Output tokens ``f`` may still produce (``max_tokens`` less what was relayed)."""
    mt = f.submit.params.max_tokens
    return UNBOUNDED_TOKENS if mt is None else max(mt - len(f.out_ids), 0)


def wire_id(request_id: str, nonce: str, serial: int) -> str:
    """A migration's id for ``request_id`` at the replica: no client's own (the router's
    ``nonce`` and a serial), within the id limit."""
    return f"{request_id[:WIRE_ID_CHARS]}~{nonce}.{serial}"


def continuation(f: Flight, now: float) -> Submit:
    """The Submit that continues ``f`` under its current wire id: prompt and relayed output
    as the prompt, the caps less what was relayed, the output offset by it (the module
    doc's invariant); prompt logprobs only if no output was relayed; what is left of its
    end-to-end deadline (its TTFT deadline, if it has its first token, is met)."""
    sub, p, k = f.submit, f.submit.params, len(f.out_ids)
    assert f.prompt_ids is not None
    params = msgspec.structs.replace(
        p, max_tokens=None if p.max_tokens is None else p.max_tokens - k,
        min_tokens=max(p.min_tokens - k, 0), output_offset=p.output_offset + k,
        prompt_logprobs=None if k else p.prompt_logprobs)

    def left(ms: int | None) -> int | None:
        return None if ms is None else max(int(ms - (now - f.arrival) * 1e3), 1)
    return msgspec.structs.replace(
        sub, request_id=f.wire_id, prompt=None, messages=None, tools=(),
        prompt_token_ids=f.prompt_ids + f.out_ids, params=params, idempotency_key=None,
        batch_events=False, deadline_ms=None if k else left(sub.deadline_ms),
        e2e_deadline_ms=left(sub.e2e_deadline_ms))


def relabel(f: Flight, body: Any) -> Any:
    """A migrated request's event as its client sees it: under its own id; its terminal's
    usage the original prompt and every output token relayed (n > 1 moves only before
    its first output: its continuation's own counts are the request's)."""
    if isinstance(body, Finished):
        n = len(f.out_ids)
        prompt = len(f.prompt_ids or ())
        one = f.submit.params.n == 1
        choices = tuple(ChoiceEnd(c.index, c.finish_reason, n) for c in body.choices) \
            if one else body.choices
        body = msgspec.structs.replace(
            body, usage=Usage(prompt, n if one else body.usage.completion_tokens,
                              min(body.usage.cached_tokens, prompt)), choices=choices)
    return msgspec.structs.replace(body, request_id=f.request_id)


def finished_here(f: Flight) -> Finished:
    """``f`` has every token its cap allows but no terminal yet: it ends at the router."""
    n = len(f.out_ids)
    return Finished(f.request_id, "length", Usage(len(f.prompt_ids or ()), n),
                    choices=(ChoiceEnd(0, "length", n),))


def drain_choice(remaining: int, tpot_s: float, time_left_s: float, recompute_tokens: int,
                 prefill_rate: float, handover_s: float = HANDOVER_S) -> tuple[bool, str]:
    """Move a request off a draining replica (True) or let it finish there (False), and
    why: compare the loss a move avoids with the move's full cost (module doc)."""
    finish_s = remaining * tpot_s
    cost_s = recompute_tokens / max(prefill_rate, 1e-9) + handover_s
    if finish_s > time_left_s:
        return True, "past_drain_deadline"
    if finish_s > cost_s:
        return True, "cheaper_to_move"
    return False, "finishes_in_place"


def request_tpot_s(first_token_at: float, tokens: int, now: float,
                   fallback_s: float) -> float:
    """``f``'s own time per output token so far (``fallback_s`` before it has two)."""
    if tokens < 2 or not first_token_at:
        return fallback_s
    return max((now - first_token_at) / (tokens - 1), 1e-4)


def percentile(xs: list[float], q: float) -> float:
    if not xs:
        return 0.0
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))]
