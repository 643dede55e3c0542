"""The OpenAI wire format: request types, their translation to Weir requests, and the
shape of responses and stream chunks. Pure functions; no I/O."""
from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any, Literal

import msgspec

from components.admission.validate import check_logit_bias, check_submit
from components.gateway.tools import (CallMsg, ToolChoice, ToolDef, ToolError, ToolMode,
                                     call_id, calls_of, tool_request)
from schemas.client import (PromptLogprobs, SamplingParams, StructuredOutput, Submit,
                            TokenLogprob, ToolCall)
from schemas.wire import Usage


class ApiError(Exception):
    """An error with an HTTP status, rendered in OpenAI's error JSON shape."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 retry_after: float | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.retry_after = retry_after

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


class StreamOptions(msgspec.Struct, frozen=True):
    include_usage: bool = False


class TextPart(msgspec.Struct, frozen=True):
    type: str
    text: str = ""


class ChatMsg(msgspec.Struct, frozen=True):
    role: str
    content: str | list[TextPart] | None = None
    tool_calls: list[CallMsg] | None = None       # an assistant's calls, sent back
    tool_call_id: str | None = None               # a tool's answer: to which call


class JsonSchemaFormat(msgspec.Struct, frozen=True):
    schema: dict[str, Any] | None = None
    name: str | None = None
    strict: bool | None = None
    description: str | None = None


class ResponseFormat(msgspec.Struct, frozen=True):
    """OpenAI's ``response_format``."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """vLLM's ``structured_outputs`` (one of its forms), with its whitespace switch."""

    json: dict[str, Any] | str | None = None
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    disable_any_whitespace: bool | None = None


class _Common(msgspec.Struct, frozen=True, kw_only=True):
    model: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    ignore_eos: bool = False
    presence_penalty: float | None = None       # None (as some clients send): off
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None     # vLLM's extension (HF's definition)
    min_tokens: int | None = None               # vLLM's extension
    logit_bias: dict[str, float] | None = None
    best_of: int | None = None
    priority: int = 0               # vLLM's extension: lower is more important
    service_class: str | None = None    # Weir's: the admission class (see class_of)
    # structured output: OpenAI's response_format, vLLM's structured_outputs, or vLLM's
    # older guided_* fields; one of them (structured_of)
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None


class CompletionRequest(_Common, frozen=True, kw_only=True):
    # a string, token ids, or a batch of one of either: never nested deeper
    prompt: str | list[str | int | list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None


class ChatCompletionRequest(_Common, frozen=True, kw_only=True):
    messages: list[ChatMsg]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[ToolDef] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None


def parse(body: bytes, kind: type) -> Any:
    """Decode and type-check a request body; every way it can be wrong is a 400."""
    try:
        return msgspec.json.decode(body, type=kind)
    except msgspec.ValidationError as exc:
        raise ApiError(400, f"invalid request: {str(exc)[:500]}") from None
    except msgspec.DecodeError as exc:
        raise ApiError(400, f"request body is not valid JSON: {str(exc)[:500]}") from None
    except RecursionError:
        raise ApiError(400, "request body is nested too deeply") from None


def _unsupported(req: _Common) -> str | None:
    if req.best_of not in (None, req.n):
        return "best_of (other than n) is not supported"
    if (why := check_logit_bias(req.logit_bias)) is not None:
        return why
    if isinstance(req, CompletionRequest) and req.suffix:
        return "suffix is not supported"
    if isinstance(req, ChatCompletionRequest):
        if req.top_logprobs is not None and not req.logprobs:
            return "top_logprobs needs logprobs set to true"
    return None


def _message(m: ChatMsg) -> dict[str, Any]:
    out: dict[str, Any] = {"role": m.role, "content": _text(m.content)}
    if m.tool_calls:
        out["tool_calls"] = [ToolCall(c.id, c.function.name, c.function.arguments)
                             for c in m.tool_calls]
    if m.tool_call_id is not None:
        out["tool_call_id"] = m.tool_call_id
    return out


def _json_text(schema: dict[str, Any] | str) -> str:
    return schema if isinstance(schema, str) else msgspec.json.encode(schema).decode()


def structured_of(req: _Common) -> StructuredOutput | None:
    """The request's structured output, from whichever form it came in (None: free
    text). JSON is compact unless vLLM's ``disable_any_whitespace`` is false."""
    forms: list[tuple[str, StructuredOutput]] = []
    rf = req.response_format
    if rf is not None and rf.type == "json_object":
        forms.append(("response_format", StructuredOutput(json_object=True)))
    elif rf is not None and rf.type == "json_schema":
        if rf.json_schema is None or rf.json_schema.schema is None:
            raise ApiError(400, "response_format of type json_schema needs json_schema.schema",
                           param="response_format")
        forms.append(("response_format", StructuredOutput(json=_json_text(rf.json_schema.schema))))
    if (so := req.structured_outputs) is not None:
        forms.append(("structured_outputs", StructuredOutput(
            json=None if so.json is None else _json_text(so.json),
            json_object=bool(so.json_object), regex=so.regex,
            choice=None if so.choice is None else tuple(so.choice), grammar=so.grammar,
            json_whitespace=so.disable_any_whitespace is False
            and (so.json is not None or bool(so.json_object)))))
    for name, make in (("guided_json", lambda v: StructuredOutput(json=_json_text(v))),
                       ("guided_regex", lambda v: StructuredOutput(regex=v)),
                       ("guided_choice", lambda v: StructuredOutput(choice=tuple(v))),
                       ("guided_grammar", lambda v: StructuredOutput(grammar=v))):
        if (value := getattr(req, name)) is not None:
            forms.append((name, make(value)))
    if len(forms) > 1:
        raise ApiError(400, f"give one form of structured output, not {len(forms)}: "
                            f"{', '.join(name for name, _ in forms)}")
    return forms[0][1] if forms else None


