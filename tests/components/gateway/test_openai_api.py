"""OpenAI request parsing and translation, auth, and response shapes (no engine)."""
import hashlib

import pytest

from components.gateway.auth import Authenticator, hash_key
from components.gateway.openai_api import (
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
    class_of,
    parse,
    submit_batch,
    validate_kwargs,
)
from components.gateway.shaping import (
    Shaper,
    chat_logprobs,
    completion_logprobs,
    degraded_headers,
    openai_finish_reason,
    weir_usage,
)
from schemas.client import PromptLogprobs, StructuredOutput, TokenLogprob, TopLogprob
from schemas.config import ApiKey, ConfigError
from schemas.wire import Usage

M = "SmolLM2-135M-Instruct"


def kwargs(body: bytes, kind=CompletionRequest, class_header: str | None = None):
    (one,) = submit_batch(parse(body, kind), M, class_header)
    return one


def test_completion_forms_of_prompt():
    assert kwargs(b'{"prompt": "hi", "max_tokens": 3, "temperature": 0}') == {
        "prompt": "hi", "max_tokens": 3, "temperature": 0.0, "ignore_eos": False}
    assert kwargs(b'{"prompt": [1, 2, 3]}')["prompt_token_ids"] == [1, 2, 3]
    assert kwargs(b'{"prompt": ["one"]}')["prompt"] == "one"
    assert kwargs(b'{"prompt": [[4, 5]]}')["prompt_token_ids"] == [4, 5]
    two = submit_batch(parse(b'{"prompt": ["a", [7, 8]], "n": 2, "echo": true}',
                             CompletionRequest), M)
    assert [(k.get("prompt"), k.get("prompt_token_ids"), k["n"]) for k in two] == [
        ("a", None, 2), (None, [7, 8], 2)]
    assert "prompt_logprobs" not in two[0] and two[1]["prompt_logprobs"] == 0
    with pytest.raises(ApiError, match="at most 64 prompts"):
        submit_batch(parse(b'{"prompt": [' + b",".join([b'"a"'] * 65) + b']}',
                           CompletionRequest), M)
    with pytest.raises(ApiError, match="token ids"):
        kwargs(b'{"prompt": [1, "x"]}')


def test_chat_translation_and_defaults():
    k = kwargs(b'{"model": "SmolLM2-135M-Instruct", '
               b'"messages": [{"role": "system", "content": "s"},'
               b'{"role": "user", "content": [{"type": "text", "text": "a"}, '
               b'{"type": "text", "text": "b"}]}],'
               b'"max_completion_tokens": 7, "stop": "END", "seed": 3, "top_p": 0.5}',
               ChatCompletionRequest)
    assert k == {"messages": [{"role": "system", "content": "s"},
                              {"role": "user", "content": "ab"}],
                 "max_tokens": 7, "stop": ("END",), "seed": 3, "top_p": 0.5, "ignore_eos": False}
    k = kwargs(b'{"messages": [{"role": "user", "content": "x"}]}', ChatCompletionRequest)
    assert k["max_tokens"] is None            # up to the context window, as vLLM does
    k = kwargs(b'{"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 0,'
               b'"max_tokens": 5}', ChatCompletionRequest)
    assert k["max_tokens"] == 0               # refused by validation, not "unlimited"
    with pytest.raises(ApiError, match="max_tokens"):
        validate_kwargs(k, 2048)


@pytest.mark.parametrize("body, status, words", [
    (b'{"prompt": "x", "n": 3, "best_of": 5}', 400, "best_of"),
    (b'{"prompt": "x", "suffix": "y"}', 400, "suffix"),
    (b'{"prompt": "x", "model": "other"}', 404, "other"),
    (b'{"max_tokens": 1}', 400, "prompt"),
    (b'{"prompt": "x", "max_tokens": "many"}', 400, "max_tokens"),
    (b'not json', 400, "JSON"),
])
def test_errors(body, status, words):
    with pytest.raises(ApiError) as err:
        kwargs(body)
    assert err.value.status == status and words in err.value.message
    assert set(err.value.body()["error"]) == {"message", "type", "param", "code"}


