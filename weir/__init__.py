"""Weir: an LLM serving engine built as a scheduler. ``weir.Client`` is the SDK.

The SDK's names load on first use: every component process starts as
``python -m weir.launch``, which imports this package, and only the gateway uses the SDK
(importing the client, its sockets and tracing first cost each process about 35 ms of CPU).
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from schemas.client import StructuredOutput
    from weir.client import AsyncClient, Choice, Client, Completion
    from weir.errors import (
        RequestCancelled,
        RequestFailed,
        RequestRejected,
        RequestTimeout,
        WeirError,
    )
    from weir.forms import structured_output

_WHERE = {"StructuredOutput": "schemas.client",
          "AsyncClient": "weir.client", "Choice": "weir.client", "Client": "weir.client",
          "Completion": "weir.client", "structured_output": "weir.forms",
          "RequestCancelled": "weir.errors", "RequestFailed": "weir.errors",
          "RequestRejected": "weir.errors", "RequestTimeout": "weir.errors",
          "WeirError": "weir.errors"}

__all__ = ["AsyncClient", "Choice", "Client", "Completion", "RequestCancelled", "RequestFailed",
           "RequestRejected", "RequestTimeout", "StructuredOutput", "WeirError",
           "structured_output"]


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        return getattr(importlib.import_module(_WHERE[name]), name)
    raise AttributeError(f"module 'weir' has no attribute {name!r}")
