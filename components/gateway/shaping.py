"""The OpenAI wire format's responses: whole bodies and stream chunks, logprobs in the
completions and chat shapes, usage, echo, tool calls. Pure functions; no I/O."""
from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import msgspec

from components.gateway.openai_api import CompletionRequest, prompts_of
from components.gateway.tools import CallStream, ToolMode, call_id, calls_of
from schemas.client import Pinned, PromptLogprobs, TokenLogprob
from schemas.wire import Usage


def usage_dict(u: Usage, weir: dict[str, Any] | None = None) -> dict[str, Any]:
    out = {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
           "total_tokens": u.prompt_tokens + u.completion_tokens,
           "prompt_tokens_details": {"cached_tokens": u.cached_tokens}}
    if weir is not None:
        out["weir"] = weir
    return out


def weir_usage(service_class: str, degraded: bool, max_tokens: int | None,
               queued_s: float, deadline: bool = False,
               pinned: Pinned | None = None) -> dict[str, Any]:
    """The ``weir`` object in a response's usage: what admission granted the request,
    (``deadline``, only when set) that its end-to-end deadline cut it short, and (a
    deterministic request's) what its output is pinned to."""
    out: dict[str, Any] = {"service_class": service_class, "degraded": degraded,
                           "max_tokens": max_tokens, "queued_ms": round(queued_s * 1e3, 1)}
    if deadline:
        out["deadline"] = True
    if pinned is not None:
        out["pinned"] = msgspec.structs.asdict(pinned)
    return out


def openai_finish_reason(reason: str | None) -> str | None:
    """A finish reason as OpenAI names them: the engine's ``deadline`` (cut short at the
    request's end-to-end deadline) is ``length`` (cut short), since OpenAI clients parse
    the reason as one of theirs; the usage's ``weir`` object says ``deadline``."""
    return "length" if reason == "deadline" else reason


def degraded_headers(degraded: bool, max_tokens: int | None) -> dict[str, str]:
    """Response headers for a request whose ``max_tokens`` admission lowered."""
    if not degraded:
        return {}
    out = {"x-weir-degraded": "true"}
    if max_tokens is not None:
        out["x-weir-max-tokens"] = str(max_tokens)
    return out


def completion_logprobs(entries: Sequence[TokenLogprob], offset: int = 0,
                        prompt: PromptLogprobs | None = None) -> dict[str, Any]:
    """The legacy completions ``logprobs`` object: each token, its log-probability, the
    top alternatives with the sampled token among them (OpenAI: "up to logprobs + 1"), and
    each token's character offset in the text (from ``offset``). With ``prompt`` (echo),
    the prompt's tokens first, its first one with null log-probability and alternatives."""
    tokens, offsets, lps, tops = [], [], [], []
    if prompt is not None:
        tokens.append(prompt.first_token)
        offsets.append(offset)
        offset += len(prompt.first_token)
        lps.append(None)
        tops.append(None)
    for e in (*prompt.logprobs, *entries) if prompt is not None else entries:
        tokens.append(e.token)
        offsets.append(offset)
        offset += len(e.token)
        lps.append(e.logprob)
        top = {t.token: t.logprob for t in e.top}
        top.setdefault(e.token, e.logprob)
        tops.append(top)
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops,
            "text_offset": offsets}


def chat_logprobs(entries: Sequence[TokenLogprob]) -> dict[str, Any]:
    """The chat ``logprobs`` object: ``content``, one entry per token with its UTF-8 bytes
    and its ``top_logprobs`` (as many as asked)."""
    def one(token: str, logprob: float) -> dict[str, Any]:
        return {"token": token, "logprob": logprob, "bytes": list(token.encode())}

    return {"content": [{**one(e.token, e.logprob),
                         "top_logprobs": [one(t.token, t.logprob) for t in e.top]}
                        for e in entries]}