@pytest.mark.parametrize("body, words", [
    (b'{"prompt": "x", "seed": 123456789012345678901234567890}', "seed"),
    (b'{"prompt": "x", "top_k": 9223372036854775808}', "top_k"),
    (b'{"prompt": [1, 99999999999999999999999]}', "prompt_token_ids"),
    (b'{"prompt": "x", "stop_token_ids": [-3]}', "stop_token_ids"),
    (b'{"prompt": "x", "priority": 9223372036854775808}', "priority"),
    (b'{"prompt": "x", "max_tokens": 4096}', "context window"),
    (b'{"prompt": "' + b"x" * 65537 + b'"}', "characters"),
    (b'{"prompt": "x", "presence_penalty": 2.5}', "presence_penalty"),
    (b'{"prompt": "x", "frequency_penalty": -2.01}', "frequency_penalty"),
    (b'{"prompt": "x", "repetition_penalty": 0}', "repetition_penalty"),
    (b'{"prompt": "x", "max_tokens": 4, "min_tokens": 5}', "min_tokens"),
])
def test_engine_limits_checked_before_submitting(body, words):
    with pytest.raises(ApiError) as err:
        validate_kwargs(kwargs(body), 2048)
    assert err.value.status == 400 and words in err.value.message
    validate_kwargs(kwargs(b'{"prompt": "x", "seed": 18446744073709551615, "top_k": 40}'), 2048)
    validate_kwargs(kwargs(b'{"messages": [{"role": "user", "content": "hi"}], "n": 2}',
                           ChatCompletionRequest), 2048)


def test_penalties_and_logit_bias_pass_through():
    k = kwargs(b'{"prompt": "x", "presence_penalty": 0.5, "frequency_penalty": -1,'
               b'"repetition_penalty": 1.2, "logit_bias": {"42": -100, "7": 2.5}}')
    assert (k["presence_penalty"], k["frequency_penalty"], k["repetition_penalty"]) == \
        (0.5, -1.0, 1.2)
    assert k["logit_bias"] == {42: -100.0, 7: 2.5}
    validate_kwargs(k, 2048)
    k = kwargs(b'{"prompt": "x", "presence_penalty": null, "frequency_penalty": 0}')
    assert "presence_penalty" not in k and k["frequency_penalty"] == 0   # null: off
    k = kwargs(b'{"messages": [{"role": "user", "content": "hi"}], "min_tokens": 8}',
               ChatCompletionRequest)
    assert k["min_tokens"] == 8
    validate_kwargs(k, 2048)


SCHEMA = b'{"type": "object", "properties": {"a": {"type": "integer"}}}'
CHAT = b'{"messages": [{"role": "user", "content": "hi"}], '


@pytest.mark.parametrize("body, kind, want", [
    (CHAT + b'"response_format": {"type": "json_schema", "json_schema": {"name": "a", '
     b'"strict": true, "schema": ' + SCHEMA + b'}}}', ChatCompletionRequest,
     StructuredOutput(json='{"type":"object","properties":{"a":{"type":"integer"}}}')),
    (CHAT + b'"response_format": {"type": "json_object"}}', ChatCompletionRequest,
     StructuredOutput(json_object=True)),
    (CHAT + b'"response_format": {"type": "text"}}', ChatCompletionRequest, None),
    (b'{"prompt": "x", "structured_outputs": {"regex": "[0-9]+"}}', CompletionRequest,
     StructuredOutput(regex="[0-9]+")),
    (b'{"prompt": "x", "structured_outputs": {"json": "{}", "disable_any_whitespace": false}}',
     CompletionRequest, StructuredOutput(json="{}", json_whitespace=True)),
    (b'{"prompt": "x", "structured_outputs": {"json_object": true, '
     b'"disable_any_whitespace": true}}', CompletionRequest, StructuredOutput(json_object=True)),
    (b'{"prompt": "x", "structured_outputs": {"choice": ["a", "b"]}}', CompletionRequest,
     StructuredOutput(choice=("a", "b"))),
    (b'{"prompt": "x", "guided_json": ' + SCHEMA + b'}', CompletionRequest,
     StructuredOutput(json='{"type":"object","properties":{"a":{"type":"integer"}}}')),
    (b'{"prompt": "x", "guided_json": "{}"}', CompletionRequest, StructuredOutput(json="{}")),
    (b'{"prompt": "x", "guided_regex": "a+"}', CompletionRequest, StructuredOutput(regex="a+")),
    (CHAT + b'"guided_choice": ["y", "n"]}', ChatCompletionRequest,
     StructuredOutput(choice=("y", "n"))),
    (b'{"prompt": "x", "guided_grammar": "start: \\"a\\""}', CompletionRequest,
     StructuredOutput(grammar='start: "a"')),
])
def test_structured_output_in_every_form(body, kind, want):
    k = kwargs(body, kind)
    assert k.get("structured") == want
    validate_kwargs(k, 2048)


