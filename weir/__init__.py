"""Weir: an LLM serving engine built as a scheduler. ``weir.Client`` is the SDK."""
from schemas.client import StructuredOutput
from weir.client import AsyncClient, Choice, Client, Completion
from weir.forms import structured_output
from weir.errors import (RequestCancelled, RequestFailed, RequestRejected, RequestTimeout,
                         WeirError)

__all__ = ["AsyncClient", "Choice", "Client", "Completion", "RequestCancelled", "RequestFailed",
           "RequestRejected", "RequestTimeout", "StructuredOutput", "WeirError",
           "structured_output"]
