"""Request validation: pure checks that turn bad input into a clear rejection reason.

This module is the one place that says what a request may ask for. The checks run once,
at the edge — the streamer calls :func:`check_submit` for every ``Submit`` that arrives over
ZeroMQ (the HTTP gateway calls it too, before it submits any prompt of a batch, so a batch
with one bad prompt is a 400 with none of them started), so a bad request is refused
before it costs a tokenizer pass. Nothing after the edge checks the parameters again; only
what needs the prompt's tokens is checked later: the tokenizer checks ids against the
vocabulary, admission the length (:func:`check_length`) and ``n`` against
``scheduler.max_num_seqs``.

The limits, and why each is what it is, are in ``schemas/limits.py``.

Every field is bounded, so a legal ``Submit`` has a largest encoding:
:func:`client_frame_limit` (``frames.py``), the frame bound of the client sockets.
"""
from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable
from typing import Any

from schemas.client import SamplingParams, StructuredOutput
from schemas.limits import (
    CHARS_PER_TOKEN_BOUND,
    INT64_MAX,
    INT64_MIN,
    LOGIT_BIAS_LIMIT,
    MAX_API_KEY_CHARS,
    MAX_CHOICES,
    MAX_GRAMMAR_CHARS,
    MAX_ID_CHARS,
    MAX_LOGIT_BIAS,
    MAX_LOGPROBS,
    MAX_MAX_TOKENS,
    MAX_N,
    MAX_PENALTY,
    MAX_REPETITION_PENALTY,
    MAX_STOP_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    MAX_TEMPERATURE,
    MAX_TOKEN_ID,
    MAX_TOOLS,
    MAX_TOP_K,
    UINT64_MAX,
)

_TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")

