"""The OpenAI-compatible HTTP app (Starlette). It is a client of the streamer via the SDK."""
from __future__ import annotations

import hashlib
import math
import re
import time
import uuid
from typing import Any, AsyncIterator

import anyio
import msgspec
from opentelemetry import trace
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from bus import tracing
from schemas.client import STRUCTURED_OUTPUT_ERROR, StatusReport
from schemas.config import GatewayConfig
from schemas.limits import MAX_ID_CHARS
from components.gateway.auth import Authenticator
from components.gateway.batch import StreamGroup
from components.gateway.http import GuardedStreamingResponse, check_content_type, read_body
from components.gateway.metrics import GatewayMetrics
from components.gateway.openai_api import (ApiError, ChatCompletionRequest, CompletionRequest,
                                           parse, submit_batch, validate_kwargs)
from components.gateway.shaping import Shaper, degraded_headers, weir_usage
from components.gateway.tools import mode_of
from components.model.structured import kind as structured_kind
from weir.client import AsyncClient, Completion, Stream
from weir.errors import RequestCancelled, RequestFailed, RequestRejected, RequestTimeout

# A tenant past one of its own budgets is 429 (it may retry when its budget refills); an
# engine that cannot serve the request in time is 503, Retry-After where admission gave
# one. deadline_expired is 503, not 504: the request waited in admission's queue and never
# started, so nothing upstream timed out mid-work; it is the same load signal as
# queue_full, and proxies read a 504 as a hung backend.
_REJECT_STATUS = {"tenant_over_budget": 429, "tenant_token_budget": 429,
                  "tenant_kv_budget": 429, "overloaded": 503, "draining": 503,
                  "queue_full": 503, "deadline_unmeetable": 503, "deadline_expired": 503,
                  "kv_pressure": 503, "tpot_slo_at_risk": 503,
                  "unknown_tenant": 403, "class_not_allowed": 403,
                  # the IETF Idempotency-Key draft: a key reused with another payload
                  "idempotency_key_reused": 422}
_json = msgspec.json.Encoder()
_SAFE_REQUEST_ID = re.compile(r"[\x21-\x7e]{1,128}")     # echoed only if printable ASCII
_TRACER = trace.get_tracer("weir.gateway")


class GatewayState:
    """What the routes share: the SDK client, auth, metrics and lifecycle flags."""

    def __init__(self, client: AsyncClient, auth: Authenticator, model: str,
                 config: GatewayConfig | None = None, max_model_len: int = 2048) -> None:
        self.client, self.auth, self.model = client, auth, model
        self.config = config if config is not None else GatewayConfig()
        self.max_model_len = max_model_len
        self.metrics = GatewayMetrics(model)
        self.draining = False
        self._ready_at = -1.0               # monotonic time of the last engine check
        self._engine_ready = False
        self._dead: list[str] = []          # components the engine reports given up on
        self._answered_at = time.monotonic()   # the engine last answered a status query

    async def engine_ready(self, max_age_s: float = 1.0) -> bool:
        """Whether every component of the engine reports ready (the gateway comes up
        before the model does): the supervisor's status, asked at most once per
        ``max_age_s``."""
        now = time.monotonic()
        if now - self._ready_at >= max_age_s:
            try:
                report = await self.client.status(timeout=2.0)
                self._engine_ready = all_ready(report)
                self._dead = [c.name for c in report.components if c.state == "dead"]
                self._answered_at = now
            except RequestTimeout:
                self._engine_ready = False
            self._ready_at = now
        return self._engine_ready

    async def engine_dead(self, unreachable_s: float = 30.0) -> str | None:
        """Why this engine will not serve again without a restart, or None: a component
        it gave up on (past ``supervisor.max_restarts``), or no answer to a status query
        for ``unreachable_s`` (its client-facing process is gone). ``/health`` fails on
        it, so a liveness probe restarts the pod; a restart in progress (seconds) is not
        death."""
        await self.engine_ready()
        if self._dead:
            return f"engine components given up on: {', '.join(self._dead)}"
        if time.monotonic() - self._answered_at > unreachable_s:
            return f"the engine has not answered for {unreachable_s:g} s"
        return None


def all_ready(report: StatusReport) -> bool:
    """Every component alive and past start-up."""
    return bool(report.components) and all(c.alive and c.state == "ready"
                                           for c in report.components)


