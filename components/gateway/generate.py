"""The generation routes, ``POST /v1/completions`` and ``POST /v1/chat/completions``: a
request's way from its HTTP body to the engine (through the SDK client) and its tokens back
to the client, streamed as server-sent events or collected into one JSON answer. Each
handler takes what it needs from the app's :class:`GatewayState` (:func:`state_of`)."""
from __future__ import annotations

import hashlib
import re
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import anyio
import msgspec
from opentelemetry import trace
from starlette.requests import Request
from starlette.responses import Response

from bus import tracing
from components.gateway.batch import StreamGroup
from components.gateway.errors import error_response, from_failure, from_rejection
from components.gateway.http import GuardedStreamingResponse, check_content_type, read_body
from components.gateway.openai_api import (
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
    parse,
    submit_batch,
    validate_kwargs,
)
from components.gateway.shaping import Shaper, degraded_headers, weir_usage
from components.gateway.state import GatewayState, state_of
from components.gateway.tools import mode_of
from components.model.structured import kind as structured_kind
from schemas.limits import MAX_ID_CHARS
from weir.client import Completion, Stream
from weir.errors import RequestCancelled, RequestFailed, RequestRejected

_json = msgspec.json.Encoder()
_SAFE_REQUEST_ID = re.compile(r"[\x21-\x7e]{1,128}")     # echoed only if printable ASCII
_TRACER = trace.get_tracer("weir.gateway")


async def completions(request: Request) -> Response:
    return await _generate(state_of(request), request, CompletionRequest, chat=False)


async def chat(request: Request) -> Response:
    return await _generate(state_of(request), request, ChatCompletionRequest, chat=True)


async def _generate(state: GatewayState, request: Request, kind: type,
                    chat: bool) -> Response:
    span = _TRACER.start_span(f"POST {request.url.path}", kind=trace.SpanKind.SERVER,
                              context=tracing.context_from(request.headers.get("traceparent")),
                              attributes={"http.request.method": "POST",
                                          "url.path": request.url.path})
    try:
        with trace.use_span(span, end_on_exit=False):
            response = await _generate_in_span(state, request, kind, chat, span)
    except BaseException:
        span.end()
        raise
    if not isinstance(response, GuardedStreamingResponse):
        span.set_attribute("http.response.status_code", response.status_code)
        span.end()
    return response


async def _generate_in_span(state: GatewayState, request: Request, kind: type, chat: bool,
                            span) -> Response:
    started = time.perf_counter()
    echo_id = _request_id(request)
    cfg = state.config
    try:
        if state.draining:
            raise ApiError(503, "the server is draining", "service_unavailable",
                           code="draining", retry_after=5)
        tenant = state.auth.tenant_for(request.headers.get("authorization"))
        if tenant is None:
            raise ApiError(401, "invalid API key", "authentication_error",
                           code="invalid_api_key")
        check_content_type(request.headers.get("content-type"))
        body = await read_body(request, cfg.max_body_bytes, cfg.read_timeout_s)
        req = parse(body, kind)
        batch = submit_batch(req, state.model, request.headers.get("x-weir-class"))
        for kwargs in batch:
            validate_kwargs(kwargs, state.max_model_len)
        for kwargs in batch:
            if (so := kwargs.get("structured")) is not None:
                state.metrics.structured.labels(state.model, structured_kind(so)).inc()
        rid = uuid.uuid4().hex
        idempotency_key = request.headers.get("idempotency-key") or None
        if idempotency_key is not None and len(idempotency_key) > MAX_ID_CHARS:
            raise ApiError(400, f"Idempotency-Key must be at most {MAX_ID_CHARS} characters",
                           code="invalid_idempotency_key")
        session_id = request.headers.get("x-session-id") or None
        if session_id is not None and len(session_id) > MAX_ID_CHARS:
            raise ApiError(400, f"X-Session-Id must be at most {MAX_ID_CHARS} characters",
                           code="invalid_session_id")
        if len(batch) > 1:
            stream = StreamGroup(await _open_all(state, batch, rid, tenant, idempotency_key,
                                                 session_id), req.n)
        else:
            stream = await state.client.stream(request_id=rid, tenant=tenant,
                                               idempotency_key=idempotency_key,
                                               session_id=session_id, **batch[0])
        events = stream.__aiter__()

        async def first_event():
            try:
                return await events.__anext__()
            except StopAsyncIteration:
                return None

        try:
            gone, first = await _unless_disconnected(request, first_event)
        except (RequestRejected, RequestFailed, RequestCancelled) as exc:
            if isinstance(stream, StreamGroup):    # the batch's other prompts: freed
                with anyio.CancelScope(shield=True):
                    await stream.abandon()
            if isinstance(exc, RequestRejected):
                raise from_rejection(exc) from None
            raise from_failure(exc) from None
        if gone:
            return await _client_gone(state, stream, events, echo_id)
    except ApiError as err:
        state.metrics.error(f"http_{err.status}")
        return error_response(err, echo_id)
    state.metrics.ttft.labels(state.model).observe(time.perf_counter() - started)
    shaper = Shaper(chat, rid, state.model, None if chat else req,
                    mode_of(req.tools, req.tool_choice) if chat else None)
    headers = {"x-request-id": echo_id}
    if req.stream:
        # The SDK stream consumed Accepted before yielding ``first`` (admission sends it
        # as it passes the request on, ahead of any token): a degrade is known before
        # the response starts, so its headers go out with it.
        if (acc := stream.accepted) is not None:
            headers.update(degraded_headers(acc.degraded, acc.max_tokens))
            if acc.pinned is not None:
                shaper.fingerprint = acc.pinned.fingerprint
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        body = _sse(state, stream, events, first, shaper, include_usage, started, span, req.n)
        return GuardedStreamingResponse(
            body, stall_timeout_s=cfg.stream_stall_timeout_s,
            on_stall=lambda: state.metrics.error("stalled"),
            media_type="text/event-stream", headers=headers)
    return await _collect(state, request, stream, events, shaper, started, headers)


