"""Structured output through the whole engine, asked for as users do: OpenAI's
``response_format`` through the official `openai` client (chat, streamed, n > 1), vLLM's
``guided_*`` and ``structured_outputs``, the SDK's ``structured=`` and ``weir generate``.
Every answer that ends by EOS is a whole sentence of its language; a language that does
not parse is a 400 with the parser's reason, and one past llguidance's limits while
generating fails with its reason; KV comes back."""
import json
import os
import re
import subprocess
import sys

import openai
import pytest

from tests.e2e.conftest import GATEWAY_KEY as KEY, GATEWAY_MODEL as MODEL
from tests.e2e.engine import ROOT, wait_for
from weir.errors import RequestFailed

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "pet"],
          "properties": {"name": {"type": "string", "maxLength": 24},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "pet": {"enum": ["cat", "dog", "none"]}}}


def a_person(text: str) -> bool:
    value = json.loads(text)
    return (set(value) == {"name", "age", "pet"} and isinstance(value["name"], str)
            and len(value["name"]) <= 24 and isinstance(value["age"], int)
            and 0 <= value["age"] <= 120 and value["pet"] in ("cat", "dog", "none"))


def test_response_format_json_schema_through_the_openai_client(gw, oai):
    msgs = [{"role": "user", "content": "Describe a person as JSON."}]
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "strict": True,
                                                  "schema": PERSON}}
    chat = oai.chat.completions.create(model=MODEL, messages=msgs, max_tokens=60,
                                       temperature=0, response_format=fmt)
    text = chat.choices[0].message.content
    assert chat.choices[0].finish_reason == "stop" and a_person(text), text
    streamed = "".join(c.choices[0].delta.content or "" for c in oai.chat.completions.create(
        model=MODEL, messages=msgs, max_tokens=60, temperature=0, response_format=fmt,
        stream=True) if c.choices)
    assert streamed == text
    # sampled, n = 3 (forks sharing the prompt): each choice its own draw, each a person
    many = oai.chat.completions.create(model=MODEL, messages=msgs, max_tokens=60,
                                       temperature=1.0, seed=11, n=3, response_format=fmt)
    texts = [c.message.content for c in many.choices]
    assert all(c.finish_reason == "stop" for c in many.choices), texts
    assert all(a_person(t) for t in texts), texts
    # any JSON object: what the free answer was not
    free = oai.chat.completions.create(model=MODEL, messages=msgs, max_tokens=60,
                                       temperature=0).choices[0].message.content
    obj = oai.chat.completions.create(model=MODEL, messages=msgs, max_tokens=120,
                                      temperature=0, response_format={"type": "json_object"})
    assert not free.startswith("{") and obj.choices[0].message.content.startswith("{")
    if obj.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(obj.choices[0].message.content), dict)
    executor = gw.stats("executor")          # weir status: rows masked, time spent on it
    assert executor["structured.rows"] >= many.usage.completion_tokens
    assert 0 < executor["structured.mask_s"] < executor["busy_s"]
    gw.wait_kv_free(timeout=2.0)