def _error_response(err: ApiError, request_id: str | None = None) -> JSONResponse:
    headers = {} if request_id is None else {"x-request-id": request_id}
    if err.retry_after is not None:
        headers["Retry-After"] = str(max(1, math.ceil(err.retry_after)))
    if err.status in (408, 413):          # the rest of the body is unread: end the connection
        headers["Connection"] = "close"
    return JSONResponse(err.body(), status_code=err.status, headers=headers)


def _request_id(request: Request) -> str:
    given = request.headers.get("x-request-id")
    return given if given and _SAFE_REQUEST_ID.fullmatch(given) else uuid.uuid4().hex


def _from_rejection(exc: RequestRejected) -> ApiError:
    status = _REJECT_STATUS.get(exc.reason, 400)
    kind = {429: "rate_limit_exceeded", 503: "service_unavailable", 403: "permission_error"}
    return ApiError(status, exc.message, kind.get(status, "invalid_request_error"),
                    code=exc.reason, retry_after=exc.retry_after_s if status in (429, 503) else None)


def _from_failure(exc: RequestFailed | RequestCancelled) -> ApiError:
    """A request the engine could not finish: 500, but 400 where its structured output went
    past llguidance's limits while it ran. That is the request's own language, as a
    language refused up front is: a retry fails the same way, and OpenAI's SDKs retry a 5xx
    (twice by default), never a 400."""
    reason = getattr(exc, "reason", "")
    if isinstance(exc, RequestFailed) and reason.startswith(STRUCTURED_OUTPUT_ERROR):
        why = reason[len(STRUCTURED_OUTPUT_ERROR):].lstrip(": ")
        return ApiError(400, "the structured output's language went past the grammar "
                             f"engine's limits while generating: {why}",
                        code=STRUCTURED_OUTPUT_ERROR)
    return ApiError(500, f"request failed: {exc}", "server_error")


def _granted(res: Completion) -> dict[str, Any]:
    """The usage's ``weir`` object: what admission granted the finished request, and
    whether its end-to-end deadline cut it short."""
    return weir_usage(res.service_class, res.degraded, res.max_tokens, res.queued_s,
                      any(c.finish_reason == "deadline" for c in res.choices))


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


