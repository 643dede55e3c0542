"""Request validation: pure checks that turn bad input into a clear rejection reason."""
from __future__ import annotations

import math

from schemas.wire import SamplingParams

MAX_STOP_STRINGS = 16
MAX_N = 16


def check_params(p: SamplingParams) -> str | None:
    """Return why these sampling parameters are invalid, or None."""
    if p.max_tokens is not None and p.max_tokens <= 0:
        return f"max_tokens must be at least 1, got {p.max_tokens}"
    if not math.isfinite(p.temperature) or p.temperature < 0:
        return f"temperature must be a finite number >= 0, got {p.temperature}"
    if not math.isfinite(p.top_p) or not 0 < p.top_p <= 1:
        return f"top_p must be in (0, 1], got {p.top_p}"
    if p.top_k < 0:
        return f"top_k must be >= 0 (0 disables it), got {p.top_k}"
    if p.seed is not None and not -(2**63) <= p.seed < 2**63:
        return "seed must fit in a signed 64-bit integer"
    if len(p.stop) > MAX_STOP_STRINGS or any(not s for s in p.stop):
        return f"stop must hold at most {MAX_STOP_STRINGS} non-empty strings"
    if any(t < 0 for t in p.stop_token_ids):
        return "stop_token_ids must be non-negative"
    if not 1 <= p.n <= MAX_N:
        return f"n must be in [1, {MAX_N}], got {p.n}"
    return None


def check_length(prompt_len: int, max_tokens: int | None,
                 max_model_len: int) -> tuple[str, str] | None:
    """Return (reason, message) if the prompt cannot fit the context window, or None."""
    if prompt_len == 0:
        return "invalid_request", "the prompt is empty"
    if prompt_len >= max_model_len:
        return "prompt_too_long", (f"the prompt has {prompt_len} tokens; the context window is "
                                   f"{max_model_len} tokens, including at least one output token")
    if max_tokens is not None and prompt_len + max_tokens > max_model_len:
        return "invalid_request", (f"prompt ({prompt_len} tokens) + max_tokens ({max_tokens}) "
                                   f"exceeds the context window of {max_model_len} tokens")
    return None
