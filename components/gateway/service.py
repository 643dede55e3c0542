"""The gateway process: serves the OpenAI-compatible HTTP API with uvicorn and talks to
the streamer through the ZeroMQ SDK like any other client."""
from __future__ import annotations

import contextlib
import re

import structlog
import uvicorn

from bus.component import Component
from bus.identity import load_service_key
from components.gateway.app import build_app
from components.gateway.auth import Authenticator
from components.gateway.protocol import guarded_protocol
from components.gateway.state import GatewayState
from components.model.fetch import resolve_model
from weir.client import AsyncClient

log = structlog.get_logger("gateway")


def served_model_name(model: str, configured: str) -> str:
    """The id clients use: configured, or the weights' name without a quantization suffix."""
    if configured:
        return configured
    path = resolve_model(model)
    name = path.stem if path.suffix == ".gguf" else path.name
    return re.sub(r"\.(Q\d\w*|F16|F32|BF16)$", "", name, flags=re.I)


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self):                    # the supervisor owns signals
        yield


class GatewayService(Component):
    name = "gateway"

    async def setup(self) -> None:
        gw = self.config.gateway
        self.model = served_model_name(self.config.engine.model, gw.served_model_name)
        self.auth = Authenticator(gw.api_keys)
        self.gw: GatewayState | None = None

    async def run(self) -> None:
        gw = self.config.gateway
        # The gateway authenticated its callers itself: it speaks for them with the service
        # credential, and passes rejections (Retry-After included) on instead of retrying.
        async with AsyncClient(self.topology.client_connect, max_retries=0,
                               api_key=load_service_key()) as client:
            self.gw = GatewayState(client, self.auth, self.model, gw,
                                   self.config.engine.max_model_len)
            server = _Server(uvicorn.Config(
                build_app(self.gw), host=gw.host, port=gw.port, log_level="warning",
                access_log=False, lifespan="off", timeout_graceful_shutdown=5,
                # a first byte within first_byte_timeout_s, headers within read_timeout_s
                # of it and 64 KiB, a send buffer that does not drain for
                # stream_stall_timeout_s aborts the connection; at max_connections idle
                # connections are shed, then new requests get 503
                http=guarded_protocol(gw), limit_concurrency=gw.max_connections))
            log.info("http_listening", host=gw.host, port=gw.port, model=self.model)
            await server.serve()

    async def drain(self) -> None:
        if self.gw is not None:
            self.gw.draining = True
