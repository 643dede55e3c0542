"""The OpenAI wire format's requests: their types, validation and translation to Weir
requests (responses and stream chunks are components/gateway/shaping.py's). Pure
functions; no I/O."""
from __future__ import annotations

from typing import Any, Literal

import msgspec

from components.gateway.tools import CallMsg, ToolChoice, ToolDef, ToolError, tool_request
from schemas.client import SamplingParams, StructuredOutput, Submit, ToolCall
from schemas.validate import check_logit_bias, check_submit
from weir.forms import json_text


class ApiError(Exception):
    """An error with an HTTP status, rendered in OpenAI's error JSON shape."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 retry_after: float | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type = status, message, type_
        self.param, self.code = param, code
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
    # Weir's: the end-to-end deadline from arrival (Submit.e2e_deadline_ms); past it the
    # answer so far comes back with finish_reason "length" (the engine's "deadline")
    e2e_deadline_ms: int | None = None
    # Weir's: the deterministic serving mode (SamplingParams.deterministic); the response's
    # system_fingerprint and ``weir.pinned`` then say what its bits are pinned to
    deterministic: bool | None = None
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
        forms.append(("response_format", StructuredOutput(json=json_text(rf.json_schema.schema))))
    if (so := req.structured_outputs) is not None:
        forms.append(("structured_outputs", StructuredOutput(
            json=None if so.json is None else json_text(so.json),
            json_object=bool(so.json_object), regex=so.regex,
            choice=None if so.choice is None else tuple(so.choice), grammar=so.grammar,
            json_whitespace=so.disable_any_whitespace is False
            and (so.json is not None or bool(so.json_object)))))
    for name, make in (("guided_json", lambda v: StructuredOutput(json=json_text(v))),
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
                            f"`{served_model}`", "invalid_request_error", "model",
                     "model_not_found")
    if (why := _unsupported(req)) is not None:
        raise ApiError(400, why)
    params: dict[str, Any] = {"ignore_eos": req.ignore_eos}
    if req.n != 1:
        params["n"] = req.n
    if req.priority:
        params["priority"] = req.priority
    if (service_class := class_of(req, class_header)) is not None:
        params["service_class"] = service_class
    if req.e2e_deadline_ms is not None:
        params["e2e_deadline_ms"] = req.e2e_deadline_ms
    if req.deterministic:
        params["deterministic"] = True
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
                 service_class=kwargs.get("service_class"), tools=kwargs.get("tools", ()),
                 e2e_deadline_ms=kwargs.get("e2e_deadline_ms"))
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
