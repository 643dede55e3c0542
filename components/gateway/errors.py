"""The gateway's error answers: an engine's refusal or failure as an OpenAI-style error
(its HTTP status, type and code), and an :class:`ApiError` as its JSON response."""
from __future__ import annotations

import math

from starlette.responses import JSONResponse

from components.gateway.openai_api import ApiError
from schemas.client import STRUCTURED_OUTPUT_ERROR
from weir.errors import RequestCancelled, RequestFailed, RequestRejected

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


def error_response(err: ApiError, request_id: str | None = None) -> JSONResponse:
    headers = {} if request_id is None else {"x-request-id": request_id}
    if err.retry_after is not None:
        headers["Retry-After"] = str(max(1, math.ceil(err.retry_after)))
    if err.status in (408, 413):          # the rest of the body is unread: end the connection
        headers["Connection"] = "close"
    return JSONResponse(err.body(), status_code=err.status, headers=headers)


def from_rejection(exc: RequestRejected) -> ApiError:
    status = _REJECT_STATUS.get(exc.reason, 400)
    kind = {429: "rate_limit_exceeded", 503: "service_unavailable", 403: "permission_error"}
    return ApiError(status, exc.message, kind.get(status, "invalid_request_error"),
                    code=exc.reason,
                    retry_after=exc.retry_after_s if status in (429, 503) else None)


def from_failure(exc: RequestFailed | RequestCancelled) -> ApiError:
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
