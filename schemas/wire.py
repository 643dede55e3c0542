"""Every message that crosses the bus, grouped by the process that receives it.

Wire types are frozen msgspec Structs with ``tag=True``; each receiving socket
decodes with a ``Decoder(Envelope[Union])`` over exactly the union it accepts,
so an unknown or malformed message fails at the socket, never deeper.

Client-facing types live in ``schemas/client.py`` (re-exported here); hot-path internal
types (and the items they carry) are ``gc=False``; hot items are ``array_like``.

A request's identity and terms are one ``RequestHeader``, carried by composition by
``NewRequest``, ``Tokenized`` and ``Admitted`` (and held by the scheduler's ``Seq``).

Over 400 lines on purpose: this is the bus's whole internal vocabulary, one table a reader
scans by inbox; split, a message's neighbours on its socket would be in another file.
"""
from __future__ import annotations

from typing import Generic, TypeVar

import msgspec

from schemas.client import (  # noqa: F401 - the client protocol, re-exported
    Accepted,
    Cancel,
    Cancelled,
    ChatMessage,
    ChoiceEnd,
    ClientMsg,
    ComponentStatus,
    Failed,
    Finished,
    FinishReason,
    Heartbeat,
    PromptLogprobs,
    ProtocolError,
    Rejected,
    RejectReason,
    RequestTiming,
    SamplingParams,
    ServerHeartbeat,
    ServerMsg,
    StatusQuery,
    StatusReport,
    StructuredOutput,
    Submit,
    TenantUsage,
    Terminal,
    TextDelta,
    TokenLogprob,
    Tool,
    ToolCall,
    TopLogprob,
    Usage,
)
from schemas.config_change import PolicySections

T = TypeVar("T")


class Envelope(msgspec.Struct, Generic[T], frozen=True, array_like=True, gc=False):
    """Wraps every body on the wire: a message id, the send time and W3C trace context."""

    msg_id: int
    sent_ns: int
    traceparent: str | None
    body: T


# ---------------------------------------------------------------- a request's header

NO_DEADLINE_NS = 2**63 - 1      # an absolute deadline is clamped to it (int64 on the wire)


def deadline_ns(arrival_ns: int, ms: float | None) -> int | None:
    """The absolute deadline ``ms`` milliseconds after ``arrival_ns`` (None: none), in
    ``arrival_ns``'s clock, clamped to ``NO_DEADLINE_NS`` (a deadline centuries away)."""
    if ms is None:
        return None
    return min(arrival_ns + round(ms) * 1_000_000, NO_DEADLINE_NS)


class RequestHeader(msgspec.Struct, frozen=True, gc=False):
    """A request's identity and terms, built once, by the streamer that took its ``Submit``,
    and carried unchanged by every message of its path (``NewRequest``, ``Tokenized``,
    ``Admitted``) and by the scheduler's ``Seq``. Admission is the one place it changes:
    what it grants replaces what was asked (``msgspec.structs.replace`` on the header):
    ``granted_class`` and its ``tpot_slo_ms``, the ``priority`` and deadlines in force and
    a capped ``params.max_tokens``.

    One clock: ``arrival_ns`` is the wall clock (``time.time_ns``) of the streamer's
    machine when the request arrived, and both deadlines are absolute in that clock.
    Every process that reads them runs beside that streamer (one machine, one engine).
    A deadline crosses a router the other way: the client-facing ``Submit`` carries it
    relative (milliseconds from arrival), the router forwards ``Submit`` (on a reroute,
    with what is left of it), and the replica's streamer makes it absolute on arrival,
    so no two machines' clocks are ever compared."""

    request_id: str
    tenant: str
    params: SamplingParams
    arrival_ns: int                       # the streamer's wall clock at arrival
    priority: int = 0                     # lower is more important; admitted: as granted
    asked_class: str | None = None        # the class the client asked for (None: none)
    granted_class: str | None = None      # the class admission granted (None: not yet)
    # first token due by then (arrival_ns's clock): the client's own, then, admitted, the
    # one in force (its own, else its class's ttft_slo_ms: schemas.resolve); None: none
    ttft_deadline_ns: int | None = None
    # the whole request ends by then: the client's own, then, admitted, the one in force
    # (the tighter of its own and its class's e2e_slo_ms); None: none
    e2e_deadline_ns: int | None = None
    tpot_slo_ms: float | None = None      # the granted class's TPOT SLO (None: none/not yet)
    # the scheduler may give it draft tokens (speculative decoding); admission turns it off
    # for a degraded request (the first seed's "disable speculative decoding")
    speculate: bool = True

    @property
    def ttft_deadline_ms(self) -> int | None:
        """``ttft_deadline_ns`` as milliseconds from arrival (None: none)."""
        return _from_arrival_ms(self.arrival_ns, self.ttft_deadline_ns)

    @property
    def e2e_deadline_ms(self) -> int | None:
        """``e2e_deadline_ns`` as milliseconds from arrival (None: none)."""
        return _from_arrival_ms(self.arrival_ns, self.e2e_deadline_ns)