@pytest.mark.parametrize("body, words", [
    (b'{"prompt": "x", "guided_regex": "a", "guided_choice": ["b"]}', "not 2"),
    (CHAT + b'"response_format": {"type": "json_object"}, "guided_json": {}}', "not 2"),
    (CHAT + b'"response_format": {"type": "json_schema"}}', "json_schema.schema"),
    (CHAT + b'"response_format": {"type": "yaml"}}', "response_format.type"),
    (b'{"prompt": "x", "structured_outputs": {"regex": "a", "choice": ["b"]}}', "exactly one"),
    (b'{"prompt": "x", "structured_outputs": {"schema": {}}}', "schema"),
    (b'{"prompt": "x", "guided_choice": []}', "choice"),
    (b'{"prompt": "x", "guided_regex": "a", "min_tokens": 2}', "min_tokens"),
])
def test_structured_output_errors_are_400(body, words):
    kind = ChatCompletionRequest if body.startswith(CHAT) else CompletionRequest
    with pytest.raises(ApiError) as err:
        validate_kwargs(kwargs(body, kind), 2048)
    assert err.value.status == 400 and words in err.value.message


def test_deep_and_malformed_json_is_400():
    for body in (b'{"prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}",
                 b'{"prompt": "x", "tools": ' + b"[" * 100000 + b"]" * 100000 + b"}",
                 b'{"prompt": [[[1]]]}', b'{"prompt": "\\ud800"}',
                 b'{"prompt": "x", "logit_bias": {"x": 1}}',
                 b'{"prompt": "x", "logit_bias": {"1": 101}}'):
        with pytest.raises(ApiError) as err:
            kwargs(body, ChatCompletionRequest if b"tools" in body else CompletionRequest)
        assert err.value.status == 400, body[:40]


def test_auth_hashed_keys():
    digest = hashlib.sha256(b"sk-1").hexdigest()
    assert hash_key("sk-1") == digest
    auth = Authenticator((ApiKey(digest, "acme"),))
    assert auth.tenant_for("Bearer sk-1") == "acme"
    assert auth.tenant_for("bearer sk-1") == "acme"
    assert auth.tenant_for("Bearer sk-2") is None
    assert auth.tenant_for(None) is None
    assert Authenticator(()).tenant_for(None) == "default"
    assert Authenticator(()).metrics_scope(None) == (True, None)         # no keys: open
    assert auth.metrics_scope(None) == (False, None)
    assert auth.metrics_scope("Bearer sk-1") == (True, "acme")          # its own series only
    with pytest.raises((ConfigError, ValueError)):
        ApiKey("sk-plaintext-key", "acme")


def test_logprobs_requests():
    assert kwargs(b'{"prompt": "x", "logprobs": 3}')["logprobs"] == 3
    assert kwargs(b'{"prompt": "x", "logprobs": 0}')["logprobs"] == 0
    assert "logprobs" not in kwargs(b'{"prompt": "x"}')
    chat = lambda body: kwargs(b'{"messages": [{"role": "user", "content": "x"}], ' + body,
                               ChatCompletionRequest)
    assert chat(b'"logprobs": true, "top_logprobs": 2}')["logprobs"] == 2
    assert chat(b'"logprobs": true}')["logprobs"] == 0
    assert "logprobs" not in chat(b'"logprobs": false}')
    with pytest.raises(ApiError, match="top_logprobs needs logprobs"):
        chat(b'"top_logprobs": 2}')
    with pytest.raises(ApiError, match="logprobs must be in"):
        validate_kwargs(kwargs(b'{"prompt": "x", "logprobs": 21}'), 2048)


