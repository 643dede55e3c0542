"""structlog JSON logging for every process. Payloads (prompts, completions) are never logged."""
from __future__ import annotations

import logging
import os
import sys
from collections.abc import MutableMapping
from typing import Any

import structlog
from opentelemetry import trace

_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING,
           "error": logging.ERROR}


def _add_trace_ids(logger: Any, method: str, event: MutableMapping[str, Any]
                   ) -> MutableMapping[str, Any]:
    """Every line carries the current trace and span id (when a span is active)."""
    ctx = trace.get_current_span().get_span_context()
    if ctx.is_valid:
        event.setdefault("trace_id", f"{ctx.trace_id:032x}")
        event.setdefault("span_id", f"{ctx.span_id:016x}")
    return event


def configure(component: str, level: str = "info") -> None:
    level = os.environ.get("WEIR_LOG_LEVEL", level).lower()
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            _add_trace_ids,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            structlog.processors.JSONRenderer(),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(_LEVELS.get(level, logging.INFO)),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )
    structlog.contextvars.bind_contextvars(component=component, pid=os.getpid())