Reason = tuple[str, str]            # (reject reason, message), as in ``Rejected``


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_num(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _token_ids_bad(ids: Iterable[Any]) -> bool:
    return any(not _is_int(t) or not 0 <= t <= MAX_TOKEN_ID for t in ids)


def check_params(p: SamplingParams) -> str | None:
    """Return why these sampling parameters are invalid, or None. Types are checked too,
    so a ``SamplingParams`` built in-process (not decoded) is safe to pass."""
    if p.max_tokens is not None and (not _is_int(p.max_tokens)
                                     or not 1 <= p.max_tokens <= MAX_MAX_TOKENS):
        return f"max_tokens must be at least 1 and at most {MAX_MAX_TOKENS}, got {p.max_tokens}"
    if not _is_num(p.temperature) or not math.isfinite(p.temperature) \
            or not 0 <= p.temperature <= MAX_TEMPERATURE:
        return (f"temperature must be a finite number in [0, {MAX_TEMPERATURE:g}] "
                f"(0 is greedy), got {p.temperature}")
    if not _is_num(p.top_p) or not math.isfinite(p.top_p) or not 0 < p.top_p <= 1:
        return f"top_p must be in (0, 1], got {p.top_p}"
    if not _is_int(p.top_k) or not 0 <= p.top_k <= MAX_TOP_K:
        return (f"top_k must be in [0, {MAX_TOP_K}] (0, or at least the vocabulary size, "
                f"disables it), got {p.top_k}")
    if p.seed is not None and (not _is_int(p.seed) or not INT64_MIN <= p.seed <= UINT64_MAX):
        return "seed must be an integer that fits in 64 bits"
    if not _is_int(p.n) or not 1 <= p.n <= MAX_N:
        return f"n must be in [1, {MAX_N}], got {p.n}"
    if len(p.stop) > MAX_STOP_STRINGS or any(not isinstance(s, str) or not s for s in p.stop):
        return f"stop must hold at most {MAX_STOP_STRINGS} non-empty strings"
    if any(len(s) > MAX_STOP_CHARS for s in p.stop):
        return f"each stop string must be at most {MAX_STOP_CHARS} characters"
    if len(p.stop_token_ids) > MAX_STOP_TOKEN_IDS:
        return f"stop_token_ids must hold at most {MAX_STOP_TOKEN_IDS} ids"
    if _token_ids_bad(p.stop_token_ids):
        return f"stop_token_ids must be token ids in [0, {MAX_TOKEN_ID}]"
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(p, name)
        if not _is_num(value) or not math.isfinite(value) \
                or not -MAX_PENALTY <= value <= MAX_PENALTY:
            return f"{name} must be a number in [-2, 2], got {value!r:.40}"
    r = p.repetition_penalty
    if not _is_num(r) or not math.isfinite(r) or not 0 < r <= MAX_REPETITION_PENALTY:
        return (f"repetition_penalty must be a number in (0, {MAX_REPETITION_PENALTY:g}] "
                f"(1 is off), got {r!r:.40}")
    top = MAX_MAX_TOKENS if p.max_tokens is None else p.max_tokens
    if not _is_int(p.min_tokens) or not 0 <= p.min_tokens <= top:
        return f"min_tokens must be in [0, max_tokens = {top}], got {p.min_tokens!r:.40}"
    if not _is_int(p.output_offset) or not 0 <= p.output_offset <= MAX_MAX_TOKENS:
        return f"output_offset must be in [0, {MAX_MAX_TOKENS}], got {p.output_offset!r:.40}"
    for name in ("logprobs", "prompt_logprobs"):
        k = getattr(p, name)
        if k is not None and (not _is_int(k) or not 0 <= k <= MAX_LOGPROBS):
            return f"{name} must be in [0, {MAX_LOGPROBS}], got {k!r:.40}"
    if p.logit_bias is not None:
        if not isinstance(p.logit_bias, dict):
            return "logit_bias must map token ids to biases"
        if (why := _bias_bad(p.logit_bias, lambda k: _is_int(k) and 0 <= k <= MAX_TOKEN_ID)):
            return why
    if not isinstance(p.deterministic, bool):
        return f"deterministic must be true or false, got {p.deterministic!r:.40}"
    if p.structured is not None:
        if p.min_tokens:
            return "min_tokens cannot be combined with structured output"
        return check_structured(p.structured)
    return None


def check_structured(so: StructuredOutput) -> str | None:
    """Why a ``StructuredOutput`` is malformed (not one language, or too big), or None."""
    given = [name for name in ("json", "regex", "choice", "grammar")
             if getattr(so, name) is not None] + (["json_object"] if so.json_object else [])
    if len(given) != 1:
        return ("structured output must name exactly one of json, json_object, regex, "
                f"choice or grammar, got {', '.join(given) or 'none'}")
    if so.choice is not None:
        if not 0 < len(so.choice) <= MAX_CHOICES or not all(so.choice):
            return f"choice must hold 1 to {MAX_CHOICES} non-empty strings"
        size = sum(len(c) for c in so.choice)
    else:
        size = len(so.json or so.regex or so.grammar or "")
    if size > MAX_GRAMMAR_CHARS:
        return f"structured output's {given[0]} must be at most {MAX_GRAMMAR_CHARS} characters"
    if so.json_whitespace and so.json is None and not so.json_object:
        return "json_whitespace applies to json and json_object only"
    return None


def _bias_bad(bias: dict[Any, Any], key_ok: Callable[[Any], bool]) -> str | None:
    if len(bias) > MAX_LOGIT_BIAS:
        return f"logit_bias must hold at most {MAX_LOGIT_BIAS} entries"
    for key, value in bias.items():
        if not key_ok(key):
            return f"logit_bias keys must be token ids in [0, {MAX_TOKEN_ID}], got {key!r:.40}"
        if not _is_num(value) or not math.isfinite(value) \
                or not -LOGIT_BIAS_LIMIT <= value <= LOGIT_BIAS_LIMIT:
            return f"logit_bias values must be in [-100, 100], got {value!r:.40}"
    return None


def check_logit_bias(bias: dict[Any, Any] | None) -> str | None:
    """Return why an OpenAI ``logit_bias`` map is invalid, or None. Keys are token ids as
    decimal strings (as JSON objects require), values in [-100, 100]."""
    if not bias:
        return None
    return _bias_bad(bias, lambda key: isinstance(key, str) and 0 < len(key) <= 10
                     and key.isascii() and key.isdigit() and int(key) <= MAX_TOKEN_ID)


def _field(m: Any, name: str) -> Any:
    return m.get(name) if isinstance(m, dict) else getattr(m, name, None)


def _message_chars(messages: list[Any]) -> int:
    total = 0
    for m in messages:
        total += sum(len(_field(m, k) or "") for k in ("role", "content", "tool_call_id"))
        for call in _field(m, "tool_calls") or ():
            total += sum(len(_field(call, k) or "") for k in ("id", "name", "arguments"))
    return total


def _message_items(messages: list[Any]) -> int:
    """The messages and their tool calls, counted without reading their text."""
    return len(messages) + sum(len(_field(m, "tool_calls") or ()) for m in messages)


def check_tools(tools: Iterable[Any]) -> str | None:
    """Why a request's ``tools`` are malformed (too many, a name that is not a function
    name, two with one name), or None."""
    tools = list(tools)
    if len(tools) > MAX_TOOLS:
        return f"at most {MAX_TOOLS} tools"
    names = [_field(t, "name") for t in tools]
    for name in names:
        if not isinstance(name, str) or not _TOOL_NAME.fullmatch(name):
            return (f"a tool's name must be 1 to 64 letters, digits, '_' or '-', "
                    f"got {name!r:.80}")
    if len(set(names)) != len(names):
        return "two tools have one name"
    return None


def check_prompt_size(prompt: str | None, messages: Iterable[Any] | None,
                      prompt_token_ids: list[int] | None, max_model_len: int,
                      max_prompt_chars: int | None = None, tools: Iterable[Any] = ()
                      ) -> Reason | None:
    """Size checks that need no tokenizer: (reason, message) or None. ``messages`` are
    ``ChatMessage`` structs or ``{"role", "content"}`` dicts; ``tools`` (which a chat
    template may render into the prompt) ``Tool`` structs or dicts. Text is bounded at
    ``max_prompt_chars`` characters, by default ``max_model_len * CHARS_PER_TOKEN_BOUND``."""
    limit = max_prompt_chars if max_prompt_chars is not None \
        else max_model_len * CHARS_PER_TOKEN_BOUND
    if prompt_token_ids is not None:
        if len(prompt_token_ids) >= max_model_len:
            return "prompt_too_long", (
                f"the prompt has {len(prompt_token_ids)} tokens; the context window is "
                f"{max_model_len} tokens, including at least one output token")
        if _token_ids_bad(prompt_token_ids):
            return "invalid_request", f"prompt_token_ids must be token ids in [0, {MAX_TOKEN_ID}]"
    chars = len(prompt) if prompt is not None else 0
    if messages is not None:
        messages = list(messages)
        if not messages:
            return "invalid_request", "messages is empty"
        if len(messages) > max_model_len or _message_items(messages) > max_model_len:
            return "prompt_too_long", (
                f"the prompt has more than {max_model_len} messages and tool calls; each is "
                f"at least one token of a context window of {max_model_len} tokens")
        chars += _message_chars(messages)
    chars += sum(len(_field(t, k) or "") for t in tools
                 for k in ("name", "description", "parameters"))
    if chars > limit:
        return "prompt_too_long", (
            f"the prompt has {chars} characters; at most {limit} are accepted for a context "
            f"window of {max_model_len} tokens")
    return None


def check_submit(sub: Any, max_model_len: int,
                 max_prompt_chars: int | None = None) -> Reason | None:
    """Every check that can be made on a ``Submit`` before tokenizing, as
    ``(reason, message)`` for a ``Rejected``, or None. Cheap: O(prompt size) at worst,
    with the size bounds checked before anything is iterated.

    The streamer calls it for every Submit; the gateway for every HTTP request."""
    for name in ("request_id", "idempotency_key", "tenant", "service_class", "session_id"):
        value = getattr(sub, name, None)
        if value is not None and len(value) > MAX_ID_CHARS:
            return "invalid_request", f"{name} must be at most {MAX_ID_CHARS} characters"
    api_key = getattr(sub, "api_key", None)
    if api_key is not None and len(api_key) > MAX_API_KEY_CHARS:
        return "invalid_request", f"api_key must be at most {MAX_API_KEY_CHARS} characters"
    if not _is_int(sub.priority) or not INT64_MIN <= sub.priority <= INT64_MAX:
        return "invalid_request", "priority must be an integer that fits in 64 bits"
    deadline = sub.deadline_ms
    if deadline is not None and (not _is_int(deadline) or not 0 <= deadline <= INT64_MAX):
        return "invalid_request", "deadline_ms must be >= 0 and fit in 64 bits"
    e2e = getattr(sub, "e2e_deadline_ms", None)
    if e2e is not None and (not _is_int(e2e) or not 1 <= e2e <= INT64_MAX):
        return "invalid_request", "e2e_deadline_ms must be >= 1 and fit in 64 bits"
    if (why := check_params(sub.params)) is not None:
        return "invalid_request", why
    p = sub.params
    if p.max_tokens is not None and p.max_tokens >= max_model_len:
        return "invalid_request", (f"max_tokens ({p.max_tokens}) leaves no room for the prompt "
                                   f"in the context window of {max_model_len} tokens")
    tools = getattr(sub, "tools", ()) or ()
    if tools and (why := check_tools(tools)) is not None:
        return "invalid_request", why
    return check_prompt_size(sub.prompt, sub.messages, sub.prompt_token_ids, max_model_len,
                             max_prompt_chars, tools)


def check_length(prompt_len: int, max_tokens: int | None,
                 max_model_len: int) -> Reason | None:
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