def test_logprobs_shapes():
    e = [TokenLogprob(5, " the", -0.25, (TopLogprob(5, " the", -0.25), TopLogprob(9, " a", -2.0))),
         TokenLogprob(7, "é", -3.0, (TopLogprob(8, " sea", -0.5),))]
    lp = completion_logprobs(e)
    assert lp == {"tokens": [" the", "é"], "token_logprobs": [-0.25, -3.0],
                  "top_logprobs": [{" the": -0.25, " a": -2.0}, {" sea": -0.5, "é": -3.0}],
                  "text_offset": [0, 4]}                 # the sampled token is always among them
    assert chat_logprobs(e)["content"][1] == {
        "token": "é", "logprob": -3.0, "bytes": [195, 169],
        "top_logprobs": [{"token": " sea", "logprob": -0.5, "bytes": [32, 115, 101, 97]}]}
    sh = Shaper(False, "r", M)                           # streamed: offsets run on per choice
    assert sh.chunk(" the", logprobs=e[:1])["choices"][0]["logprobs"]["text_offset"] == [0]
    assert sh.chunk("é", logprobs=e[1:])["choices"][0]["logprobs"]["text_offset"] == [4]
    assert sh.chunk(" x", index=1, logprobs=e[1:])["choices"][0]["logprobs"]["text_offset"] == [0]
    assert sh.chunk("x")["choices"][0]["logprobs"] is None
    body = Shaper(True, "r", M).full([("the", "stop", e)], Usage(1, 2))
    assert body["choices"][0]["logprobs"]["content"][0]["token"] == " the"


def test_echo_maps_to_prompt_logprobs():
    k = kwargs(b'{"prompt": "x", "echo": true}')
    assert "prompt_logprobs" not in k and k["max_tokens"] == 16     # the text is the prompt's
    k = kwargs(b'{"prompt": "x", "echo": true, "logprobs": 2, "max_tokens": 0}')
    assert (k["prompt_logprobs"], k["logprobs"], k["max_tokens"]) == (2, 2, 1)
    validate_kwargs(k, 2048)
    k = kwargs(b'{"prompt": [5, 6, 7], "echo": true}')   # token ids: the engine decodes them
    assert k["prompt_logprobs"] == 0 and "logprobs" not in k
    assert "prompt_logprobs" not in kwargs(b'{"prompt": "x", "logprobs": 1}')
    with pytest.raises(ApiError, match="max_tokens"):  # 0 without echo: still refused
        validate_kwargs(kwargs(b'{"prompt": "x", "max_tokens": 0}'), 2048)


def _echo(body: bytes) -> Shaper:
    return Shaper(False, "r", M, parse(body, CompletionRequest))


