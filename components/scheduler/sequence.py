"""A sequence as the scheduler sees it, and its lifecycle as one explicit state machine.

A sequence's state says at once where it sits (the waiting queue, the running set, neither)
and where its KV lease stands at the kv_manager (none, asked, held, refused, on the host
tier, being moved). Every change of state goes through ``Seq.to(event)``, which looks the
move up in ``TRANSITIONS``, the one place the lifecycle is written down; a move that is not
there raises ``IllegalTransition``.

Events:
- ``ASK``: the core asks the kv_manager for blocks: a first lease, growth, or a swap-in.
- ``GRANT`` / ``REFUSE``: the kv_manager's answer to what was asked (``REFUSE`` of a fork
  sends the choice back to compute from scratch; a refused swap-out is a ``RECOMPUTE``).
- ``SCHEDULE``: a ready sequence joins the running set.
- ``RETRY``: a sequence whose growth was refused can still progress on what it holds.
- ``SWAP_OUT``: preempted to the host tier. ``RECOMPUTE``: preempted (or sent back) by
  freeing its blocks; it starts again from the queue under a fresh seq id.
- ``FINISH``: it ended (finished, stopped, cancelled, failed). A sequence with an answer
  still in flight is ``CLOSING`` until that answer arrives, so its lease can be freed.

Steps in flight (``scheduler.async_depth`` 2: step N+1 is planned while step N runs) are
not states: each sequence keeps the steps it is in that have not answered yet
(``Seq.in_flight``), and plans from its *planned* position (``planned``,
``planned_tokens``). ``may_plan_ahead`` says whether it may be planned again before those
steps answer (``PLANS_AHEAD`` below).
"""
from __future__ import annotations

import enum
from collections import deque
from dataclasses import dataclass, field
from typing import NamedTuple

from schemas.wire import HeldRequest, RequestHeader, SampleLogprobs, SamplingParams


class State(enum.Enum):
    # in the waiting queue
    WAITING = "waiting"            # no lease, nothing asked
    LEASING = "leasing"            # first lease asked
    REFUSED = "refused"            # the pool refused the first lease; asked again later
    READY = "ready"                # lease held, not yet running
    SWAPPING_OUT = "swapping_out"  # preempted: its blocks are being copied to the host tier
    SWAPPED = "swapped"            # its computed blocks live on the host tier
    SWAPPING_IN = "swapping_in"    # swap-in asked
    SWAP_REFUSED = "swap_refused"  # swap-in refused (no room yet); asked again later
    # in the running set
    RUNNING = "running"            # lease held, nothing asked
    GROWING = "growing"            # more blocks asked
    STALLED = "stalled"            # growth refused: progress on what it holds, or preempt
    FORKING = "forking"            # an n > 1 choice waiting for its copy-on-write fork
    # ended
    CLOSING = "closing"            # ended with an answer in flight
    DONE = "done"


class Event(enum.Enum):
    ASK = "ask"
    GRANT = "grant"
    REFUSE = "refuse"
    SCHEDULE = "schedule"
    RETRY = "retry"
    SWAP_OUT = "swap_out"
    RECOMPUTE = "recompute"
    FINISH = "finish"


S, E = State, Event
TRANSITIONS: dict[State, dict[Event, State]] = {
    S.WAITING: {E.ASK: S.LEASING, E.FINISH: S.DONE},
    S.LEASING: {E.GRANT: S.READY, E.REFUSE: S.REFUSED, E.FINISH: S.CLOSING},
    S.REFUSED: {E.ASK: S.LEASING, E.FINISH: S.DONE},
    S.READY: {E.SCHEDULE: S.RUNNING, E.SWAP_OUT: S.SWAPPING_OUT, E.RECOMPUTE: S.WAITING,
              E.FINISH: S.DONE},
    S.SWAPPING_OUT: {E.GRANT: S.SWAPPED, E.RECOMPUTE: S.WAITING, E.FINISH: S.CLOSING},
    S.SWAPPED: {E.ASK: S.SWAPPING_IN, E.FINISH: S.DONE},
    S.SWAPPING_IN: {E.GRANT: S.READY, E.REFUSE: S.SWAP_REFUSED, E.FINISH: S.CLOSING},
    S.SWAP_REFUSED: {E.ASK: S.SWAPPING_IN, E.FINISH: S.DONE},
    S.RUNNING: {E.ASK: S.GROWING, E.SWAP_OUT: S.SWAPPING_OUT, E.RECOMPUTE: S.WAITING,
                E.FINISH: S.DONE},
    S.GROWING: {E.GRANT: S.RUNNING, E.REFUSE: S.STALLED, E.RECOMPUTE: S.WAITING,
                E.FINISH: S.CLOSING},
    S.STALLED: {E.RETRY: S.RUNNING, E.SWAP_OUT: S.SWAPPING_OUT, E.RECOMPUTE: S.WAITING,
                E.FINISH: S.DONE},
    S.FORKING: {E.GRANT: S.RUNNING, E.REFUSE: S.WAITING, E.RECOMPUTE: S.WAITING,
                E.FINISH: S.CLOSING},
    S.CLOSING: {E.GRANT: S.DONE, E.REFUSE: S.DONE},
    S.DONE: {},
}
del S, E