async def _client_gone(state: GatewayState, stream: Stream, events,
                       echo_id: str) -> Response:
    """The client left before its response: free the request's KV now."""
    state.metrics.error("cancelled")
    with anyio.CancelScope(shield=True):
        await stream.abandon()
        await events.aclose()
    return error_response(ApiError(400, "the client disconnected",
                                   code="client_disconnected"), echo_id)


async def _open_all(state: GatewayState, batch: list[dict[str, Any]], rid: str, tenant: str,
                    idempotency_key: str | None, session_id: str | None) -> list[Stream]:
    """One engine request per prompt of a batch, ids ``<rid>-<i>``; an Idempotency-Key
    becomes one per prompt (a retry of the batch attaches to each). If one cannot be
    sent, those sent are abandoned and the error raised."""
    streams: list[Stream] = []
    key = idempotency_key
    if key is not None and len(key) > 200:
        key = hashlib.sha256(key.encode()).hexdigest()
    try:
        for i, kwargs in enumerate(batch):
            streams.append(await state.client.stream(
                request_id=f"{rid}-{i}", tenant=tenant, session_id=session_id,
                idempotency_key=None if key is None else f"{key}#{i}", **kwargs))
    except BaseException:
        with anyio.CancelScope(shield=True):
            await StreamGroup(streams, 1).abandon()
        raise
    return streams


async def _collect(state: GatewayState, request: Request, stream: Stream, events,
                   shaper: Shaper, started: float, headers: dict) -> Response:
    async def drain() -> None:
        last = time.perf_counter()
        async for _ in events:
            now = time.perf_counter()
            state.metrics.itl.labels(state.model).observe(now - last)
            last = now

    try:
        gone, _ = await _unless_disconnected(request, drain)
        if gone:
            return await _client_gone(state, stream, events, headers["x-request-id"])
    except (RequestRejected, RequestFailed, RequestCancelled) as exc:
        # a refusal here is a batch's later prompt; a batch's other prompts still run,
        # and are abandoned (a lone stream that failed is over already)
        if isinstance(stream, StreamGroup):
            with anyio.CancelScope(shield=True):
                await stream.abandon()
        err = from_rejection(exc) if isinstance(exc, RequestRejected) else \
            from_failure(exc)
        state.metrics.error(f"http_{err.status}" if isinstance(exc, RequestRejected)
                            else "failed")
        return error_response(err, headers["x-request-id"])
    res = stream.result
    _record(state, res, started)
    prompts = stream.prompts if isinstance(stream, StreamGroup) else [res.prompt]
    shaper.prompts.update(enumerate(prompts))
    if res.pinned is not None:
        shaper.fingerprint = res.pinned.fingerprint
    body = shaper.full([(c.text, c.finish_reason, c.logprobs) for c in res.choices],
                       res.usage, _granted(res))
    headers.update(degraded_headers(res.degraded, res.max_tokens))
    return Response(_json.encode(body), media_type="application/json", headers=headers)


