"""The Weir client SDK: ``AsyncClient`` (anyio/asyncio) and ``Client`` (blocking).

Both speak the ZeroMQ wire protocol documented in docs/PROTOCOL.md: a DEALER
socket to the streamer's ROUTER, msgpack Envelopes, one terminal message per
request.

Liveness runs both ways. While any request is open the client sends heartbeats,
so a killed client's requests are cancelled by the server; the server answers
each with a ``ServerHeartbeat``, so a client whose engine stops answering for
``engine_timeout`` seconds, or whose streamer restarted, fails its open requests
(``RequestFailed``) instead of waiting forever.

One receive task serves every stream and never waits on any of them: each stream
has a bounded buffer (``weir/inbox.py``), and a stream that stops being read is
cancelled in the engine rather than holding up the others.

One file past 400 lines on purpose: ``Client`` is ``AsyncClient`` run on one event-loop
thread, and the two share the wire handling, so they cannot drift apart.
"""
from __future__ import annotations

import os
import random
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import Any

import anyio
import msgspec
import zmq
from anyio.from_thread import start_blocking_portal
from opentelemetry import trace

from bus.socket import BusSocket
from bus.tracing import context_from, traceparent_of
from schemas.client import (
    ChangeReplicas,
    ConfigAction,
    ConfigAnswer,
    ConfigCommand,
    Events,
    Pinned,
    ReplicaAddress,
    ReplicasChanged,
)
from schemas.config import DEFAULT_CLIENT_ENDPOINT
from schemas.wire import (
    Accepted,
    Cancel,
    Cancelled,
    Failed,
    Finished,
    Heartbeat,
    PromptLogprobs,
    ProtocolError,
    Rejected,
    RequestTiming,
    SamplingParams,
    ServerHeartbeat,
    ServerMsg,
    StatusQuery,
    StatusReport,
    Submit,
    TextDelta,
    TokenLogprob,
    Tool,
    Usage,
)
from weir.errors import (
    ProtocolViolation,
    RequestCancelled,
    RequestFailed,
    RequestRejected,
    RequestTimeout,
    WeirError,
)
from weir.forms import chat_message, replica_address, structured_output, tool
from weir.inbox import TERMINAL, Inbox

_TRACER = trace.get_tracer("weir.client")


def default_endpoint() -> str:
    return os.environ.get("WEIR_ENDPOINT") or DEFAULT_CLIENT_ENDPOINT