QUEUED = frozenset({State.WAITING, State.LEASING, State.REFUSED, State.READY,
                    State.SWAPPING_OUT, State.SWAPPED, State.SWAPPING_IN, State.SWAP_REFUSED})
IN_RUNNING_SET = frozenset({State.RUNNING, State.GROWING, State.STALLED, State.FORKING})
ENDED = frozenset({State.CLOSING, State.DONE})
HOLDS_LEASE = frozenset({State.READY, State.SWAPPING_OUT, State.SWAPPED, State.SWAPPING_IN,
                         State.SWAP_REFUSED, State.RUNNING, State.GROWING, State.STALLED})
AWAITING = frozenset({State.LEASING, State.SWAPPING_OUT, State.SWAPPING_IN, State.GROWING,
                      State.FORKING, State.CLOSING})
ON_HOST = frozenset({State.SWAPPING_OUT, State.SWAPPED, State.SWAPPING_IN, State.SWAP_REFUSED})

TENANT_BUDGET = "tenant_kv_budget"      # the kv_manager's reason for a budget refusal


# the states a sequence may be in when it is planned again while a step it is in runs
PLANS_AHEAD = frozenset({State.RUNNING, State.GROWING})


class IllegalTransition(RuntimeError):
    pass


class InFlight(NamedTuple):
    """One step a sequence is in, sent to the executor and not answered yet."""

    step_id: int
    tokens: int            # tokens it computes for the sequence
    samples: int           # tokens it samples for it that the core will append (0 or 1)
    drafts: int = 0        # draft tokens it may verify (speculation: it emits 1 + accepted)


# every (state, event) the core has taken, when ``record_transitions`` is on: tests check
# that a randomized run covers the whole table
record_transitions = False
taken: set[tuple[State, Event]] = set()