def build_app(state: GatewayState) -> Starlette:
    async def models(request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [
            {"id": state.model, "object": "model", "created": 0, "owned_by": "weir"}]})

    async def health(request: Request) -> Response:
        if (why := await state.engine_dead()) is not None:
            return JSONResponse({"status": "dead", "reason": why}, status_code=503)
        return JSONResponse({"status": "ok"})

    async def ready(request: Request) -> Response:
        ok = not state.draining and await state.engine_ready()
        return JSONResponse({"ready": ok}, status_code=200 if ok else 503)

    async def metrics(request: Request) -> Response:
        allowed, tenant = state.auth.metrics_scope(request.headers.get("authorization"))
        if not allowed:
            raise ApiError(401, "/metrics needs an API key (an operator key sees every "
                                "tenant)", "authentication_error", code="invalid_api_key")
        try:
            report = await state.client.status(timeout=2.0)
            state.metrics.engine.stats = {c.name: c.stats for c in report.components}
            state.metrics.engine.tenants = {t: u for c in report.components
                                            for t, u in c.tenants.items()}
        except RequestTimeout:
            pass
        return Response(state.metrics.render(tenant), media_type=CONTENT_TYPE_LATEST)

    async def completions(request: Request) -> Response:
        return await _generate(request, CompletionRequest, chat=False)

    async def chat(request: Request) -> Response:
        return await _generate(request, ChatCompletionRequest, chat=True)

    async def _generate(request: Request, kind: type, chat: bool) -> Response:
        span = _TRACER.start_span(f"POST {request.url.path}", kind=trace.SpanKind.SERVER,
                                  context=tracing.context_from(request.headers.get("traceparent")),
                                  attributes={"http.request.method": "POST",
                                              "url.path": request.url.path})
        try:
            with trace.use_span(span, end_on_exit=False):
                response = await _generate_in_span(request, kind, chat, span)
        except BaseException:
            span.end()
            raise
        if not isinstance(response, GuardedStreamingResponse):
            span.set_attribute("http.response.status_code", response.status_code)
            span.end()
        return response

    async def _generate_in_span(request: Request, kind: type, chat: bool, span) -> Response:
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
                stream = StreamGroup(await _open_all(batch, rid, tenant, idempotency_key,
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
                    raise _from_rejection(exc) from None
                raise _from_failure(exc) from None
            if gone:
                return await _client_gone(stream, events, echo_id)
        except ApiError as err:
            state.metrics.error(f"http_{err.status}")
            return _error_response(err, echo_id)
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
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            body = _sse(stream, events, first, shaper, include_usage, started, span, req.n)
            return GuardedStreamingResponse(
                body, stall_timeout_s=cfg.stream_stall_timeout_s,
                on_stall=lambda: state.metrics.error("stalled"),
                media_type="text/event-stream", headers=headers)
        return await _collect(request, stream, events, shaper, started, headers)

    async def _client_gone(stream: Stream, events, echo_id: str) -> Response:
        """The client left before its response: free the request's KV now."""
        state.metrics.error("cancelled")
        with anyio.CancelScope(shield=True):
            await stream.abandon()
            await events.aclose()
        return _error_response(ApiError(400, "the client disconnected",
                                        code="client_disconnected"), echo_id)

    async def _open_all(batch: list[dict[str, Any]], rid: str, tenant: str,
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

    async def _collect(request: Request, stream: Stream, events, shaper: Shaper,
                       started: float, headers: dict) -> Response:
        async def drain() -> None:
            last = time.perf_counter()
            async for _ in events:
                now = time.perf_counter()
                state.metrics.itl.labels(state.model).observe(now - last)
                last = now

        try:
            gone, _ = await _unless_disconnected(request, drain)
            if gone:
                return await _client_gone(stream, events, headers["x-request-id"])
        except (RequestRejected, RequestFailed, RequestCancelled) as exc:
            # a refusal here is a batch's later prompt; a batch's other prompts still run,
            # and are abandoned (a lone stream that failed is over already)
            if isinstance(stream, StreamGroup):
                with anyio.CancelScope(shield=True):
                    await stream.abandon()
            err = _from_rejection(exc) if isinstance(exc, RequestRejected) else \
                _from_failure(exc)
            state.metrics.error(f"http_{err.status}" if isinstance(exc, RequestRejected)
                                else "failed")
            return _error_response(err, headers["x-request-id"])
        res = stream.result
        _record(res, started)
        prompts = stream.prompts if isinstance(stream, StreamGroup) else [res.prompt]
        shaper.prompts.update(enumerate(prompts))
        body = shaper.full([(c.text, c.finish_reason, c.logprobs) for c in res.choices],
                           res.usage, _granted(res))
        headers.update(degraded_headers(res.degraded, res.max_tokens))
        return Response(_json.encode(body), media_type="application/json", headers=headers)

    def _record(res, started: float) -> None:
        state.metrics.finished(res.finish_reason, res.usage.prompt_tokens,
                               res.usage.completion_tokens, res.queue_time_s,
                               time.perf_counter() - started, res.timing)

    async def _sse(stream: Stream, events, first, shaper: Shaper, include_usage: bool,
                   started: float, span, n: int = 1) -> AsyncIterator[bytes]:
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
                yield frame(_from_failure(exc).body())
                done = True
                return
            res = stream.result
            done = True
            _record(res, started)
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

    routes = [
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", chat, methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/ready", ready, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
    ]

    # Client errors raised anywhere are answered as what they are; only a real fault is 500.
    async def api_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, ApiError)
        state.metrics.error(f"http_{exc.status}")
        return _error_response(exc)

    async def http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return JSONResponse(ApiError(exc.status_code, str(exc.detail), kind).body(),
                            status_code=exc.status_code, headers=exc.headers)

    async def disconnected(request: Request, exc: Exception) -> Response:
        state.metrics.error("client_disconnected")
        return _error_response(ApiError(400, "the client disconnected",
                                        code="client_disconnected"))

    async def internal_error(request: Request, exc: Exception) -> Response:
        state.metrics.error("http_500")
        return JSONResponse(ApiError(500, "internal server error", "server_error").body(),
                            status_code=500)

    return Starlette(routes=routes, exception_handlers={
        ApiError: api_error, HTTPException: http_error, ClientDisconnect: disconnected,
        Exception: internal_error})