def test_echo_shapes():
    """Each choice starts with the prompt; with logprobs, the prompt's tokens first (the
    first with nulls), offsets running on into the output; max_tokens 0: the prompt only."""
    out = [TokenLogprob(9, "!", -1.5, (TopLogprob(9, "!", -1.5),))]
    prompt = PromptLogprobs((1, 2), "Hi there", "Hi", (
        TokenLogprob(2, " there", -4.0, (TopLogprob(3, " you", -0.5),)),))
    sh = _echo(b'{"prompt": "Hi there", "echo": true, "logprobs": 1, "n": 2}')
    sh.prompts[0] = prompt
    body = sh.full([("!", "length", out), ("?", "stop", out)], Usage(2, 2))
    for c in body["choices"]:
        assert c["text"].startswith("Hi there") and c["logprobs"] == {
            "tokens": ["Hi", " there", "!"], "token_logprobs": [None, -4.0, -1.5],
            "top_logprobs": [None, {" you": -0.5, " there": -4.0}, {"!": -1.5}],
            "text_offset": [0, 2, 8]}
    assert [c["text"] for c in body["choices"]] == ["Hi there!", "Hi there?"]
    only = _echo(b'{"prompt": [1, 2], "echo": true, "logprobs": 1, "max_tokens": 0}')
    only.prompts[0] = prompt
    body = only.full([("!", "length", out)], Usage(2, 1, 0))
    assert body["choices"][0]["text"] == "Hi there"           # the engine's decode of the ids
    assert body["choices"][0]["logprobs"]["tokens"] == ["Hi", " there"]
    assert body["usage"]["completion_tokens"] == 0
    # streamed: the first chunk of each choice carries the prompt, then outputs as usual
    st = _echo(b'{"prompt": "Hi there", "echo": true, "logprobs": 1, "n": 2}')
    assert st.wants(1, "", ()) and st.wants(0, "", ())
    c1 = st.chunk("?", index=1, logprobs=out, prompt=prompt)["choices"][0]
    c0 = st.chunk("!", index=0, logprobs=out)["choices"][0]
    assert (c1["text"], c0["text"]) == ("Hi there?", "Hi there!")
    assert c0["logprobs"]["token_logprobs"] == [None, -4.0, -1.5]
    nxt = st.chunk(" ok", index=0, logprobs=out)["choices"][0]
    assert nxt["text"] == " ok" and nxt["logprobs"]["text_offset"] == [9]
    assert not st.wants(0, "", ())
    # a batch: choice i of n = 2 echoes prompt i // 2, as sent or as the engine decoded it
    bt = _echo(b'{"prompt": ["Hi there", [1, 2]], "echo": true, "n": 2}')
    bt.prompts[1] = PromptLogprobs((1, 2), "Yo", "Y", ())
    body = bt.full([("a", "stop", None)] * 4, Usage(4, 4))
    assert [c["text"] for c in body["choices"]] == ["Hi therea", "Hi therea", "Yoa", "Yoa"]
    so = _echo(b'{"prompt": "Hi there", "echo": true, "max_tokens": 0, "stream": true}')
    assert so.chunk("!")["choices"][0]["text"] == "Hi there"
    assert not so.wants(0, "!", ())                            # the output never streams
    assert so.chunk("", "stop")["choices"][0] == {"index": 0, "text": "", "logprobs": None,
                                                  "finish_reason": "length"}


def test_shapes():
    u = Usage(5, 3, 4)
    full = Shaper(False, "r", M).full([("hey", "stop", None)], u)
    assert full["object"] == "text_completion" and full["choices"][0]["text"] == "hey"
    assert full["usage"] == {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8,
                             "prompt_tokens_details": {"cached_tokens": 4}}
    chat = Shaper(True, "r", M)
    assert chat.full([("hey", "length", None)], u)["choices"][0]["message"] == {
        "role": "assistant", "content": "hey"}
    two = chat.full([("a", "stop", None), ("b", "length", None)], u)["choices"]
    assert [(c["index"], c["message"]["content"], c["finish_reason"]) for c in two] == [
        (0, "a", "stop"), (1, "b", "length")]
    assert chat.chunk("x", index=2)["choices"][0]["index"] == 2
    assert chat.chunk("", first=True)["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert chat.chunk(None, "stop")["choices"][0] == {"index": 0, "delta": {}, "logprobs": None,
                                                      "finish_reason": "stop"}
    assert chat.usage_chunk(u)["choices"] == []


def test_ready_needs_every_component_ready():
    from components.gateway.state import all_ready
    from schemas.client import ComponentStatus, StatusReport

    def report(*states, alive=True):
        return StatusReport("q", tuple(ComponentStatus(f"c{i}", 1, alive, s, 0, 0.0)
                                       for i, s in enumerate(states)))
    assert all_ready(report("ready", "ready"))
    assert not all_ready(report("ready", "starting"))       # the model still loading
    assert not all_ready(report("ready", "dead"))
    assert not all_ready(report("ready", alive=False))
    assert not all_ready(report())