def test_metrics_count_held_requests_by_kind_and_the_masks_work(gw, oai):
    """/metrics (Prometheus, parsed by prometheus_client): HTTP requests held to a
    language by kind, and engine-wide the rows masked and the time spent on them."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    def metrics() -> dict[str, float]:
        r = httpx.get(gw.base_url + "/metrics", headers={"Authorization": f"Bearer {KEY}"})
        assert r.status_code == 200
        return {s.name + (f"[{s.labels['kind']}]" if "kind" in s.labels else ""): s.value
                for fam in text_string_to_metric_families(r.text) for s in fam.samples}

    before = metrics()
    for extra in ({"guided_regex": "[a-z]{3}"}, {"guided_regex": "[0-9]{2}"},
                  {"guided_choice": ["x", "y"]}):
        oai.completions.create(model=MODEL, prompt="Go:", max_tokens=4, temperature=0,
                               extra_body=extra)
    after = metrics()
    assert after["weir:structured_output_requests_total[regex]"] == \
        before.get("weir:structured_output_requests_total[regex]", 0) + 2
    assert after["weir:structured_output_requests_total[choice]"] == \
        before.get("weir:structured_output_requests_total[choice]", 0) + 1
    # engine counters ride on heartbeats: poll
    after = wait_for(metrics, 5, repr, until=lambda m: m["weir:structured_output_rows_total"]
                     >= before.get("weir:structured_output_rows_total", 0) + 3)
    assert after["weir:structured_output_mask_seconds_total"] > 0
    assert "weir:structured_output_compile_wait_seconds_total" in after


def test_vllm_forms_sdk_and_cli_agree(gw, oai):
    prompt = "Q: Is the sky blue on a clear day? A:"
    choice = oai.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0,
                                    extra_body={"guided_choice": [" yes", " no"]}).choices[0]
    assert choice.text in (" yes", " no") and choice.finish_reason == "stop"
    date = oai.completions.create(
        model=MODEL, prompt="The date today, as YYYY-MM-DD:", max_tokens=16, temperature=0,
        extra_body={"structured_outputs": {"regex": r" [0-9]{4}-[0-9]{2}-[0-9]{2}"}}).choices[0]
    assert re.fullmatch(r" [0-9]{4}-[0-9]{2}-[0-9]{2}", date.text), date.text
    gbnf = 'root ::= " " ("red" | "green" | "blue") ", " [a-z]{1,8}'
    color = oai.completions.create(model=MODEL, prompt="A color and a word:", max_tokens=16,
                                   temperature=0,
                                   extra_body={"guided_grammar": gbnf}).choices[0]
    assert re.fullmatch(r" (red|green|blue), [a-z]{1,8}", color.text), color.text
    with gw.client() as c:
        sdk = c.generate(prompt, max_tokens=8, temperature=0,
                         structured={"choice": [" yes", " no"]})
        person = c.generate(messages=[{"role": "user", "content": "A person as JSON."}],
                            max_tokens=60, temperature=0, structured={"json": PERSON})
    assert sdk.text == choice.text and a_person(person.text), person.text
    cli = subprocess.run(
        [sys.executable, "-m", "weir.cli", "generate", "--endpoint", gw.endpoint, "--chat",
         "--temperature", "0", "--max-tokens", "60", "--json-schema", json.dumps(PERSON),
         "Describe a person as JSON."], capture_output=True, text=True, timeout=60, cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=str(ROOT), WEIR_API_KEY=gw.service_key))
    assert cli.returncode == 0, cli.stderr
    assert a_person(cli.stdout.strip())
    gw.wait_kv_free(timeout=2.0)


@pytest.mark.parametrize("extra, words", [
    ({"guided_regex": "[0-9"}, "unclosed"),
    ({"guided_json": {"type": "nonsense"}}, "nonsense"),
    ({"guided_grammar": "start: undefined_rule"}, "undefined_rule"),
    ({"guided_json": "{no"}, "not valid JSON"),
    ({"guided_regex": "a", "guided_choice": ["b"]}, "not 2"),
])
def test_a_language_that_does_not_parse_is_a_400_and_costs_nothing(gw, oai, extra, words):
    with pytest.raises(openai.BadRequestError) as err:
        oai.completions.create(model=MODEL, prompt="hi", max_tokens=4, extra_body=extra)
    assert words in str(err.value)
    ok = oai.completions.create(model=MODEL, prompt="hi", max_tokens=2, temperature=0,
                                extra_body={"guided_choice": ["a", "b"]})
    assert ok.choices[0].text in ("a", "b")
    gw.wait_kv_free(timeout=2.0)


def test_a_language_past_its_limits_while_generating_fails_with_its_reason(gw, oai):
    """``a{1000}{1000}`` passes validation, then reaches llguidance's limits on its first
    token. It ended ``stop`` with text outside its language; now the request fails with
    llguidance's reason: a 400 (an SDK must not retry it), an error frame in a stream,
    ``RequestFailed`` in Weir's SDK; the requests beside it are untouched, KV comes back."""
    extra = {"guided_regex": "a{1000}{1000}"}
    why = "lexer error: too many expressions constructed"
    with pytest.raises(openai.BadRequestError) as err:
        oai.completions.create(model=MODEL, prompt="a", max_tokens=8, extra_body=extra)
    assert err.value.code == "structured_output_error" and why in str(err.value)
    with pytest.raises(openai.APIError) as err:
        list(oai.completions.create(model=MODEL, prompt="a", max_tokens=8, stream=True,
                                    extra_body=extra))
    assert why in str(err.value)
    with gw.client() as c, pytest.raises(RequestFailed) as failed:
        c.generate("a", max_tokens=8, structured={"regex": "a{1000}{1000}"})
    assert failed.value.reason == f"structured_output_error: {why}"
    ok = oai.completions.create(model=MODEL, prompt="hi", max_tokens=2, temperature=0,
                                extra_body={"guided_choice": ["a", "b"]})
    assert ok.choices[0].text in ("a", "b")
    gw.wait_kv_free(timeout=2.0)


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city"],
                   "properties": {"city": {"type": "string", "maxLength": 20},
                                  "unit": {"enum": ["celsius", "fahrenheit"]}}}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "additionalProperties": False,
                                       "properties": {}}}}