def class_of(req: _Common, header: str | None) -> str | None:
    """The service class a request asks for: its body's ``service_class``, else the
    ``x-weir-class`` header, else None (the tenant's default). The body wins because it
    is this request's own choice, while a header is often set once for every request a
    client sends (the OpenAI SDK's ``default_headers``). Empty means not given."""
    return req.service_class or (header or "").strip() or None


def submit_batch(req: CompletionRequest | ChatCompletionRequest, served_model: str,
                 class_header: str | None = None) -> list[dict[str, Any]]:
    """Keyword arguments for ``AsyncClient.stream`` from an OpenAI request (and its
    ``x-weir-class`` header, if any): one request per prompt. A chat request, or a
    completions request with one prompt, makes one; a batch of prompts (a list of strings
    or of token-id lists) one each, in order: choice ``j`` of prompt ``i`` is choice
    ``i * n + j`` of the response, as OpenAI and vLLM number them."""
    if req.model not in (None, "", served_model):
        raise ApiError(404, f"the model `{req.model[:100]}` does not exist; this server serves "
                            f"`{served_model}`", "invalid_request_error", "model", "model_not_found")
    if (why := _unsupported(req)) is not None:
        raise ApiError(400, why)
    params: dict[str, Any] = {"ignore_eos": req.ignore_eos}
    if req.n != 1:
        params["n"] = req.n
    if req.priority:
        params["priority"] = req.priority
    if (service_class := class_of(req, class_header)) is not None:
        params["service_class"] = service_class
    for name in ("temperature", "top_p", "top_k", "seed", "presence_penalty",
                 "frequency_penalty", "repetition_penalty", "min_tokens"):
        if (value := getattr(req, name)) is not None:
            params[name] = value
    if req.logit_bias:
        params["logit_bias"] = {int(k): v for k, v in req.logit_bias.items()}
    structured = structured_of(req)
    if isinstance(req, ChatCompletionRequest):
        try:
            tools, for_tools = tool_request(req.tools, req.tool_choice,
                                            req.parallel_tool_calls)
        except ToolError as exc:
            raise ApiError(400, str(exc), param="tool_choice") from None
        if tools:
            params["tools"] = tools
        if for_tools is not None:
            if structured is not None:
                raise ApiError(400, "give one form of structured output, not 2: tool_choice "
                                    "and a response format")
            structured = for_tools
    if structured is not None:
        params["structured"] = structured
    if isinstance(req, ChatCompletionRequest):
        if req.logprobs:
            params["logprobs"] = req.top_logprobs or 0
    elif req.logprobs is not None:
        params["logprobs"] = req.logprobs
        if req.echo:                        # the prompt's tokens come with theirs
            params["prompt_logprobs"] = req.logprobs
    if req.stop is not None:
        params["stop"] = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop)
    if req.stop_token_ids:
        params["stop_token_ids"] = tuple(req.stop_token_ids)
    if isinstance(req, ChatCompletionRequest):
        params["max_tokens"] = (req.max_completion_tokens if req.max_completion_tokens is not None
                                else req.max_tokens)      # 0 is invalid, not "unlimited"
        msgs = [_message(m) for m in req.messages]
        return [{"messages": msgs, **params}]
    # echo with max_tokens 0 (the prompt's logprobs alone, as evaluation harnesses ask):
    # one token is generated and left out of the response (Shaper)
    params["max_tokens"] = 1 if req.echo and req.max_tokens == 0 else req.max_tokens
    out = []
    for prompt in prompts_of(req.prompt):
        one = {**_prompt(prompt), **params}
        if req.echo and not isinstance(prompt, str):
            one["prompt_logprobs"] = req.logprobs or 0     # token ids: echo their text
        out.append(one)
    return out