@pytest.mark.parametrize("body, header, want", [
    (b'{"prompt": "x"}', None, None),                              # the tenant's default
    (b'{"prompt": "x"}', "batch", "batch"),
    (b'{"prompt": "x"}', "  batch ", "batch"),
    (b'{"prompt": "x"}', "", None),
    (b'{"prompt": "x", "service_class": "batch"}', None, "batch"),
    (b'{"prompt": "x", "service_class": "batch"}', "interactive", "batch"),   # body wins
    (b'{"prompt": "x", "service_class": ""}', "interactive", "interactive"),  # empty: unset
])
def test_the_class_comes_from_the_body_else_the_header(body, header, want):
    req = parse(body, CompletionRequest)
    assert class_of(req, header) == want
    k = kwargs(body, class_header=header)
    assert k.get("service_class") == want and ("service_class" in k) == (want is not None)


def test_chat_takes_a_class_too_and_an_overlong_one_is_400():
    body = b'{"messages": [{"role": "user", "content": "x"}], "service_class": "batch"}'
    assert kwargs(body, ChatCompletionRequest, "interactive")["service_class"] == "batch"
    k = kwargs(b'{"prompt": "x"}', class_header="c" * 257)
    with pytest.raises(ApiError) as err:
        validate_kwargs(k, 2048)
    assert err.value.status == 400 and "service_class" in err.value.message
    validate_kwargs(kwargs(b'{"prompt": "x"}', class_header="c" * 256), 2048)


def test_admission_grant_shapes():
    assert degraded_headers(False, 4) == {}
    assert degraded_headers(True, 4) == {"x-weir-degraded": "true", "x-weir-max-tokens": "4"}
    assert degraded_headers(True, None) == {"x-weir-degraded": "true"}
    weir = weir_usage("batch", True, 4, 0.01234)
    assert weir == {"service_class": "batch", "degraded": True, "max_tokens": 4,
                    "queued_ms": 12.3}
    u = Usage(5, 3, 4)
    assert Shaper(False, "r", M).full([("a", "stop", None)], u, weir)["usage"]["weir"] == weir
    assert Shaper(True, "r", M).usage_chunk(u, weir)["usage"]["weir"] == weir
    assert "weir" not in Shaper(True, "r", M).usage_chunk(u)["usage"]


def test_the_end_to_end_deadline_reaches_the_engine_and_is_checked():
    assert kwargs(b'{"prompt": "x", "e2e_deadline_ms": 2500}')["e2e_deadline_ms"] == 2500
    chat = b'{"messages": [{"role": "user", "content": "x"}], "e2e_deadline_ms": 900}'
    assert kwargs(chat, ChatCompletionRequest)["e2e_deadline_ms"] == 900
    assert "e2e_deadline_ms" not in kwargs(b'{"prompt": "x"}')
    validate_kwargs(kwargs(b'{"prompt": "x", "e2e_deadline_ms": 1}'), 2048)
    with pytest.raises(ApiError) as err:
        validate_kwargs(kwargs(b'{"prompt": "x", "e2e_deadline_ms": 0}'), 2048)
    assert err.value.status == 400 and "e2e_deadline_ms must be >= 1" in err.value.message


def test_a_deadline_finish_is_length_to_openai_clients_and_deadline_in_usage():
    """OpenAI clients parse finish_reason as one of theirs: the engine's ``deadline`` (cut
    short at the end-to-end deadline) goes out as ``length``; the usage's ``weir`` object
    says ``deadline``."""
    assert [openai_finish_reason(r) for r in ("deadline", "length", "stop", None)] == \
        ["length", "length", "stop", None]
    u = Usage(5, 3)
    for chat in (False, True):
        body = Shaper(chat, "r", M).full([("ab", "deadline", None), ("c", "stop", None)], u)
        assert [c["finish_reason"] for c in body["choices"]] == ["length", "stop"]
        chunk = Shaper(chat, "r", M).chunk(None if chat else "", "deadline")
        assert chunk["choices"][0]["finish_reason"] == "length"
    weir = weir_usage("interactive", False, 16, 0.0, deadline=True)
    assert weir == {"service_class": "interactive", "degraded": False, "max_tokens": 16,
                    "queued_ms": 0.0, "deadline": True}
    assert "deadline" not in weir_usage("interactive", False, 16, 0.0)