def a_weather_call(call) -> bool:
    args = json.loads(call.function.arguments)
    return (call.type == "function" and call.id.startswith("call_")
            and call.function.name == "get_weather" and set(args) <= {"city", "unit"}
            and isinstance(args["city"], str) and args.get("unit", "celsius") in (
                "celsius", "fahrenheit"))


def test_tool_calls_through_the_openai_client(gw, oai):
    """A named function, "required" (whole and streamed, as the client's stream helper
    accumulates it), an agent's next turn with the call and the tool's answer sent back,
    and "auto" refused."""
    msgs = [{"role": "user", "content": "What is the weather in Paris?"}]
    named = oai.chat.completions.create(
        model=MODEL, messages=msgs, tools=[WEATHER, TIME], max_tokens=40, temperature=0,
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    (call,) = named.choices[0].message.tool_calls
    assert a_weather_call(call) and named.choices[0].message.content is None
    required = oai.chat.completions.create(model=MODEL, messages=msgs, tools=[WEATHER, TIME],
                                           max_tokens=60, temperature=0, tool_choice="required",
                                           parallel_tool_calls=False)
    choice = required.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    (call,) = choice.message.tool_calls
    assert call.function.name in ("get_weather", "get_time")
    assert isinstance(json.loads(call.function.arguments), dict)
    with oai.beta.chat.completions.stream(model=MODEL, messages=msgs, tools=[WEATHER, TIME],
                                          max_tokens=60, temperature=0,
                                          tool_choice="required",
                                          parallel_tool_calls=False) as stream:
        streamed = stream.get_final_completion().choices[0]
    assert streamed.finish_reason == "tool_calls"
    assert [(c.function.name, c.function.arguments) for c in streamed.message.tool_calls] == \
        [(call.function.name, call.function.arguments)]
    with oai.beta.chat.completions.stream(
            model=MODEL, messages=msgs, tools=[WEATHER], max_tokens=40, temperature=0,
            tool_choice={"type": "function", "function": {"name": "get_weather"}}) as stream:
        (streamed_named,) = stream.get_final_completion().choices[0].message.tool_calls
    assert streamed_named.function.arguments == named.choices[0].message.tool_calls[
        0].function.arguments
    # the agent's next turn: its call and the tool's answer go back, the reply is text
    turn = msgs + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": call.id, "type": "function",
         "function": {"name": call.function.name, "arguments": call.function.arguments}}]},
        {"role": "tool", "tool_call_id": call.id, "content": "18 degrees and sunny"}]
    reply = oai.chat.completions.create(model=MODEL, messages=turn, tools=[WEATHER, TIME],
                                        tool_choice="none", max_tokens=30, temperature=0)
    assert reply.choices[0].message.content and not reply.choices[0].message.tool_calls
    with pytest.raises(openai.BadRequestError, match="auto"):
        oai.chat.completions.create(model=MODEL, messages=msgs, tools=[WEATHER], max_tokens=5)
    gw.wait_kv_free(timeout=2.0)