_PARAMS = frozenset(SamplingParams.__struct_fields__)


def validate_kwargs(kwargs: dict[str, Any], max_model_len: int,
                    max_prompt_chars: int | None = None) -> None:
    """The engine's own edge checks (``check_submit``, as the streamer runs them) on the
    request ``submit_kwargs`` built, so a bad request is a 400 before it is sent."""
    params = SamplingParams(**{k: v for k, v in kwargs.items() if k in _PARAMS})
    sub = Submit("gateway", kwargs.get("prompt"), kwargs.get("messages"),
                 kwargs.get("prompt_token_ids"), params, priority=kwargs.get("priority", 0),
                 service_class=kwargs.get("service_class"), tools=kwargs.get("tools", ()))
    if (bad := check_submit(sub, max_model_len, max_prompt_chars)) is not None:
        raise ApiError(400, bad[1], code=bad[0])


MAX_BATCH = 64          # prompts in one completions request


def prompts_of(prompt: str | list[Any]) -> list[Any]:
    """OpenAI's prompt forms: a string or token ids is one prompt; a list of strings or of
    token-id lists is a batch of them (at most ``MAX_BATCH``)."""
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) > MAX_BATCH:
            raise ApiError(400, f"a request may batch at most {MAX_BATCH} prompts",
                           param="prompt")
        return list(prompt)
    return [prompt]


def _prompt(prompt: Any) -> dict[str, Any]:
    if isinstance(prompt, str):
        return {"prompt": prompt}
    if isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool)
                                        for t in prompt):
        return {"prompt_token_ids": list(prompt)}
    raise ApiError(400, "prompt must be a string, a list of token ids, or a list of either",
                   param="prompt")


def _text(content: str | list[TextPart] | None) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if any(p.type != "text" for p in content):
        raise ApiError(400, "only text content parts are supported", param="messages")
    return "".join(p.text for p in content)


def usage_dict(u: Usage, weir: dict[str, Any] | None = None) -> dict[str, Any]:
    out = {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
           "total_tokens": u.prompt_tokens + u.completion_tokens,
           "prompt_tokens_details": {"cached_tokens": u.cached_tokens}}
    if weir is not None:
        out["weir"] = weir
    return out


def weir_usage(service_class: str, degraded: bool, max_tokens: int | None,
               queued_s: float) -> dict[str, Any]:
    """The ``weir`` object in a response's usage: what admission granted the request."""
    return {"service_class": service_class, "degraded": degraded, "max_tokens": max_tokens,
            "queued_ms": round(queued_s * 1e3, 1)}


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
        self.held: dict[int, str] = {}              # "required": each choice's text so far
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

    def _base(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

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
            text, lp, finish_reason = self._echoed(index, text, logprobs, finish_reason)
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
        text, lp, finish_reason = self._echoed(index, text, logprobs, finish_reason)
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
        as they come; ``"required"``'s text is held, and its calls go out whole with its
        finish (or, cut short, the text as content)."""
        name = self.tools.name
        if name is not None:
            if first:
                delta["tool_calls"] = [{"index": 0, "id": call_id(), "type": "function",
                                        "function": {"name": name, "arguments": ""}}]
            elif text:
                delta["tool_calls"] = [{"index": 0, "function": {"arguments": text}}]
            return delta, finish_reason
        if text:
            self.held[index] = self.held.get(index, "") + text
        if finish_reason is None:
            return (delta if first else None), None
        held = self.held.pop(index, "")
        calls = calls_of(self.tools, held)
        if calls is None:
            delta["content"] = held
            return delta, finish_reason
        delta["tool_calls"] = [{"index": k, **call} for k, call in enumerate(calls)]
        return delta, "tool_calls" if finish_reason == "stop" else finish_reason

    def usage_chunk(self, usage: Usage, weir: dict[str, Any] | None = None) -> dict[str, Any]:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return {**self._base(obj), "choices": [], "usage": usage_dict(self.usage(usage), weir)}