def _from_arrival_ms(arrival_ns: int, at_ns: int | None) -> int | None:
    return None if at_ns is None else (at_ns - arrival_ns) // 1_000_000


class _Carries(msgspec.Struct, frozen=True):
    """A message that carries a request's header: its id, tenant and parameters read
    through to it."""

    header: RequestHeader

    @property
    def request_id(self) -> str:
        return self.header.request_id

    @property
    def tenant(self) -> str:
        return self.header.tenant

    @property
    def params(self) -> SamplingParams:
        return self.header.params


# ---------------------------------------------------------------- tokenizer inbox

class NewRequest(_Carries, tag="new_request", frozen=True):
    prompt: str | None
    messages: tuple[ChatMessage, ...] | None
    prompt_token_ids: list[int] | None = None
    tools: tuple[Tool, ...] = ()          # Submit.tools, for the chat template


class CancelRequest(msgspec.Struct, tag="cancel_request", frozen=True):
    """Follows a request's own path (streamer → tokenizer → admission → scheduler),
    so it can never overtake the request it cancels."""

    request_id: str
    reason: str


TokenizerMsg = NewRequest | CancelRequest


class BlockCopy(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """Copy KV block ``src`` to block ``dst``. Ids below the pool's ``num_blocks`` are the
    executor's main KV pool; the rest are its host-memory tier (``id - num_blocks``)."""

    src: int
    dst: int


# ---------------------------------------------------------------- admission inbox

class Tokenized(_Carries, tag="tokenized", frozen=True, gc=False):
    """A request in tokens: prompt ids, per-tenant prefix block hashes, the model's eos ids."""

    prompt_token_ids: list[int]
    block_hashes: list[int]
    eos_token_ids: tuple[int, ...] = ()
    public_scope: str = ""            # the first public_blocks blocks are a shared public prefix
    public_blocks: int = 0


class TenantBacklog(msgspec.Struct, frozen=True, array_like=True):
    """One tenant in the scheduler's load report: where its work stands in the order new
    work starts (class first, then VTC within a class: ``planning._fair_order``).

    The split by class keys each part by the class it ranks with at the report (its
    priority, aged: ``Seq.aged_priority``). ``resumed_prefill_tokens`` is the part of the
    waiting prefill back from preemption (or rescued by urgency), which starts before any
    fresh work; ``queued_by_class`` splits the rest, ``running_by_class`` the prefill its
    running sequences have left. A scheduler that predates the split sends neither (they
    decode empty, and admission then ranks the tenant's work as one class)."""

    counter: float                   # its virtual counter (weighted service received)
    backlogged: bool = False         # counted as backlogged: a new request is not lifted
    queued_prefill_tokens: int = 0   # what its waiting sequences still need computed
    running_prefill_tokens: int = 0  # what its running sequences have left to prefill
    resumed_prefill_tokens: int = 0
    queued_by_class: dict[int, int] = {}
    running_by_class: dict[int, int] = {}


class DecodeRates(msgspec.Struct, frozen=True, array_like=True):
    """The step-cost model's price of a decode step, linear in its shape: ``base_s +
    per_seq_s × sequences + per_context_s × KV positions read``, so admission can
    extrapolate the step to a batch it has not run."""

    base_s: float
    per_seq_s: float
    per_context_s: float


class SchedulerLoad(msgspec.Struct, tag="scheduler_load", frozen=True):
    """The scheduler's view of its backlog, sent to admission a few times a second so
    admission can predict time to first token. ``queued_prefill_tokens`` counts every
    tenant's waiting prefill and the running sequences' remaining prefill; ``tenants`` splits
    it by tenant (empty from a scheduler that predates it).

    Prefill is priced in two parts: its tokens at ``prefill_tokens_per_s`` (a full chunk's
    rate, attention aside) and its attention at ``attention_s_per_pair`` per pair (query
    row × key it sees: a prompt of ``P`` new tokens after ``C`` cached has ``P·C +
    P(P+1)/2``), so a long context is not priced at a rate measured at zero context.
    ``queued_prefill_pairs`` are the backlog's pairs.

    The live engine, for admission's KV room and decode horizon (every field has a
    default, so a report from a scheduler that predates them decodes, and admission then
    checks neither): the pool as the kv_manager last reported it (``kv_free_blocks``:
    what a lease can take now, evictable blocks included; ``kv_evictable_blocks``: of
    those, the cached prefixes no sequence references, reclaimed on demand; -1: not
    reported yet), the running batch's context (``running_context``: KV positions a decode
    step of it reads), the cost model's ``decode_rates``, and what the decode steps of the
    last few seconds measured: their mean time (``decode_measured_s``), measured ÷
    predicted over them (``decode_error``), and per class the mean time of the steps its
    decoding sequences were in (``tpot_s``: its streams' time per output token)."""

    running: int
    waiting: int
    queued_prefill_tokens: int
    prefill_tokens_per_s: float      # 0 until the step cost model has a prior or data
    decode_step_s: float
    tenants: dict[str, TenantBacklog] = {}
    # arrival → now of each request still without its first token (at most AWAITING_MAX,
    # the longest waiting first): admission sees an overrun prediction while it happens,
    # not a first token later
    awaiting_first_s: dict[str, float] = {}
    attention_s_per_pair: float = 0.0
    queued_prefill_pairs: int = 0
    kv_free_blocks: int = -1
    kv_evictable_blocks: int = -1
    running_context: int = 0
    decode_rates: DecodeRates | None = None      # None: the cost model has no rates yet
    decode_measured_s: float = 0.0               # 0: no decode step in the window
    decode_error: float = 1.0
    tpot_s: dict[str, float] = {}
    decode_steps: int = -1    # decode-only steps in the window, decode_error's (-1: not said)
    # the tokens a step may take now: stall-free chunking's cap beside the decoding streams
    # (0: the configured max_num_batched_tokens). Prefill ahead of a new prompt moves at
    # this many tokens a step, not the whole budget, while streams decode beside it
    prefill_budget: int = 0
    # the rates above are the batch-invariant plan's (a deterministic request is held, so
    # the steps run that plan), and that plan's time over the fast plan's: admission
    # prices a new deterministic request's prefill at this factor when they are not
    deterministic: bool = False
    deterministic_factor: float = 1.0


class Released(msgspec.Struct, tag="released", frozen=True, gc=False):
    """The scheduler no longer holds these requests (finished, cancelled or failed)."""

    request_ids: list[str]
    output_tokens: dict[str, int] = {}   # tokens generated, for those that finished (all choices)
    ttft_s: dict[str, float] = {}        # arrival → first token, as the engine saw it


class HeldRequest(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """Admission's ledger entry for one admitted request: what its ledger added when it
    admitted it, and what ``Released`` subtracts. Admission hands it to the scheduler with
    the request (``Admitted.held``), and the scheduler hands it back in ``Holding``.

    ``kv_blocks`` is admission's reservation (uncached prompt + n x expected output, from
    its estimate; 0 under ``fcfs``), not the blocks the sequences hold now. The ledger checks
    budgets against reservations: a request mid-prefill holds a few blocks, one preempted
    or swapped out none, and prefix-shared blocks belong to no one request, so a ledger
    rebuilt from live counts would admit past ``kv_blocks`` budgets and the pool and
    leave the growth to preemption. The reservation also makes the restarted ledger
    equal to the one that was lost."""

    request_id: str
    tenant: str
    service_class: str
    n: int
    kv_blocks: int
    predicted_ttft_s: float | None = None   # the backlog model's TTFT at admission (its bias)


class Holding(msgspec.Struct, tag="holding", frozen=True, gc=False):
    """The scheduler's requests, sent to a restarted admission so its ledger (outstanding
    counts, running sequences, reserved KV blocks, by tenant and class) starts from what
    is really held, exactly as the lost one had it, not from zero."""

    requests: list[HeldRequest]


class CacheAnswer(msgspec.Struct, tag="cache_answer", frozen=True):
    """The kv_manager's answer to a CacheQuery: prompt tokens already in the cache (verified)."""

    request_id: str
    cached_tokens: int


class PolicyTrial(msgspec.Struct, frozen=True):
    """A candidate config on trial beside the settled one: its version, its sha256 and its
    sections (``sections.rollout``: shadow or canary, the canary's share)."""

    version: int
    sha256: str
    sections: PolicySections


class PolicyChange(msgspec.Struct, tag="policy_change", frozen=True):
    """From the streamer to admission and the scheduler: the policy of config ``version``
    (``schemas/config_change.py``), in force from the next decision each makes. What
    either already decided stands: a request keeps the class, deadline and priority it
    was admitted with; per-tenant state (budgets, token buckets, virtual counters)
    carries over by tenant name. ``trial``: a candidate beside it, for admission alone
    (shadow: decided beside every request and not enforced; canary: deciding for the
    tenants in its share); the scheduler runs ``sections``."""

    version: int
    sha256: str
    sections: PolicySections
    trial: PolicyTrial | None = None


AdmissionMsg = (Tokenized | CancelRequest | Released | SchedulerLoad | CacheAnswer | Holding
                | PolicyChange)


# ---------------------------------------------------------------- scheduler inbox

class Admitted(Tokenized, tag="admitted", frozen=True, gc=False):
    """A tokenized request that admission accepted; the scheduler now holds it, and keeps
    ``held`` (admission's ledger entry for it) to hand back if admission restarts."""

    queued_ns: int = 0                # how long admission's queue held it
    held: HeldRequest | None = None
    # its class drops it, deadline_expired, if its TTFT deadline passes before its first
    # token (waiting or mid-prefill); else it is served late (a batch class's choice)
    drop_late: bool = False
    # its class's aging_per_s: the scheduler ranks it ``priority`` less a unit per
    # 1/aging_per_s seconds since arrival (as admission's queue ages it), so waiting batch
    # work comes to rank with, then ahead of, interactive work (0: never ages)
    aging_per_s: float = 0.0


class StopRequest(msgspec.Struct, tag="stop_request", frozen=True):
    """From the detokenizer: a stop string matched; choice ``index`` of the request is done."""

    request_id: str
    index: int = 0


class SampleLogprobs(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """A sampled token's log-probability and the top ones at its place, most likely
    first (as many as the request asked for)."""

    logprob: float
    top_ids: list[int]
    top_logprobs: list[float]


class PromptChunkLogprobs(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """``prompt_logprobs`` of one sequence's prompt chunk: entry ``i`` is the prompt token
    at position ``start + i``, given the tokens before it."""

    seq_id: int
    start: int
    logprobs: list[SampleLogprobs]


class StepResult(msgspec.Struct, tag="step_result", frozen=True, gc=False):
    """The executor's answer to one StepPlan: one sampled token per sampling sequence."""

    step_id: int
    seq_ids: list[int]
    token_ids: list[int]
    elapsed_ns: int
    failed: bool = False
    # beside token_ids when a sequence in the step asked for logprobs (None for the others);
    # empty when none did
    logprobs: list[SampleLogprobs | None] = []
    prompt_logprobs: list[PromptChunkLogprobs] = []     # prompt_logprobs' rows of this step
    # (seq_id, why) for each sequence whose structured output failed in this step: its
    # language went past llguidance's limits on the text it met (``a{1000}{1000}`` after a
    # token). The scheduler fails its request; its sample here is not emitted.
    structured_errors: list[tuple[int, str]] = []
    # speculating rows: (seq id, drafted, accepted). Such a row's tokens are its accepted
    # drafts and then the target's own next token, in order, each listed under its seq id
    drafts: list[tuple[int, int, int]] = []
    draft_ns: int = 0                 # of elapsed_ns, the time proposing those drafts


class KvGrant(msgspec.Struct, tag="kv_grant", frozen=True, array_like=True, gc=False):
    """The answer to one KV op. ``ok`` false means the pool could not satisfy it (and
    changed nothing). ``kind`` names the op: "alloc" (``block_ids`` are the new blocks),
    "fork" (the child's whole table), "swap_out" (the host-tier blocks), "swap_in" (the new
    table). ``copies`` must reach the executor, in order, before its next step. ``reason``
    says why a grant was refused: "tenant_kv_budget" (the sequence's tenant is at its KV
    block budget: only its own frees help), "pool_full" (the pool lacks the blocks), or ""
    (granted, or the op did not fit the lease's state). Last, so older encodings decode."""

    epoch: int
    seq_id: int
    ok: bool
    block_ids: list[int]
    num_cached_tokens: int
    kind: str = "alloc"
    copies: list[BlockCopy] = []
    reason: str = ""


class KvGrants(msgspec.Struct, tag="kv_grants", frozen=True, gc=False):
    """The answers to one ``KvOps`` (none for one of frees only, which still gets this
    reply, so the pool's counts reach the scheduler when sequences end), and the pool after
    it: ``free_blocks`` (a lease can take them; evictable ones included),
    ``evictable_blocks`` (of those, cached prefixes no sequence references), host-tier
    ``free_cpu_blocks``; -1: not said."""

    grants: list[KvGrant]
    free_blocks: int = -1
    free_cpu_blocks: int = -1
    evictable_blocks: int = -1


class StepSample(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """A step's shape (the step-cost model's features: tokens computed, KV positions read
    by its rows, sequences, attention pairs) and the seconds it took."""

    tokens: int
    context: int
    seqs: int
    pairs: int
    seconds: float


class ExecutorReady(msgspec.Struct, tag="executor_ready", frozen=True):
    """The executor is up: what a KV block costs to move to and from its host tier, and
    the steps it timed at startup (measured once per machine and cached, as the kernel
    plan is; empty where it timed none), which the scheduler's step-cost model starts
    from, so admission predicts TTFT from the first request."""

    block_bytes: int
    copy_bytes_per_s: float          # measured at startup, device -> host -> device average
    num_cpu_blocks: int
    step_costs: list[StepSample] = []


class KvManagerUp(msgspec.Struct, tag="kv_up", frozen=True):
    """The kv_manager (re)started with an empty pool; all earlier leases are void."""

    instance: int
    total_blocks: int


SchedulerMsg = (Admitted | CancelRequest | StopRequest | StepResult | KvGrants | KvManagerUp
                | ExecutorReady | PolicyChange)


# ---------------------------------------------------------------- kv_manager inbox

class AllocRequest(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """Lease ``num_blocks`` more blocks to ``seq_id``. On a sequence's first request,
    ``block_hashes``/``token_ids`` let the pool reuse cached prefix blocks (verified)."""

    seq_id: int
    num_blocks: int
    scope: str = ""
    block_hashes: list[int] = []
    token_ids: list[int] = []
    max_cached_blocks: int = 0
    public_scope: str = ""
    public_blocks: int = 0
    promote: bool = True             # take host-tier prefix hits (a copy each) if any
    # a prefix hit is taken down to a multiple of this many blocks (a deterministic
    # prompt's hit ends on one of its chunk boundaries; 1: any hit)
    cached_multiple: int = 1


class ForkRequest(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """Share ``parent``'s blocks for its first ``num_tokens`` tokens with new sequence
    ``child`` (copy-on-write; a partial last block is copied for the child at once)."""

    parent: int
    child: int
    num_tokens: int


class SwapOutRequest(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """Move the blocks of a sequence's first ``num_tokens`` tokens to the host tier."""

    seq_id: int
    num_tokens: int


class FreeRequest(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """Return all of a sequence's blocks; the first ``num_computed_tokens`` hold valid KV."""

    seq_id: int
    num_computed_tokens: int


class KvOps(msgspec.Struct, tag="kv_ops", frozen=True, gc=False):
    """One batched message per scheduler step, applied in this order: forks (before a
    parent's free), frees, swap-outs, swap-ins, allocations."""

    epoch: int
    frees: list[FreeRequest]
    allocs: list[AllocRequest]
    forks: list[ForkRequest] = []
    swap_outs: list[SwapOutRequest] = []
    swap_ins: list[int] = []


class KvHello(msgspec.Struct, tag="kv_hello", frozen=True):
    """A scheduler announces its epoch; leases from older epochs are reclaimed."""

    epoch: int


class CacheQuery(msgspec.Struct, tag="cache_query", frozen=True, gc=False):
    """From admission: how many of this prompt's leading full blocks are cached in ``scope``?
    Read-only; no blocks are leased."""

    request_id: str
    scope: str
    block_hashes: list[int]
    token_ids: list[int]
    max_blocks: int
    public_scope: str = ""
    public_blocks: int = 0


KvMsg = KvOps | KvHello | CacheQuery


class KvEvents(msgspec.Struct, tag="kv_events", frozen=True, gc=False):
    """Published by the kv_manager (PUB) after each batch of operations that changed the
    prefix cache: ``(kind, block_hash, scope, tier, parent_hash)`` tuples, in order.
    ``seq`` increases by one per message so subscribers can detect gaps. A ``snapshot``
    lists every cached block as ``stored`` and replaces what a subscriber knew: one is
    published whenever a subscription arrives (a new subscriber, or one that saw a gap and
    subscribed again)."""

    seq: int
    instance: int
    events: list[tuple[str, int, str, str, int | None]]
    snapshot: bool = False


KvEventsMsg = KvEvents


# ---------------------------------------------------------------- executor inbox

class Penalties(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """A sequence's logit adjustments (SamplingParams' fields of the same names; the
    bias as (token id, bias) pairs). ``stop_ids`` are banned (logit -inf) while the
    output has fewer than ``min_tokens`` tokens: the ids that would end it (EOS unless
    ignored, and stop_token_ids)."""

    presence: float = 0.0
    frequency: float = 0.0
    repetition: float = 1.0
    bias: list[tuple[int, float]] = []
    min_tokens: int = 0
    stop_ids: list[int] = []


class NewSeq(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """Full state of a sequence the executor has not seen (or must recompute)."""

    seq_id: int
    token_ids: list[int]
    prompt_len: int
    num_computed: int
    block_ids: list[int]
    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    penalties: Penalties | None = None      # None: none asked for (the usual case)
    logprobs: int | None = None             # SamplingParams.logprobs
    prompt_logprobs: int | None = None      # SamplingParams.prompt_logprobs, while owed
    structured: StructuredOutput | None = None  # SamplingParams.structured
    output_offset: int = 0                  # SamplingParams.output_offset
    # SamplingParams.deterministic as in force (the request's, its class's or the engine's):
    # its rows run batch-invariantly, in every step it is in (StepPlan.deterministic)
    deterministic: bool = False


class SeqStep(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """Diff for one scheduled sequence: compute ``num_tokens`` more tokens, with
    ``new_block_ids`` appended to its block table; sample iff ``sample``."""

    seq_id: int
    num_tokens: int
    new_block_ids: list[int]
    sample: bool
    num_samples: int = 1             # independent samples from the last row (n > 1 fork)
    draft_k: int = 0                 # a decode row may verify up to this many draft tokens


class StepPlan(msgspec.Struct, tag="step_plan", frozen=True, gc=False):
    """One step: forget ``drop``, do ``copies`` in order (KV block moves the kv_manager
    asked for), learn ``new_seqs``, then run ``steps`` as one forward."""

    step_id: int
    new_seqs: list[NewSeq]
    steps: list[SeqStep]
    drop: list[int]
    copies: list[BlockCopy] = []
    # a row of the step is deterministic (NewSeq.deterministic): the whole step runs the
    # batch-invariant kernel plan, so that row's numerics do not depend on the rest
    deterministic: bool = False


ExecutorMsg = StepPlan


# ---------------------------------------------------------------- detokenizer inbox

class DetokParams(msgspec.Struct, frozen=True, array_like=True, gc=False):
    stop: tuple[str, ...]
    skip_special_tokens: bool
    prompt_tokens: int
    cached_tokens: int
    queue_time_s: float = 0.0
    traceparent: str | None = None
    n: int = 1                        # choices in the request; Finished waits for all
    min_tokens: int = 0               # no stop string matches before a choice has this many
    # the tail of the output a migrated stream's prompt carries (its last output_offset
    # tokens, at most ``carried_tail(stop)`` of them): text already emitted, the
    # detokenizer's left context and where a stop string may have begun
    carried: tuple[int, ...] = ()


def carried_tail(stop: tuple[str, ...]) -> int:
    """How many of a continuation's carried output tokens its detokenizer is given: enough
    text for the longest stop string's proper prefix (a token is at least one byte, a
    character at most four) and for a decoder's left context before it."""
    return 8 + 4 * max(map(len, stop), default=0)


class TokenOut(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """New tokens of one request. ``params`` rides on a request's first output;
    ``finish_reason``/``usage`` on its last."""

    request_id: str
    token_ids: list[int]
    params: DetokParams | None = None
    finish_reason: FinishReason | None = None
    usage: Usage | None = None
    timing: RequestTiming | None = None
    index: int = 0                    # which of the request's n choices
    logprobs: list[SampleLogprobs] | None = None    # one per token id, when asked
    # prompt_logprobs, on the request's first output (a fork's, with n > 1): the prompt,
    # one entry per token after its first
    prompt: tuple[list[int], list[SampleLogprobs]] | None = None


class TokenBatch(msgspec.Struct, tag="token_batch", frozen=True, gc=False):
    items: list[TokenOut]


class ForgetRequest(msgspec.Struct, tag="forget_request", frozen=True):
    """Drop a request's detokenizer state (cancelled or failed upstream)."""

    request_id: str


DetokenizerMsg = TokenBatch | ForgetRequest


# ---------------------------------------------------------------- streamer internal inbox

class EventBatch(msgspec.Struct, tag="event_batch", frozen=True, gc=False):
    """Client-bound events from the engine, in order."""

    events: list[Accepted | TextDelta | Finished | Rejected | Cancelled | Failed]


class ClusterStatus(msgspec.Struct, tag="cluster_status", frozen=True):
    """The supervisor's view of every component, relayed to the streamer for status queries."""

    components: tuple[ComponentStatus, ...]
    draining: bool


StreamerMsg = EventBatch | ClusterStatus


# ---------------------------------------------------------------- supervisor and control plane

class ComponentHeartbeat(msgspec.Struct, tag="component_heartbeat", frozen=True):
    name: str
    pid: int
    state: str
    stats: dict[str, float] = {}
    tenants: dict[str, TenantUsage] = {}
    info: dict[str, str] = {}           # fixed facts (the executor's kernel plan)


class ComponentPulse(msgspec.Struct, tag="component_pulse", frozen=True):
    """From a component's pulse thread, whatever its event loop is doing (bus/pulse.py):
    how long ago the loop last ticked, and the CPU seconds the process has used."""

    name: str
    pid: int
    loop_age_s: float
    cpu_s: float


SupervisorMsg = ComponentHeartbeat | ComponentPulse


class Drain(msgspec.Struct, tag="drain", frozen=True):
    """Stop taking new work; finish what is in flight."""


class Stop(msgspec.Struct, tag="stop", frozen=True):
    """Exit now. Shutdown is a message, not an exception."""


class PeerRestarted(msgspec.Struct, tag="peer_restarted", frozen=True):
    """A component died and was restarted; its in-flight state is gone."""

    name: str


ControlMsg = Drain | Stop | PeerRestarted