def _ensure_tracing() -> None:
    """The SDK's ``weir.submit`` spans go to the application's tracer provider. An
    application that set none but has the standard ``OTEL_*`` variables gets one
    (``service.name`` weir-client), so SDK requests are traced as HTTP ones are."""
    exporter = os.environ.get("OTEL_TRACES_EXPORTER", "")
    configured = (exporter == "otlp" or (exporter == "jsonl" and os.environ.get("WEIR_TRACE_FILE"))
                  or (not exporter and os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")))
    if not configured or not isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider):
        return
    from bus import tracing
    from schemas.config import TelemetryConfig

    tracing.setup("client", TelemetryConfig(exporter="otlp"))   # OTEL_* variables override


_RETRYABLE = ("overloaded", "tenant_over_budget", "queue_full",   # load: worth another
              "tenant_token_budget", "kv_pressure",               # try after Retry-After
              "tpot_slo_at_risk")


def _entry(e: TokenLogprob) -> dict[str, Any]:
    return {"token_id": e.token_id, "token": e.token, "logprob": e.logprob,
            "top": [{"token_id": t.token_id, "token": t.token, "logprob": t.logprob}
                    for t in e.top]}


@dataclass
class Choice:
    """One of a request's n completions."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str
    logprobs: list[TokenLogprob] | None = None      # one per token id, when asked for


@dataclass
class Completion:
    """A finished request. ``text``/``token_ids``/``finish_reason`` are choice 0's;
    ``choices`` holds all n (n = 1 unless the request asked for more).

    What admission granted (from the ``Accepted`` event): ``service_class``, the class the
    request ran under (the tenant's default, or the lower one it asked for);
    ``max_tokens``, the cap it ran with (None: up to the context window); ``degraded``,
    True when admission lowered that cap below what was asked, to fit a budget;
    ``queued_s``, the seconds admission held it in its queue before it started (the
    scheduler's own wait is ``queue_time_s``)."""

    request_id: str
    text: str
    token_ids: list[int]
    finish_reason: str
    usage: Usage
    ttft_ms: float | None
    e2e_ms: float
    queue_time_s: float = 0.0
    timing: RequestTiming | None = None
    choices: list[Choice] = field(default_factory=list)
    service_class: str = ""
    degraded: bool = False
    max_tokens: int | None = None
    queued_s: float = 0.0
    logprobs: list[TokenLogprob] | None = None      # choice 0's, when asked for
    prompt: PromptLogprobs | None = None            # with prompt_logprobs
    # a deterministic request's pin (``deterministic=True``, or its class's or the
    # engine's setting): model, chat template, kernel plan and version digests, and their
    # fingerprint; the same request with the same pin gives the same bits
    pinned: Pinned | None = None

    def to_dict(self) -> dict[str, Any]:
        out = {"request_id": self.request_id, "text": self.text, "token_ids": self.token_ids,
               "finish_reason": self.finish_reason,
               "usage": {"prompt_tokens": self.usage.prompt_tokens,
                         "completion_tokens": self.usage.completion_tokens,
                         "cached_tokens": self.usage.cached_tokens},
               "ttft_ms": self.ttft_ms, "e2e_ms": self.e2e_ms,
               "service_class": self.service_class, "degraded": self.degraded,
               "max_tokens": self.max_tokens, "queued_s": self.queued_s}
        if self.logprobs is not None:
            out["logprobs"] = [_entry(e) for e in self.logprobs]
        if self.prompt is not None:
            out["prompt"] = {"token_ids": list(self.prompt.token_ids), "text": self.prompt.text,
                             "first_token": self.prompt.first_token,
                             "logprobs": [_entry(e) for e in self.prompt.logprobs]}
        if self.pinned is not None:
            out["pinned"] = msgspec.structs.asdict(self.pinned)
        if len(self.choices) > 1:
            out["choices"] = [{"index": c.index, "text": c.text, "token_ids": c.token_ids,
                               "finish_reason": c.finish_reason} for c in self.choices]
        return out


@dataclass(eq=False)
class Stream:
    """One request's event stream. Iterate for ``TextDelta``s; ``result`` holds the
    Completion once the stream ends. Errors surface as typed exceptions.

    ``accepted`` is the engine's ``Accepted`` event once it has arrived (it comes before
    the first delta, so it is set by the time iteration yields one): the class, the
    ``max_tokens`` cap and whether admission degraded the request."""

    request_id: str
    _client: AsyncClient
    _recv: Inbox
    _deadline: float | None
    _submit: Submit | None = None                           # kept for retries
    started: float = field(default_factory=time.perf_counter)
    first_token_at: float | None = None
    text: list[str] = field(default_factory=list)           # choice 0
    token_ids: list[int] = field(default_factory=list)      # choice 0
    texts: dict[int, list[str]] = field(default_factory=dict)        # every choice
    choice_token_ids: dict[int, list[int]] = field(default_factory=dict)
    choice_logprobs: dict[int, list[TokenLogprob]] = field(default_factory=dict)
    prompt: PromptLogprobs | None = None
    result: Completion | None = None
    prompt_tokens: int | None = None
    accepted: Accepted | None = None
    _cancelled_by_user: bool = False
    span: Any = None
    retries: int = 0

    def __aiter__(self) -> AsyncIterator[TextDelta]:
        return self._events()

    async def _timed_out(self) -> None:
        await self._client.cancel(self.request_id)
        raise RequestTimeout(f"request {self.request_id} timed out")

    async def _events(self) -> AsyncIterator[TextDelta]:
        over = True
        try:
            while True:
                timeout = None if self._deadline is None else self._deadline - time.monotonic()
                if timeout is not None and timeout <= 0:
                    await self._timed_out()
                if timeout is None or self._recv.items:     # no wait to bound: no scope
                    event = await self._recv.get()
                else:
                    with anyio.move_on_after(timeout) as scope:
                        event = await self._recv.get()
                    if scope.cancelled_caught:
                        await self._timed_out()
                match event:
                    case Accepted(prompt_tokens=n):
                        self.prompt_tokens = n
                        self.accepted = event
                    case TextDelta():
                        if self.first_token_at is None:
                            self.first_token_at = time.perf_counter()
                        if event.index == 0:
                            self.text.append(event.text)
                            self.token_ids.extend(event.token_ids)
                        self.texts.setdefault(event.index, []).append(event.text)
                        self.choice_token_ids.setdefault(event.index, []).extend(event.token_ids)
                        if event.logprobs:
                            self.choice_logprobs.setdefault(event.index, []).extend(
                                event.logprobs)
                        self.prompt = event.prompt or self.prompt
                        yield event
                    case Finished(finish_reason=reason, usage=usage, queue_time_s=queue,
                                  timing=timing, choices=ends):
                        self._finish(reason, usage, queue, timing, ends)
                        return
                    case Rejected():
                        if await self._retry(event):
                            continue
                        raise RequestRejected(event.request_id, event.reason, event.message,
                                              event.retry_after_s)
                    case Cancelled(reason=reason):
                        if self._cancelled_by_user:
                            self._finish("cancelled", Usage(self.prompt_tokens or 0,
                                                            len(self.token_ids)))
                            return
                        raise RequestCancelled(self.request_id, reason)
                    case Failed(reason=reason):
                        raise RequestFailed(self.request_id, reason)
                    case ProtocolError(message=message):
                        raise ProtocolViolation(message)
        except GeneratorExit:
            # The caller stopped iterating (``break``): the request runs on, and iterating
            # again resumes where this left off, so the stream stays open.
            over = False
            raise
        except BaseException as exc:
            if self.span is not None:
                self.span.set_attribute("weir.terminal", type(exc).__name__)
            raise
        finally:
            if over:
                self._end()

    def _end(self) -> None:
        """The stream is over (its terminal was read, or it failed here): unregister it."""
        self._client._close_stream(self.request_id)
        if self.span is not None:
            if self.result is not None:
                self.span.set_attributes({
                    "weir.terminal": self.result.finish_reason,
                    "gen_ai.usage.input_tokens": self.result.usage.prompt_tokens,
                    "gen_ai.usage.output_tokens": self.result.usage.completion_tokens,
                    "weir.service_class": self.result.service_class,
                    "weir.degraded": self.result.degraded})
            self.span.end()
            self.span = None

    async def _retry(self, event: Rejected) -> bool:
        """Resubmit after a rejection that came with ``retry_after_s``: at most the client's
        ``max_retries`` times, after a jittered wait, and only if the wait ends before
        this request's deadline. Other rejections are final."""
        client = self._client
        wait = event.retry_after_s
        if (wait is None or event.reason not in _RETRYABLE or self._submit is None
                or self.retries >= client.max_retries or self._cancelled_by_user):
            return False
        wait = min(wait, client.max_retry_wait) * random.uniform(1.0, 1.5)
        if self._deadline is not None and time.monotonic() + wait >= self._deadline:
            return False
        self.retries += 1
        client.retries += 1
        await anyio.sleep(wait)
        self._recv = client._open(self.request_id)
        self._submit = msgspec.structs.replace(self._submit, attempt=self.retries)
        await client._send_submit(self._submit, self.span)
        return True

    def _finish(self, reason: str, usage: Usage, queue_time_s: float = 0.0,
                timing: RequestTiming | None = None, ends: tuple = ()) -> None:
        now = time.perf_counter()
        ttft = None if self.first_token_at is None else (self.first_token_at - self.started) * 1e3
        reasons = {e.index: e.finish_reason for e in ends} or {0: reason}
        choices = [Choice(i, "".join(self.texts.get(i, [])), self.choice_token_ids.get(i, []),
                          reasons[i], self.choice_logprobs.get(i)) for i in sorted(reasons)]
        acc = self.accepted or Accepted(self.request_id, 0)   # none (cancelled first): defaults
        self.result = Completion(self.request_id, "".join(self.text), self.token_ids, reason,
                                 usage, ttft, (now - self.started) * 1e3, queue_time_s, timing,
                                 choices, acc.service_class, acc.degraded, acc.max_tokens,
                                 acc.queued_s, self.choice_logprobs.get(0), self.prompt,
                                 acc.pinned)

    async def cancel(self) -> None:
        self._cancelled_by_user = True
        await self._client.cancel(self.request_id)

    async def abandon(self) -> None:
        """The caller went away: nothing more is read from this stream. A request with an
        idempotency key is left running, so a retry with the same key attaches to it; any
        other is cancelled, freeing its KV. Either way its events are dropped here."""
        if not (self._submit is not None and self._submit.idempotency_key):
            await self.cancel()
        self._end()

    async def collect(self) -> Completion:
        async for _ in self:
            pass
        assert self.result is not None
        return self.result


class AsyncClient:
    """Async client. Use as ``async with AsyncClient() as c:`` (enter and exit in one task).

    ``api_key``: the key that names this client's tenant when the server has keys
    configured (``WEIR_API_KEY`` by default). ``timeout``: the default per-request limit
    (None: no limit). ``engine_timeout``: seconds without any answer from the engine, while
    requests are open, after which they fail. ``max_retries``: resubmissions of a request
    rejected with a ``retry_after_s`` (overload), each after a jittered wait; ``retries``
    counts them. ``stream_buffer`` / ``stall_timeout``: the per-stream buffer policy of
    ``Inbox``."""

    def __init__(self, endpoint: str | None = None, *, tenant: str = "default",
                 timeout: float | None = None, heartbeat_interval: float = 0.15,
                 api_key: str | None = None, engine_timeout: float = 4.0,
                 max_retries: int = 2, max_retry_wait: float = 10.0,
                 stream_buffer: int = 1024, stall_timeout: float = 10.0) -> None:
        self.endpoint = endpoint or default_endpoint()
        self.tenant = tenant
        self.api_key = api_key if api_key is not None else os.environ.get("WEIR_API_KEY")
        self.timeout = timeout
        self.heartbeat_interval = heartbeat_interval
        self.engine_timeout = engine_timeout
        self.max_retries, self.max_retry_wait = max_retries, max_retry_wait
        self.stream_buffer, self.stall_timeout = stream_buffer, stall_timeout
        self.retries = 0                     # resubmissions after retry-after rejections
        self.slow_consumer_cancels = 0
        self._streams: dict[str, Inbox] = {}
        self._instance_of: dict[str, int | None] = {}   # request -> streamer it went to
        self._instance: int | None = None
        self._instance_known: anyio.Event | None = None   # set at the first heartbeat answer
        self._last_answer = time.monotonic()
        self._tg = None
        self._sock: BusSocket | None = None

    async def __aenter__(self) -> AsyncClient:
        _ensure_tracing()
        self._sock = BusSocket(zmq.DEALER, "client", ServerMsg).connect(self.endpoint)
        self._tg = anyio.create_task_group()
        await self._tg.__aenter__()
        self._tg.start_soon(self._receiver)
        self._tg.start_soon(self._heartbeats)
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def close(self) -> None:
        if self._tg is not None:
            self._tg.cancel_scope.cancel()
            await self._tg.__aexit__(None, None, None)
            self._tg = None
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    async def _receiver(self) -> None:
        """Route each server message to its stream; never waits on a stream."""
        while True:
            event = (await self._sock.recv()).body
            self._last_answer = time.monotonic()
            if isinstance(event, ServerHeartbeat):
                self._on_instance(event.instance)
                continue
            for e in event.events if isinstance(event, Events) else (event,):
                if (key := self._route(e)) is not None:   # its reader fell too far behind
                    self.slow_consumer_cancels += 1
                    await self._sock.send(Cancel(key))

    def _route(self, event: Any) -> str | None:
        """Put ``event`` in its stream's inbox; the request id to cancel if the inbox
        refused it (over its buffer policy), else None."""
        if isinstance(event, (StatusReport, ReplicasChanged, ConfigAnswer)):
            key = "status:" + event.query_id
        elif isinstance(event, ProtocolError):
            key = next(iter(self._streams), None)
        else:
            key = event.request_id
        if isinstance(event, TERMINAL):
            self._instance_of.pop(key, None)
        inbox = self._streams.get(key) if key is not None else None
        if inbox is not None and not inbox.put(event):
            return key
        return None

    async def _learn_instance(self) -> None:
        """Wait for the streamer's instance (a heartbeat's answer) before a first submit: a
        request sent to an instance not yet known could not be told lost if that streamer
        restarted before answering, and would wait for a terminal that never comes."""
        if self._instance_known is None:
            self._instance_known = anyio.Event()
        known = self._instance_known
        await self._sock.send(Heartbeat())
        await known.wait()

    def _on_instance(self, instance: int) -> None:
        """A new streamer instance has none of the requests sent to the old one."""
        if self._instance_known is not None:
            self._instance_known.set()
        old, self._instance = self._instance, instance
        if old is None or old == instance:
            return
        for rid, sent_to in list(self._instance_of.items()):
            if sent_to != instance:
                self._fail(rid, "engine_restarted: the streamer restarted and lost the request")

    def _fail(self, rid: str, reason: str) -> None:
        self._instance_of.pop(rid, None)
        inbox = self._streams.get(rid)
        if inbox is not None:
            inbox.end(Failed(rid, reason))

    async def _heartbeats(self) -> None:
        """Heartbeats while requests are open; fail them all if the engine stops answering."""
        while True:
            await anyio.sleep(self.heartbeat_interval)
            if not self._streams:
                continue
            silent = time.monotonic() - self._last_answer
            if silent > self.engine_timeout and self._instance_of:
                for rid in list(self._instance_of):
                    self._fail(rid, f"engine_unreachable: no answer from {self.endpoint} "
                                    f"for {silent:.1f}s")
                    with anyio.move_on_after(self.heartbeat_interval):
                        await self._sock.send(Cancel(rid))     # in case it is only slow
            # with no peer connected (the engine is gone) ZeroMQ blocks a send: never wait
            # here, or the silence above would never be noticed
            with anyio.move_on_after(self.heartbeat_interval):
                await self._sock.send(Heartbeat())

    def _open(self, key: str) -> Inbox:
        if not self._streams:                 # idle time is not silence
            self._last_answer = time.monotonic()
        inbox = self._streams[key] = Inbox(self.stream_buffer, self.stall_timeout)
        return inbox

    def _close_stream(self, key: str) -> None:
        self._streams.pop(key, None)
        self._instance_of.pop(key, None)

    async def stream(self, prompt: str | None = None, *, messages: list[dict] | None = None,
                     prompt_token_ids: list[int] | None = None, request_id: str | None = None,
                     tenant: str | None = None, timeout: float | None = None,
                     deadline_ms: int | None = None, priority: int = 0,
                     service_class: str | None = None, idempotency_key: str | None = None,
                     traceparent: str | None = None, session_id: str | None = None,
                     tools: list[dict | Tool] | None = None, e2e_deadline_ms: int | None = None,
                     **params: Any) -> Stream:
        """Submit a request and return its Stream. Give one of ``prompt`` (text),
        ``prompt_token_ids`` or ``messages`` (chat); ``params`` are SamplingParams fields
        (``n`` > 1 asks for parallel samples that share the prompt's KV). ``priority``:
        lower is more important when the engine must preempt. ``deadline_ms``: the first
        token's deadline, from arrival. ``e2e_deadline_ms``: the whole request's, from
        arrival (its class's ``e2e_slo_ms`` bounds it: a client may only tighten that); past
        it the request ends wherever it is, as a Completion with ``finish_reason``
        ``"deadline"`` and the output so far, or ``deadline_expired`` (RequestRejected)
        before a first token. ``service_class``: the admission class to run under (None: the
        tenant's default); a tenant may ask for its default or a lower class, and a higher
        one is rejected (``class_not_allowed``).
        What was granted is on the Completion (``service_class``, ``max_tokens``,
        ``degraded``, ``queued_s``). ``idempotency_key``: a retry with the same key (same
        tenant) attaches to the first request's stream, or gets its finished result,
        instead of running again. ``traceparent``: a W3C trace context the request's spans
        join (else a new trace, when tracing is configured). ``session_id``: the
        conversation this turn belongs to; behind a router (``weir route``) it keeps the
        conversation on the replica that holds its cached prefix while that one can serve
        it in time. ``structured``: a ``StructuredOutput`` or the keywords of
        :func:`structured_output` (``{"json": schema}``, ``{"regex": ...}``,
        ``{"choice": [...]}``, ``{"grammar": lark}``, ``{"json_object": True}``). ``tools``:
        functions for the chat template (OpenAI's shape), shown to the model where the
        template takes tools; to hold the output to a call, ask for its JSON with
        ``structured`` (the gateway's ``tool_choice`` does). ``deterministic=True``: the
        deterministic serving mode (the same bits whoever else is in the batch; slower);
        the Completion's ``pinned`` says what they are pinned to."""
        rid = request_id or uuid.uuid4().hex
        if rid in self._streams:
            raise ValueError(f"request_id {rid!r} is already open on this client")
        msgs = None if messages is None else tuple(chat_message(m) for m in messages)
        if "stop" in params and isinstance(params["stop"], str):
            params["stop"] = (params["stop"],)
        if isinstance(params.get("structured"), dict):
            params["structured"] = structured_output(**params["structured"])
        sub = Submit(rid, prompt, msgs, prompt_token_ids, SamplingParams(**params),
                     tenant or self.tenant, deadline_ms, priority, self.api_key, idempotency_key,
                     service_class=service_class, session_id=session_id,
                     tools=tuple(tool(t) for t in tools or ()), batch_events=True,
                     e2e_deadline_ms=e2e_deadline_ms)
        recv = self._open(rid)
        timeout = timeout if timeout is not None else self.timeout
        deadline = None if timeout is None else time.monotonic() + timeout
        stream = Stream(rid, self, recv, deadline, sub)
        stream.span = _TRACER.start_span("weir.submit", kind=trace.SpanKind.CLIENT,
                                         context=context_from(traceparent), attributes={
            "weir.request_id": rid, "weir.tenant": sub.tenant,
            "gen_ai.operation.name": "chat" if messages is not None else "text_completion"})
        with anyio.move_on_after(self.engine_timeout) as scope:   # no peer: a send blocks
            await self._send_submit(sub, stream.span)
        if scope.cancelled_caught:
            self._fail(rid, f"engine_unreachable: could not send to {self.endpoint} "
                            f"for {self.engine_timeout:g}s")
        return stream

    async def _send_submit(self, sub: Submit, span: Any) -> None:
        if self._instance is None:             # bounded: an engine that never answers is
            with anyio.move_on_after(self.engine_timeout):   # caught by the heartbeats
                await self._learn_instance()
        self._instance_of[sub.request_id] = self._instance
        await self._sock.send(sub, traceparent=traceparent_of(span))

    async def generate(self, prompt: str | None = None, **kwargs: Any) -> Completion:
        return await (await self.stream(prompt, **kwargs)).collect()

    async def cancel(self, request_id: str) -> None:
        await self._sock.send(Cancel(request_id))

    async def status(self, timeout: float = 5.0) -> StatusReport:
        qid = uuid.uuid4().hex
        recv = self._open("status:" + qid)
        try:
            with anyio.fail_after(timeout):          # the send too: it blocks with no peer
                await self._sock.send(StatusQuery(qid, self.api_key))
                return await recv.get()
        except TimeoutError:
            raise RequestTimeout(f"no status from {self.endpoint} within {timeout}s") from None
        finally:
            self._close_stream("status:" + qid)

    async def change_replicas(self, add: list[ReplicaAddress | str] = (),
                              remove: list[str] = (), timeout: float = 5.0) -> ReplicasChanged:
        """A router's replicas, changed (an operator's key): ``add`` engines to route to
        (``ReplicaAddress`` or ``"name=endpoint[,kv_events]"``), retire those ``remove``
        names (no new requests; let go once their open ones end). Raises WeirError with
        the router's reason when it changed nothing."""
        return await self._command(lambda qid: ChangeReplicas(
            qid, tuple(map(replica_address, add)), tuple(remove), self.api_key), timeout)

    async def config(self, action: ConfigAction, toml: str = "", version: int | None = None,
                     actor: str = "", timeout: float = 5.0) -> ConfigAnswer:
        """An engine's or a router's live config (an operator's key): ``apply`` a TOML
        text (its policy sections change live), ``rollback`` to ``version`` (None: the one
        before the current), or the ``history``. Raises WeirError with every reason when
        it changed nothing."""
        return await self._command(lambda qid: ConfigCommand(
            qid, action, toml, version, actor, self.api_key), timeout)

    async def _command(self, make, timeout: float):
        """An operator's command (``make(query id)``) and its answer; raises WeirError with
        the answer's error, RequestTimeout with none in ``timeout`` s."""
        qid = uuid.uuid4().hex
        recv = self._open("status:" + qid)
        try:
            with anyio.fail_after(timeout):
                await self._sock.send(make(qid))
                answer = await recv.get()
        except TimeoutError:
            raise RequestTimeout(f"no answer from {self.endpoint} within {timeout}s") from None
        finally:
            self._close_stream("status:" + qid)
        if answer.error is not None:
            raise WeirError(answer.error)
        return answer


class Client:
    """Blocking client; runs an AsyncClient on a background event loop thread."""

    def __init__(self, endpoint: str | None = None, **kwargs: Any) -> None:
        self._portal_cm = start_blocking_portal()
        self._portal = self._portal_cm.__enter__()
        self._async = AsyncClient(endpoint, **kwargs)
        self._async_cm = self._portal.wrap_async_context_manager(self._async)
        self._async_cm.__enter__()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        if self._portal is not None:
            self._async_cm.__exit__(None, None, None)
            self._portal_cm.__exit__(None, None, None)
            self._portal = None

    def stream(self, prompt: str | None = None, **kwargs: Any) -> SyncStream:
        return SyncStream(self._portal,
                          self._portal.call(lambda: self._async.stream(prompt, **kwargs)))

    def generate(self, prompt: str | None = None, **kwargs: Any) -> Completion:
        return self._portal.call(lambda: self._async.generate(prompt, **kwargs))

    def cancel(self, request_id: str) -> None:
        self._portal.call(self._async.cancel, request_id)

    def status(self, timeout: float = 5.0) -> StatusReport:
        return self._portal.call(self._async.status, timeout)

    def change_replicas(self, add: list[ReplicaAddress | str] = (), remove: list[str] = (),
                        timeout: float = 5.0) -> ReplicasChanged:
        return self._portal.call(self._async.change_replicas, add, remove, timeout)

    def config(self, action: ConfigAction, toml: str = "", version: int | None = None,
               actor: str = "", timeout: float = 5.0) -> ConfigAnswer:
        return self._portal.call(self._async.config, action, toml, version, actor, timeout)


class SyncStream:
    """Blocking iteration over a Stream's TextDeltas."""

    def __init__(self, portal, stream: Stream) -> None:
        self._portal, self.stream = portal, stream
        self._it = stream.__aiter__()

    @property
    def request_id(self) -> str:
        return self.stream.request_id

    @property
    def result(self) -> Completion | None:
        return self.stream.result

    def __iter__(self) -> Iterator[TextDelta]:
        while True:
            try:
                yield self._portal.call(self._it.__anext__)
            except StopAsyncIteration:
                return

    def cancel(self) -> None:
        self._portal.call(self.stream.cancel)

    def collect(self) -> Completion:
        for _ in self:
            pass
        return self.stream.result
