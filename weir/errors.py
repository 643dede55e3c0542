"""Typed exceptions raised by the SDK."""
from __future__ import annotations


class WeirError(Exception):
    """Base class for every SDK error."""


class RequestRejected(WeirError):
    """The engine refused the request before running it."""

    def __init__(self, request_id: str, reason: str, message: str,
                 retry_after_s: float | None = None) -> None:
        super().__init__(f"{reason}: {message}")
        self.request_id, self.reason, self.message = request_id, reason, message
        self.retry_after_s = retry_after_s


class RequestFailed(WeirError):
    """The engine accepted the request but could not complete it."""

    def __init__(self, request_id: str, reason: str) -> None:
        super().__init__(reason)
        self.request_id, self.reason = request_id, reason


class RequestCancelled(WeirError):
    """The request was cancelled by the engine on the client's behalf (e.g. timeout)."""

    def __init__(self, request_id: str, reason: str) -> None:
        super().__init__(reason)
        self.request_id, self.reason = request_id, reason


class RequestTimeout(WeirError, TimeoutError):
    """No terminal message arrived in time; the request was cancelled."""


class ProtocolViolation(WeirError):
    """The server could not decode something this client sent."""
