"""The largest frame a legal client request can be: the bound the client sockets (the
streamer's and the router's ``clients``) set as ZeroMQ's ``MAXMSGSIZE``.

A frame is read whole and decoded before anything can look at its api_key, so without a
bound a peer with no credentials made the streamer hold 1 GiB per frame (issue 43, D4).
``limits.py`` bounds every field of a ``Submit`` (``validate.py`` checks them); this sums
their widest msgpack encoding, so no request that ``check_submit`` would pass is ever cut
off, and a frame past it cannot be a legal request. Widest, not typical: a client's encoder may use
32-bit string and container headers and 64-bit integers where msgspec uses one byte.

The bound is an over-estimate by construction (each term is its field's worst case, and
the terms cannot all be at their worst at once: prompt text and messages share one
character budget). At max_model_len 8192 it is 2.2 MB, 1.29x the largest legal Submit
msgspec itself encodes (1.7 MB; tests/schemas/test_frames.py); at the default
2048, 0.8 MB.
"""
from __future__ import annotations

import msgspec

from schemas.client import ChatMessage, SamplingParams, StructuredOutput, Submit, Tool, ToolCall
from schemas.limits import (
    CHARS_PER_TOKEN_BOUND,
    MAX_API_KEY_CHARS,
    MAX_CHOICES,
    MAX_GRAMMAR_CHARS,
    MAX_ID_CHARS,
    MAX_LOGIT_BIAS,
    MAX_STOP_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    MAX_TOOLS,
)

UTF8_MAX = 4          # bytes per character (code point) in UTF-8
HEADER = 5            # the widest msgpack string, array or map header (32-bit length)
SCALAR = 9            # the widest msgpack number (int64, uint64, float64)
# the Envelope around the body (msgspec array: id, send time, traceparent): a W3C
# traceparent is 55 characters; a longer one is not one the tracer would read
ENVELOPE = HEADER + 2 * SCALAR + HEADER + 256


def _struct(cls: type[msgspec.Struct]) -> int:
    """A Struct encoded as a map, every value a scalar or a string's or container's header:
    its own header, each key, and each value's widest head. Contents come on top."""
    return HEADER + sum(HEADER + len(name) + SCALAR for name in cls.__struct_fields__)


def _text(chars: int) -> int:
    return HEADER + UTF8_MAX * chars


def client_frame_limit(max_model_len: int, max_prompt_chars: int | None = None) -> int:
    """The largest encoded ``Submit`` (in its Envelope) that ``check_submit(sub,
    max_model_len, max_prompt_chars)`` passes, in bytes."""
    chars = max_prompt_chars if max_prompt_chars is not None \
        else max_model_len * CHARS_PER_TOKEN_BOUND
    # prompt, messages (roles, contents, tool calls' text) and tools' names, descriptions
    # and parameters share ``chars``
    prompt = _text(chars)
    token_ids = HEADER + SCALAR * max_model_len
    # messages and their tool calls: at most max_model_len together, beyond their text
    items = HEADER + max_model_len * max(_struct(ChatMessage), _struct(ToolCall))
    tools = HEADER + MAX_TOOLS * _struct(Tool)
    ids = 5 * _text(MAX_ID_CHARS) + _text(MAX_API_KEY_CHARS)  # request, key, tenant, ...
    structured = _struct(StructuredOutput) + max(
        _text(MAX_GRAMMAR_CHARS), HEADER + MAX_CHOICES * HEADER + UTF8_MAX * MAX_GRAMMAR_CHARS)
    params = (_struct(SamplingParams) + structured
              + HEADER + MAX_STOP_STRINGS * _text(MAX_STOP_CHARS)
              + HEADER + MAX_STOP_TOKEN_IDS * SCALAR
              + HEADER + MAX_LOGIT_BIAS * 2 * SCALAR)
    return ENVELOPE + _struct(Submit) + prompt + token_ids + items + tools + ids + params