@dataclass(eq=False)
class Seq:
    """One choice of a request. Its identity and terms are the request's header as
    admission granted it (``Admitted.header``), shared by the request's choices and read
    through (``request_id``, ``tenant``, ``params``, ``arrival_ns``, ``priority``,
    ``deadline_ns``, ``tpot_slo_s``, ``service_class``), never copied."""

    seq_id: int
    header: RequestHeader
    prompt_len: int
    token_ids: list[int]
    block_hashes: list[int]
    eos_token_ids: frozenset[int]
    state: State = State.WAITING
    num_computed: int = 0
    block_ids: list[int] = field(default_factory=list)
    blocks_sent: int = 0           # how many of block_ids the executor already knows
    refusal: str = ""              # why the last lease or growth was refused ("pool_full", ...)
    frees_at_request: tuple[int, int] = (0, 0)   # frees (all, its tenant) when last asked
    known_to_executor: bool = False
    cached_tokens: int = 0
    outputs_sent: int = 0          # output tokens already handed to the detokenizer
    preemptions: int = 0
    first_scheduled_ns: int = 0
    ingress_ns: int = 0             # arrival → the engine's queues, less admission's queue
    first_token_ns: int = 0
    index: int = 0                 # which of the request's n choices
    aging_per_s: float = 0.0       # priority units its class gains per second waited
    public_scope: str = ""
    public_blocks: int = 0
    held: HeldRequest | None = None  # admission's ledger entry (the request's first seq only)
    rescued: bool = False          # an urgency preemption made room for it: it goes first
    forked: bool = False           # n > 1: the first sample (and the fork) happened
    group: list[Seq] = field(default_factory=list)   # every choice of the request
    # prompt_logprobs so far, for positions 1.. of the prompt (the executor's chunks, in
    # order; a chunk recomputed after preemption is not taken twice); None when not owed
    # (not asked for, or sent with the request's first token)
    prompt_lps: list[SampleLogprobs] | None = None
    # the steps it is in that have not answered, oldest first; cleared when it leaves the
    # running set (finished, preempted), so what those steps compute for it is discarded
    in_flight: deque[InFlight] = field(default_factory=deque)
    # speculation: its verifies' accepted draft tokens and the rejections that ended them
    spec_hits: int = 0
    spec_misses: int = 0
    spec_idle: int = 0             # decodes planned without drafts since its last verify

    @property
    def request_id(self) -> str:
        return self.header.request_id

    @property
    def tenant(self) -> str:
        return self.header.tenant

    @property
    def params(self) -> SamplingParams:
        return self.header.params

    @property
    def arrival_ns(self) -> int:
        """Wall clock, the streamer's (``RequestHeader``)."""
        return self.header.arrival_ns

    @property
    def priority(self) -> int:
        """Lower is more important (its class's, or lower, as admitted)."""
        return self.header.priority

    @property
    def deadline_ns(self) -> int:
        """Its first token is due by then (wall clock, ``arrival_ns``'s); 0: none."""
        return self.header.ttft_deadline_ns or 0

    @property
    def deterministic(self) -> bool:
        """It runs batch-invariantly (``SamplingParams.deterministic`` as in force): fixed
        chunk boundaries (determinism.py), no drafts, and every step it is in runs the
        batch-invariant kernel plan."""
        return self.header.params.deterministic

    @property
    def tpot_slo_s(self) -> float | None:
        """Its class's time-per-output-token objective, seconds (None: none)."""
        slo = self.header.tpot_slo_ms
        return slo / 1e3 if slo else None

    @property
    def service_class(self) -> str:
        """The class admission granted ("": none named)."""
        return self.header.granted_class or ""

    def to(self, event: Event) -> State:
        nxt = TRANSITIONS[self.state].get(event)
        if nxt is None:
            raise IllegalTransition(f"seq {self.seq_id} ({self.request_id}): "
                                    f"{event.value} in state {self.state.value}")
        if record_transitions:
            taken.add((self.state, event))
        self.state = nxt
        return nxt

    def aged_priority(self, now_ns: int) -> int:
        """The class it ranks with at ``now_ns``: its priority less the whole units its
        class's ``aging_per_s`` has earned since arrival (admission's aging, continued; a
        batch request, priority 1 aging 1/60, ranks with interactive work, 0, after 60 s
        and ahead of it after 120 s). Its priority while ``now_ns`` is 0 (unknown)."""
        if not self.aging_per_s or now_ns <= self.arrival_ns:
            return self.priority
        return self.priority - int(self.aging_per_s * ((now_ns - self.arrival_ns) / 1e9))

    @property
    def resumes(self) -> bool:
        """Rescued by urgency, or back from preemption: it starts before any fresh work
        (``Queues.fair_order``)."""
        return self.rescued or bool(self.preemptions) or self.state in ON_HOST

    @property
    def ended(self) -> bool:
        return self.state in ENDED

    @property
    def holds_lease(self) -> bool:
        return self.state in HOLDS_LEASE

    @property
    def awaiting(self) -> bool:
        """An answer from the kv_manager is in flight."""
        return self.state in AWAITING

    @property
    def n(self) -> int:
        return self.params.n

    @property
    def slots(self) -> int:
        """Running sequences it stands for: an n > 1 request counts n until it forks."""
        return 1 if self.forked else self.params.n

    @property
    def owes_prompt_logprobs(self) -> bool:
        """It asked for prompt_logprobs and has not sent them (they go with the request's
        first token): its prompt must be computed, not read from the prefix cache."""
        return self.prompt_lps is not None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output(self) -> int:
        return len(self.token_ids) - self.prompt_len

    @property
    def remaining(self) -> int:
        return len(self.token_ids) - self.num_computed

    def capacity(self, block_size: int) -> int:
        return len(self.block_ids) * block_size

    # -- planning ahead of the steps in flight
    @property
    def planned(self) -> int:
        """Its position once the steps in flight are done: ``num_computed`` plus the tokens
        they compute for it (what the next step it is in starts from)."""
        return self.num_computed + sum(f.tokens for f in self.in_flight)

    @property
    def planned_tokens(self) -> int:
        """Its length once the steps in flight are done: each sampling step appends a token
        that only the executor knows until the step answers (the executor feeds it as the
        next step's input, so the plan needs no token, only a count)."""
        return len(self.token_ids) + sum(f.samples for f in self.in_flight)

    @property
    def todo(self) -> int:
        """Tokens left to plan (``remaining``, counting the steps in flight as done)."""
        return self.planned_tokens - self.planned

    def may_plan_ahead(self, max_model_len: int) -> bool:
        """May it be planned in a step while steps it is in are still in flight? Always, if
        it is in none. Otherwise it sits out unless it is plainly running (``PLANS_AHEAD``:
        not stalled, not forking), and, if a step in flight samples for it, unless that
        sample may change what it is: the first sample of an n > 1 request forks it, and a
        sample that reaches ``max_tokens`` or ``max_model_len`` ends it for certain (so no
        step is spent on a token that would be thrown away). A sample that may be EOS or a
        stop token is planned past; if it does end it, the next step's sample is discarded."""
        if not self.in_flight:
            return True
        if self.state not in PLANS_AHEAD or any(f.drafts for f in self.in_flight):
            return False                      # (how many tokens a verify emits is unknown)
        samples = sum(f.samples for f in self.in_flight)
        if not samples:
            return True                       # a prefill chunk in flight: the next one may go
        if self.n > 1 and not self.forked:
            return False
        cap = self.params.max_tokens
        if cap is not None and self.num_output + samples >= cap:
            return False
        return self.num_tokens + samples < max_model_len


def in_running(seq: Seq) -> bool:
    return seq.state in IN_RUNNING_SET
