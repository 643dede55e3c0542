"""What the gateway's routes share (the SDK client, auth, metrics, lifecycle flags), and how
a handler finds it: :func:`build_app` keeps it on the app, :func:`state_of` reads it back."""
from __future__ import annotations

import time

from starlette.requests import Request

from components.gateway.auth import Authenticator
from components.gateway.metrics import GatewayMetrics
from schemas.client import StatusReport
from schemas.config import GatewayConfig
from weir.client import AsyncClient
from weir.errors import RequestTimeout


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


def state_of(request: Request) -> GatewayState:
    """The gateway state of the app that routed ``request`` (``app.state.gateway``)."""
    return request.app.state.gateway
