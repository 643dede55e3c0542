"""The client protocol: what a client sends the streamer (``ClientMsg``) and what it gets
back (``ServerMsg``). These encode as msgpack maps with a ``type`` tag, so clients in other
languages can speak them; docs/PROTOCOL.md is the contract.
"""
from __future__ import annotations

from typing import Literal

import msgspec

from schemas.config_change import ConfigVersion

# "deadline": the request's end-to-end deadline passed while it was decoding; its output so
# far is what it got (like "length", cut short; see Submit.e2e_deadline_ms)
FinishReason = Literal["stop", "length", "deadline"]
RejectReason = Literal[
    "invalid_request", "unknown_tenant", "prompt_too_long", "overloaded", "tenant_over_budget",
    "draining", "unauthenticated",
    # deadline-aware admission (components/admission/policy.py)
    "deadline_unmeetable", "deadline_expired", "queue_full", "tenant_token_budget",
    "tenant_kv_budget", "class_not_allowed",
    # admission against the live engine (components/admission/live.py): the pool has no
    # room for it, or one more decoding sequence would put the running streams past TPOT
    "kv_pressure", "tpot_slo_at_risk",
    # an idempotency key already names a different request (prompt or parameters)
    "idempotency_key_reused",
]


class ToolCall(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A function call an assistant message made (an OpenAI ``tool_calls`` entry)."""

    id: str
    name: str
    arguments: str                      # JSON text


class Tool(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A function the model may call (an OpenAI ``tools`` entry): given to the chat
    template, which shows it to the model if the template takes tools."""

    name: str
    description: str | None = None
    parameters: str | None = None       # a JSON Schema, as JSON text


class ChatMessage(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    role: str
    content: str
    tool_calls: tuple[ToolCall, ...] = ()   # an assistant's calls
    tool_call_id: str | None = None         # a tool's answer: to which call


class StructuredOutput(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Constrain a request's output to a language (vLLM's structured outputs): exactly one
    of ``json`` (a JSON Schema, as JSON text), ``json_object`` (any JSON object), ``regex``
    (Rust regex syntax, matched whole; ``\\d`` is any Unicode digit, ``[0-9]`` ASCII),
    ``choice`` (one of these strings) or ``grammar`` (Lark, llguidance's dialect, or
    llama.cpp's GBNF). At each step the executor masks every token the language cannot
    continue with, so the output is always a prefix of a sentence of it, and a whole one
    when it ends by EOS (``max_tokens`` can still cut it short). JSON
    is compact: no whitespace but one space after ``,`` and ``:``, unless
    ``json_whitespace`` lets the model choose it."""

    json: str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    json_whitespace: bool = False


class SamplingParams(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Per-request generation parameters. Validated by admission, not at decode.
    ``max_tokens=None`` means "until the context window is full"."""

    max_tokens: int | None = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    n: int = 1                       # parallel samples sharing the prompt's KV (copy-on-write)
    # logit adjustments before sampling (greedy too), as vLLM and OpenAI define them:
    # presence and frequency count the output tokens so far (logit -= presence if the
    # token was output, -= frequency x its count); repetition (HF's) every token of the
    # prompt and output (a positive logit divided by it, a negative one multiplied);
    # logit_bias adds to the logits of the ids it names
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    # None: off. k >= 0: each output token comes with its log-probability and the k most
    # likely tokens' (0 .. 20), under the model's own distribution (before temperature,
    # penalties and filters, as vLLM reports them by default)
    logprobs: int | None = None
    # no EOS, stop_token_ids or stop string ends a choice before it has this many tokens
    # (vLLM's min_tokens: the executor bans the stop ids until then); at most max_tokens
    min_tokens: int = 0
    # None: off. k >= 0: every prompt token after the first comes back with its
    # log-probability given the tokens before it and the k most likely there (vLLM's
    # prompt_logprobs; what OpenAI's echo + logprobs report). Such a prompt is computed
    # whole: its blocks are never read from the prefix cache
    prompt_logprobs: int | None = None
    # None: free text. Otherwise the output is held to a language (StructuredOutput)
    structured: StructuredOutput | None = None
    # the output tokens this request had already produced before its prompt's end: a
    # router's continuation of a migrated stream sends prompt + output so far as its
    # prompt, and this many as the offset of its first new token in the output, so a
    # seeded draw continues the same random stream (sampling.py: the noise of output token
    # i depends on (seed, i) alone). The invariant: the prompt's last output_offset tokens
    # (at most the whole prompt) are output already emitted, and the replica treats them
    # as output: presence and frequency penalties count them, a structured-output grammar
    # has read them, the detokenizer takes them as text already streamed (a stop string
    # may have begun in them); min_tokens and max_tokens count the new tokens alone
    output_offset: int = 0
    # the deterministic serving mode: its logits, logprobs and tokens are bitwise the same
    # whatever else is in the batch, however its prompt is chunked or cached, across
    # restarts on the same machine and build (slower: docs/design/determinism.md). Also set
    # by its class (``deterministic = true``) or the engine (engine.deterministic = "all");
    # refused where engine.deterministic is "off"
    deterministic: bool = False


class Submit(msgspec.Struct, tag="submit", frozen=True, forbid_unknown_fields=True):
    """Start a request. Exactly one of ``prompt`` (completion text), ``prompt_token_ids``
    (a pre-tokenized completion prompt) or ``messages`` (chat) is set."""

    request_id: str
    prompt: str | None = None
    messages: tuple[ChatMessage, ...] | None = None
    prompt_token_ids: list[int] | None = None
    params: SamplingParams = SamplingParams()
    tenant: str = "default"
    deadline_ms: int | None = None      # time-to-first-token deadline, from arrival
    priority: int = 0                   # lower is more important; preemption takes the highest
    api_key: str | None = None          # with keys configured, names the tenant (see PROTOCOL.md)
    idempotency_key: str | None = None  # a retry with the same key attaches, never runs twice
    attempt: int = 0                    # 0 first; n for the client's n-th retry (counted)
    service_class: str | None = None    # ask for a class (the tenant's default if None); a
                                        # client may only lower its class, never raise it
    session_id: str | None = None       # a conversation: a router keeps it on one replica
    tools: tuple[Tool, ...] = ()        # chat: functions the template may show the model
    batch_events: bool = False          # this client takes ``Events``: a step's events for
                                        # its requests arrive in one frame, not one each
    # end-to-end deadline, from arrival: past it the request ends wherever it is (finish
    # reason "deadline" with its output so far, or deadline_expired before a first token).
    # Its class's e2e_slo_ms bounds it: a client may tighten its class's bound, not loosen it
    e2e_deadline_ms: int | None = None


class Cancel(msgspec.Struct, tag="cancel", frozen=True, forbid_unknown_fields=True):
    request_id: str


class Heartbeat(msgspec.Struct, tag="heartbeat", frozen=True, forbid_unknown_fields=True):
    """Keeps a client's requests alive; a client silent past the timeout is cancelled.
    The server answers each one with a ``ServerHeartbeat``."""


class StatusQuery(msgspec.Struct, tag="status", frozen=True, forbid_unknown_fields=True):
    query_id: str = ""
    api_key: str | None = None          # operators see every tenant; a tenant only its own


class ReplicaAddress(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """An engine a router may route to: its client endpoint, and where its kv_manager
    publishes prefix-cache events (empty: none; the router then routes by load alone)."""

    name: str
    endpoint: str
    kv_events: str = ""
    pool: str = "default"               # its replica pool (schemas.config.ReplicaSpec)


class ChangeReplicas(msgspec.Struct, tag="change_replicas", frozen=True,
                     forbid_unknown_fields=True):
    """To a router, from an operator (an operator or the service key; anyone where no
    keys are configured): route to the engines ``add`` names from now on, and retire those
    ``remove`` names (no new request goes there; each is let go once its open requests
    end). Answered by ``ReplicasChanged``; an engine answers it with an error."""

    query_id: str = ""
    add: tuple[ReplicaAddress, ...] = ()
    remove: tuple[str, ...] = ()
    api_key: str | None = None


ConfigAction = Literal["apply", "rollback", "history"]


class ConfigCommand(msgspec.Struct, tag="config", frozen=True, forbid_unknown_fields=True):
    """To an engine or a router, from an operator (an operator or the service key; anyone
    where no keys are configured): ``apply`` the config ``toml`` (laid over the running one: the
    policy sections change live, anything else is refused; ``schemas/config_change.py``),
    ``rollback`` to ``version`` (None: the one before the current), or list the
    ``history``. ``actor`` is who the operator says they are (recorded beside the key's
    name). Answered by ``ConfigAnswer``; an engine and a router each keep their own versions
    (a router's changes its routing policy and fleet budgets, not its replicas')."""

    query_id: str = ""
    action: ConfigAction = "history"
    toml: str = ""
    version: int | None = None
    actor: str = ""
    api_key: str | None = None


ClientMsg = Submit | Cancel | Heartbeat | StatusQuery | ChangeReplicas | ConfigCommand


class Usage(msgspec.Struct, frozen=True):
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0


class RequestTiming(msgspec.Struct, frozen=True, array_like=True):
    """Where a request's time went, measured by the scheduler (seconds)."""

    queue_s: float = 0.0        # arrival → first scheduled
    prefill_s: float = 0.0      # first scheduled → first token
    decode_s: float = 0.0       # first token → finished
    preemptions: int = 0        # times the request (any choice) was preempted
    ingress_s: float = 0.0      # of queue_s, what no queue held it: arrival → the engine's
                                # queue (admission's or the scheduler's), less admission's
                                # queue (tokenizer, cache lookup, hops between processes)


class Pinned(msgspec.Struct, frozen=True):
    """What a deterministic request's output is pinned to: the same values and the same
    request give the same bits. ``fingerprint`` is a digest of the other four (the HTTP
    API's ``system_fingerprint``). On another machine, or with other kernels, the plan
    and so the bits may differ."""

    model_sha256: str                # the weights' files
    chat_template_sha256: str        # the chat template the tokenizer applies ("": none)
    kernel_plan: str                 # the executor's kernel plan id
    engine_version: str              # weir's version
    fingerprint: str


class Accepted(msgspec.Struct, tag="accepted", frozen=True):
    request_id: str
    prompt_tokens: int
    cached_tokens: int = 0
    service_class: str = ""             # the class admission ran it under
    max_tokens: int | None = None       # the cap it runs with (lowered when degraded)
    degraded: bool = False              # admission lowered max_tokens to meet the deadline
    queued_s: float = 0.0               # time held in admission's queue before it started
    # with no first token this long after arrival, the engine ends it deadline_expired
    # (its class drops late work); None: it is served however late
    expires_ms: int | None = None
    # the end-to-end deadline in force (the client's, clamped to its class's e2e_slo_ms):
    # this long after arrival the engine ends it wherever it is; None: no bound
    e2e_deadline_ms: int | None = None
    # a deterministic request (SamplingParams.deterministic, its class's or the engine's
    # setting): what its output is pinned to; None for any other request
    pinned: Pinned | None = None


class TopLogprob(msgspec.Struct, frozen=True, array_like=True):
    token_id: int
    token: str                       # the token alone, decoded
    logprob: float


class TokenLogprob(msgspec.Struct, frozen=True, array_like=True):
    """An output token's log-probability and the most likely tokens' at its place."""

    token_id: int
    token: str
    logprob: float
    top: tuple[TopLogprob, ...] = ()


class PromptLogprobs(msgspec.Struct, frozen=True, array_like=True):
    """The prompt as the model read it, for ``prompt_logprobs``: its token ids, its text
    (decoded as the output is), its first token alone (which has no logprob), and one
    entry per token after the first."""

    token_ids: tuple[int, ...]
    text: str
    first_token: str
    logprobs: tuple[TokenLogprob, ...]


class TextDelta(msgspec.Struct, tag="delta", frozen=True):
    request_id: str
    text: str
    token_ids: tuple[int, ...]
    index: int = 0                   # the choice (0 .. n-1)
    logprobs: tuple[TokenLogprob, ...] = ()     # one per token id, when the request asked
    prompt: PromptLogprobs | None = None        # on the request's first delta, when asked


class ChoiceEnd(msgspec.Struct, frozen=True, array_like=True):
    index: int
    finish_reason: FinishReason
    completion_tokens: int


class Finished(msgspec.Struct, tag="finished", frozen=True):
    """Terminal: the request completed normally."""

    request_id: str
    finish_reason: FinishReason
    usage: Usage
    text: str = ""
    queue_time_s: float = 0.0
    timing: RequestTiming | None = None
    choices: tuple[ChoiceEnd, ...] = ()     # every choice's end, by index (n >= 1)


class Rejected(msgspec.Struct, tag="rejected", frozen=True):
    """Terminal: the request was refused before running. ``retry_after_s`` is an estimate."""

    request_id: str
    reason: RejectReason
    message: str
    retry_after_s: float | None = None


class Cancelled(msgspec.Struct, tag="cancelled", frozen=True):
    """Terminal: the client cancelled, or disappeared."""

    request_id: str
    reason: str


class Failed(msgspec.Struct, tag="failed", frozen=True):
    """Terminal: the engine could not complete the request."""

    request_id: str
    reason: str


# A ``Failed`` reason's prefix, then ": " and llguidance's message: the request's structured
# output went past llguidance's limits on the text it met. The request's own language,
# not the engine: a retry fails the same way.
STRUCTURED_OUTPUT_ERROR = "structured_output_error"


class TenantUsage(msgspec.Struct, frozen=True):
    """One tenant's use of the engine, as the scheduler counts it."""

    processed_tokens: int = 0        # prompt and fed-back tokens computed
    generated_tokens: int = 0        # tokens sampled
    kv_blocks: int = 0               # KV blocks its running sequences hold now
    virtual_counter: float = 0.0     # VTC: weighted service received (input + 2 x output)
    running: int = 0                 # sequences running now (an unforked n > 1 request: n)


class ComponentStatus(msgspec.Struct, frozen=True):
    name: str
    pid: int
    alive: bool
    state: str
    restarts: int
    heartbeat_age_s: float
    stats: dict[str, float] = {}     # engine-wide numbers, by name
    tenants: dict[str, TenantUsage] = {}   # per tenant (only the scheduler reports any)
    info: dict[str, str] = {}        # fixed facts: the executor's kernel plan


class StatusReport(msgspec.Struct, tag="status_report", frozen=True):
    query_id: str
    components: tuple[ComponentStatus, ...]
    draining: bool = False


class ServerHeartbeat(msgspec.Struct, tag="server_heartbeat", frozen=True):
    """The streamer's answer to a client ``Heartbeat``. ``instance`` changes when the
    streamer restarts: the requests a client had open on the old instance are gone."""

    instance: int
    draining: bool = False


class ProtocolError(msgspec.Struct, tag="protocol_error", frozen=True):
    """Sent to a client whose message could not be decoded and carried no request id."""

    message: str


def malformed_reply(error: str, request_id: str | None) -> Rejected | ProtocolError:
    """The answer to a client frame that did not decode: a rejection of the request it
    names (``request_id``, salvaged from the frame, None when it names none or one that is
    already open), else a protocol error."""
    if request_id is not None:
        return Rejected(request_id, "invalid_request", f"malformed message: {error}")
    return ProtocolError(f"malformed message: {error}")


Terminal = Finished | Rejected | Cancelled | Failed
class ReplicasChanged(msgspec.Struct, tag="replicas_changed", frozen=True):
    """A router's answer to ``ChangeReplicas``: ``error`` None when every change was made
    (else nothing was changed), and the replicas it routes new requests to now."""

    query_id: str
    error: str | None = None
    replicas: tuple[str, ...] = ()
    retiring: tuple[str, ...] = ()      # removed, with requests still open on them
    pools: dict[str, str] = {}          # each replica (routed to or retiring) -> its pool


class ConfigAnswer(msgspec.Struct, tag="config_answer", frozen=True):
    """An engine's or a router's answer to ``ConfigCommand``: ``error`` None when it was
    done (a refused config names every reason and changes nothing), the version in force
    now, and (for
    ``history``) every version applied, oldest first."""

    query_id: str
    error: str | None = None
    current: ConfigVersion | None = None
    history: tuple[ConfigVersion, ...] = ()


class Events(msgspec.Struct, tag="events", frozen=True):
    """Several events for one client, in order: what an engine step produced for its
    requests (sent only to clients that asked, by ``Submit.batch_events``). Each event
    means what it would alone."""

    events: list[Accepted | TextDelta | Finished | Rejected | Cancelled | Failed]


ServerMsg = (Accepted | TextDelta | Finished | Rejected | Cancelled | Failed | StatusReport
             | ServerHeartbeat | ProtocolError | ReplicasChanged | ConfigAnswer | Events)