class Shaper:
    """Builds response bodies and stream chunks for one request."""

    def __init__(self, chat: bool, request_id: str, model: str,
                 echo: CompletionRequest | None = None, tools: ToolMode | None = None) -> None:
        """``echo``: the completions request; with ``echo`` set, each choice begins with
        its prompt (its text as sent, or the engine's decode of its token ids) and, with
        ``logprobs``, the prompt tokens' entries; with ``max_tokens`` 0, only that. Choice
        ``index`` is of prompt ``index // n``. ``tools``: a chat answer is tool calls
        (streamed: a named function's arguments as they come; ``"required"``'s list at
        the end, when it is whole)."""
        self.chat = chat
        self.tools = tools
        self.calls: dict[int, CallStream] = {}      # "required": each choice's calls so far
        self.id = ("chatcmpl-" if chat else "cmpl-") + request_id
        self.model = model
        self.created = int(time.time())
        self.object = "chat.completion" if chat else "text_completion"
        self.offsets: dict[int, int] = {}          # streamed text per choice, for text_offset
        self.echo = echo is not None and echo.echo
        self.echo_only = self.echo and echo.max_tokens == 0
        self.echo_logprobs = self.echo and echo.logprobs is not None
        self.n = 1 if echo is None else echo.n
        self.echo_texts = [p if isinstance(p, str) else None
                           for p in prompts_of(echo.prompt)] if self.echo else []
        self.prompts: dict[int, PromptLogprobs] = {}    # by prompt, from its first delta
        self.echoed: set[int] = set()                   # choices whose prompt went out
        # a deterministic request's ``Pinned.fingerprint``: OpenAI's system_fingerprint
        # (the backend configuration the output came from) in every body and chunk
        self.fingerprint: str | None = None

    def _base(self, obj: str) -> dict[str, Any]:
        out = {"id": self.id, "object": obj, "created": self.created, "model": self.model}
        if self.fingerprint is not None:
            out["system_fingerprint"] = self.fingerprint
        return out

    def _logprobs(self, entries: Sequence[TokenLogprob] | None, index: int,
                  prompt: PromptLogprobs | None = None) -> Any:
        if entries is None and prompt is None:
            return None
        if self.chat:
            return chat_logprobs(entries)
        out = completion_logprobs(entries or (), self.offsets.get(index, 0), prompt)
        self.offsets[index] = self.offsets.get(index, 0) + sum(map(len, out["tokens"]))
        return out

    def _echoed(self, index: int, text: str | None, entries: Sequence[TokenLogprob] | None,
                finish_reason: str | None = None) -> tuple[str | None, Any, str | None]:
        """Choice ``index``'s text, logprobs object and finish reason, the prompt put
        first if it has not gone out yet for this choice (and the output left out with
        ``max_tokens`` 0)."""
        if not self.echo:
            return text, self._logprobs(entries, index), finish_reason
        if self.echo_only:
            text, entries = None if text is None else "", None if entries is None else ()
            finish_reason = finish_reason and "length"
        prompt = None
        if index not in self.echoed:
            self.echoed.add(index)
            k = index // self.n
            prompt = self.prompts.get(k)
            as_sent = self.echo_texts[k] if k < len(self.echo_texts) else None
            text = (as_sent if as_sent is not None else prompt.text if prompt else "") \
                + (text or "")
            prompt = prompt if self.echo_logprobs else None
        return text, self._logprobs(entries, index, prompt), finish_reason

    def wants(self, index: int, text: str, logprobs: Sequence[TokenLogprob]) -> bool:
        """Whether a delta of choice ``index`` makes a stream chunk."""
        if self.echo and index not in self.echoed:
            return True
        return not self.echo_only and bool(text or logprobs)

    def usage(self, usage: Usage) -> Usage:
        """With ``max_tokens`` 0 the one token generated is not in the response."""
        return Usage(usage.prompt_tokens, 0, usage.cached_tokens) if self.echo_only else usage

    def full(self, choices: list[tuple[str, str, Sequence[TokenLogprob] | None]], usage: Usage,
             weir: dict[str, Any] | None = None) -> dict[str, Any]:
        """The whole response; ``choices`` are (text, finish_reason, logprobs or None) by
        index; ``weir`` (``weir_usage``) goes into ``usage``."""
        out = []
        for index, (text, finish_reason, logprobs) in enumerate(choices):
            text, lp, finish_reason = self._echoed(index, text, logprobs,
                                                   openai_finish_reason(finish_reason))
            if self.chat:
                message: dict[str, Any] = {"role": "assistant", "content": text}
                calls = None if self.tools is None else calls_of(self.tools, text)
                if calls is not None:
                    message = {"role": "assistant", "content": None, "tool_calls": calls}
                    if self.tools.name is None and finish_reason == "stop":
                        finish_reason = "tool_calls"
                out.append({"index": index, "message": message, "logprobs": lp,
                            "finish_reason": finish_reason})
            else:
                out.append({"index": index, "text": text, "logprobs": lp,
                            "finish_reason": finish_reason})
        return {**self._base(self.object), "choices": out,
                "usage": usage_dict(self.usage(usage), weir)}

    def chunk(self, text: str | None, finish_reason: str | None = None,
              first: bool = False, index: int = 0,
              logprobs: Sequence[TokenLogprob] | None = None,
              prompt: PromptLogprobs | None = None) -> dict[str, Any] | None:
        """One stream chunk (None: nothing to send for this delta yet); ``prompt``: the
        request's prompt_logprobs (its first delta's)."""
        if prompt is not None:
            self.prompts[index // self.n] = prompt
        text, lp, finish_reason = self._echoed(index, text, logprobs,
                                               openai_finish_reason(finish_reason))
        if self.chat:
            delta: dict[str, Any] = {}
            if first:
                delta["role"] = "assistant"
            if self.tools is not None:
                delta, finish_reason = self._tool_delta(delta, index, text, first,
                                                        finish_reason)
                if delta is None:
                    return None
            elif text is not None:
                delta["content"] = text
            choice = {"index": index, "delta": delta, "logprobs": lp,
                      "finish_reason": finish_reason}
            return {**self._base("chat.completion.chunk"), "choices": [choice]}
        choice = {"index": index, "text": text or "", "logprobs": lp,
                  "finish_reason": finish_reason}
        return {**self._base("text_completion"), "choices": [choice]}

    def _tool_delta(self, delta: dict[str, Any], index: int, text: str | None, first: bool,
                    finish_reason: str | None) -> tuple[dict[str, Any] | None, str | None]:
        """A tool-call answer's stream delta (None: nothing to send yet) and finish reason.
        A named function's call opens on the choice's first chunk and its arguments follow
        as they come. ``"required"``'s calls each open once their name is whole, and their
        arguments follow as they come; an answer cut short before any call opened goes out
        as its text, as content (the whole-body shape does the same)."""
        name = self.tools.name
        if name is not None:
            if first:
                delta["tool_calls"] = [{"index": 0, "id": call_id(), "type": "function",
                                        "function": {"name": name, "arguments": ""}}]
            elif text:
                delta["tool_calls"] = [{"index": 0, "function": {"arguments": text}}]
            return delta, finish_reason
        stream = self.calls.setdefault(index, CallStream())
        calls = stream.feed(text or "")
        if calls:
            delta["tool_calls"] = calls
        if finish_reason is None:
            return (delta if calls or first else None), None
        del self.calls[index]
        if not stream.opened:
            delta["content"] = stream.text
            return delta, finish_reason
        return delta, "tool_calls" if finish_reason == "stop" and stream.whole() \
            else finish_reason

    def usage_chunk(self, usage: Usage, weir: dict[str, Any] | None = None) -> dict[str, Any]:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return {**self._base(obj), "choices": [], "usage": usage_dict(self.usage(usage), weir)}