def _record(state: GatewayState, res, started: float) -> None:
    state.metrics.finished(res.finish_reason, res.usage.prompt_tokens,
                           res.usage.completion_tokens, res.queue_time_s,
                           time.perf_counter() - started, res.timing)


async def _sse(state: GatewayState, stream: Stream, events, first, shaper: Shaper,
               include_usage: bool, started: float, span, n: int = 1) -> AsyncIterator[bytes]:
    def frame(obj: Any) -> bytes:
        return b"data: " + _json.encode(obj) + b"\n\n"

    done = False
    try:
        if shaper.chat:
            for index in range(n):
                yield frame(shaper.chunk("", first=True, index=index))
        last = time.perf_counter()
        itl = state.metrics.itl.labels(state.model)         # once, not per token
        if first is not None and shaper.wants(first.index, first.text, first.logprobs) \
                and (c := shaper.chunk(first.text, index=first.index,
                                       logprobs=first.logprobs or None,
                                       prompt=first.prompt)) is not None:
            yield frame(c)
        try:
            async for delta in events:
                now = time.perf_counter()
                itl.observe(now - last)
                last = now
                # a token's text may come later
                if shaper.wants(delta.index, delta.text, delta.logprobs) \
                        and (c := shaper.chunk(delta.text, index=delta.index,
                                               logprobs=delta.logprobs or None,
                                               prompt=delta.prompt)) is not None:
                    yield frame(c)
        except (RequestFailed, RequestCancelled, RequestRejected) as exc:
            # a refusal here is a batch's later prompt; a batch's other prompts still
            # run, and are abandoned (a lone stream that failed is over already)
            if isinstance(stream, StreamGroup):
                with anyio.CancelScope(shield=True):
                    await stream.abandon()
            state.metrics.error("failed")
            yield frame(from_failure(exc).body())
            done = True
            return
        res = stream.result
        done = True
        _record(state, res, started)
        for c in res.choices:
            yield frame(shaper.chunk(None if shaper.chat else "", c.finish_reason,
                                     index=c.index))
        if include_usage:
            yield frame(shaper.usage_chunk(res.usage, _granted(res)))
        yield b"data: [DONE]\n\n"
    finally:
        if not done:                       # the client went away mid-stream
            state.metrics.error("cancelled")
            span.set_attribute("weir.client_disconnected", True)
            with anyio.CancelScope(shield=True):
                await stream.abandon()
                await events.aclose()
        span.set_attribute("http.response.status_code", 200)
        span.end()


def _request_id(request: Request) -> str:
    given = request.headers.get("x-request-id")
    return given if given and _SAFE_REQUEST_ID.fullmatch(given) else uuid.uuid4().hex



def _granted(res: Completion) -> dict[str, Any]:
    """The usage's ``weir`` object: what admission granted the finished request, and
    whether its end-to-end deadline cut it short."""
    return weir_usage(res.service_class, res.degraded, res.max_tokens, res.queued_s,
                      any(c.finish_reason == "deadline" for c in res.choices), res.pinned)


async def _unless_disconnected(request: Request, work) -> tuple[bool, Any]:
    """Await ``work()`` unless the client disconnects first (its body is read, so the next
    ASGI message is the disconnect). Returns (disconnected, result); ``work``'s exceptions
    propagate as themselves."""
    outcome: list[Any] = []
    gone = False
    async with anyio.create_task_group() as tg:
        async def watch() -> None:
            nonlocal gone
            while (await request.receive())["type"] != "http.disconnect":
                pass
            gone = True
            tg.cancel_scope.cancel()

        async def run() -> None:
            try:
                outcome.append((True, await work()))
            except Exception as exc:                  # re-raised below, outside the group
                outcome.append((False, exc))
            tg.cancel_scope.cancel()

        tg.start_soon(watch)
        tg.start_soon(run)
    if gone and not outcome:
        return True, None
    ok, value = outcome[0]
    if not ok:
        raise value
    return False, value
