"""The OpenAI-compatible HTTP app (Starlette). It is a client of the streamer via the SDK.

:func:`build_app` only wires: each route's handler is a module-level function that finds
the gateway's shared :class:`~components.gateway.state.GatewayState` on the app
(:func:`~components.gateway.state.state_of`). The generation routes are in
:mod:`components.gateway.generate`; the small ones and the error handlers are here."""
from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from components.gateway.errors import error_response
from components.gateway.generate import chat, completions
from components.gateway.openai_api import ApiError
from components.gateway.state import GatewayState, state_of
from weir.errors import RequestTimeout


async def models(request: Request) -> Response:
    return JSONResponse({"object": "list", "data": [
        {"id": state_of(request).model, "object": "model", "created": 0, "owned_by": "weir"}]})


async def health(request: Request) -> Response:
    if (why := await state_of(request).engine_dead()) is not None:
        return JSONResponse({"status": "dead", "reason": why}, status_code=503)
    return JSONResponse({"status": "ok"})


async def ready(request: Request) -> Response:
    state = state_of(request)
    ok = not state.draining and await state.engine_ready()
    return JSONResponse({"ready": ok}, status_code=200 if ok else 503)


async def metrics(request: Request) -> Response:
    state = state_of(request)
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


# Client errors raised anywhere are answered as what they are; only a real fault is 500.
async def api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, ApiError)
    state_of(request).metrics.error(f"http_{exc.status}")
    return error_response(exc)


async def http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
    return JSONResponse(ApiError(exc.status_code, str(exc.detail), kind).body(),
                        status_code=exc.status_code, headers=exc.headers)


async def disconnected(request: Request, exc: Exception) -> Response:
    state_of(request).metrics.error("client_disconnected")
    return error_response(ApiError(400, "the client disconnected",
                                   code="client_disconnected"))


async def internal_error(request: Request, exc: Exception) -> Response:
    state_of(request).metrics.error("http_500")
    return JSONResponse(ApiError(500, "internal server error", "server_error").body(),
                        status_code=500)


def build_app(state: GatewayState) -> Starlette:
    """The app serving ``state``'s engine: its routes and error handlers, with ``state``
    kept on it for the handlers."""
    routes = [
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", chat, methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/ready", ready, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
    ]
    app = Starlette(routes=routes, exception_handlers={
        ApiError: api_error, HTTPException: http_error, ClientDisconnect: disconnected,
        Exception: internal_error})
    app.state.gateway = state
    return app
