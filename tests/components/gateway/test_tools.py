"""OpenAI tool calling in the gateway (pure): tool_choice becomes structured output, the
answer's text becomes tool_calls (whole and streamed), and every way a request's tools
can be wrong is a 400. The "required" grammar is checked against llguidance with
SmolLM2's vocabulary: the calls it accepts are the ones calls_of reads."""
import json
import random

import pytest

from components.gateway.openai_api import (
    ApiError,
    ChatCompletionRequest,
    parse,
    submit_batch,
    validate_kwargs,
)
from components.gateway.shaping import Shaper
from components.gateway.tools import CallStream, ToolMode, calls_of, mode_of
from schemas.client import Tool, ToolCall
from schemas.wire import Usage

M = "SmolLM2-135M-Instruct"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "required": ["city"], "additionalProperties": False,
                   "properties": {"city": {"type": "string"}}}}}
TIME = {"type": "function", "function": {"name": "get_time"}}


def chat(**extra) -> bytes:
    return json.dumps({"messages": [{"role": "user", "content": "Weather in Paris?"}],
                       "tools": [WEATHER, TIME], **extra}).encode()


def kwargs(body: bytes) -> dict:
    (one,) = submit_batch(parse(body, ChatCompletionRequest), M)
    validate_kwargs(one, 2048)
    return one


def test_tool_choice_becomes_structured_output():
    named = kwargs(chat(tool_choice={"type": "function", "function": {"name": "get_weather"}}))
    assert json.loads(named["structured"].json) == WEATHER["function"]["parameters"]
    assert named["tools"] == [Tool("get_weather", "The weather in a city",
                                   json.dumps(WEATHER["function"]["parameters"])),
                              Tool("get_time", None, None)]
    required = json.loads(kwargs(chat(tool_choice="required"))["structured"].json)
    assert required["type"] == "array" and required["minItems"] == 1
    assert "maxItems" not in required
    assert [c["properties"]["name"] for c in required["items"]["anyOf"]] == [
        {"const": "get_weather"}, {"const": "get_time"}]
    assert required["items"]["anyOf"][1]["properties"]["parameters"] == {"type": "object"}
    one = json.loads(kwargs(chat(tool_choice="required", parallel_tool_calls=False))
                     ["structured"].json)
    assert one["maxItems"] == 1
    none = kwargs(chat(tool_choice="none"))
    assert "structured" not in none and len(none["tools"]) == 2


@pytest.mark.parametrize("extra, words", [
    ({}, '"auto"'), ({"tool_choice": "auto"}, '"auto"'),
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "not among"),
    ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "not 2"),
    ({"tool_choice": "sometimes"}, "tool_choice"),
    ({"tool_choice": "none", "tools": [WEATHER, WEATHER]}, "one name"),
    ({"tool_choice": "none", "tools": [{"type": "function", "function": {"name": "a b"}}]},
     "name must be"),
    ({"tool_choice": "none", "tools": [TIME] * 129}, "at most 128"),
    ({"tool_choice": "none", "tools": [{"type": "retrieval"}]}, "tools"),
])
def test_what_cannot_be_served_is_a_400(extra, words):
    with pytest.raises(ApiError) as err:
        kwargs(chat(**extra))
    assert err.value.status == 400 and words in err.value.message
    with pytest.raises(ApiError, match="tool_choice needs tools"):
        kwargs(json.dumps({"messages": [{"role": "user", "content": "x"}],
                           "tool_choice": "required"}).encode())


def test_an_agent_turn_goes_back_as_calls_and_answers():
    body = json.dumps({"messages": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C"}],
        "tools": [WEATHER], "tool_choice": "none"}).encode()
    msgs = kwargs(body)["messages"]
    assert msgs[1] == {"role": "assistant", "content": "",
                       "tool_calls": [ToolCall("call_1", "get_weather", '{"city": "Paris"}')]}
    assert msgs[2] == {"role": "tool", "content": "18 C", "tool_call_id": "call_1"}


def test_the_required_language_is_what_calls_of_reads(model_path):
    llguidance = pytest.importorskip("llguidance")
    from components.model.structured import grammar_of, ll_tokenizer
    from components.model.vocab import load_tokenizer

    bundle = load_tokenizer(model_path)
    vocab = ll_tokenizer(bundle)
    so = kwargs(chat(tool_choice="required"))["structured"]

    def whole(text: str) -> bool:
        m = llguidance.LLMatcher(vocab, grammar_of(so), log_level=0)
        return m.consume_tokens(bundle.encode(text)) and m.is_accepting()

    good = '[{"name": "get_weather", "parameters": {"city": "Paris"}}, ' \
           '{"name": "get_time", "parameters": {}}]'
    assert whole(good)
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"]))
            for c in calls_of(ToolMode(None), good)] == [("get_weather", {"city": "Paris"}),
                                                         ("get_time", {})]
    for bad in ('[]', '[{"name": "get_news", "parameters": {}}]',
                '[{"name": "get_weather", "parameters": {"town": "Paris"}}]',
                '{"name": "get_time", "parameters": {}}'):
        assert not whole(bad), bad


def test_answers_become_tool_calls():
    usage = Usage(10, 5)
    named = Shaper(True, "r", M, tools=ToolMode("get_weather")).full(
        [('{"city": "Paris"}', "stop", None)], usage)["choices"][0]
    call = named["message"]["tool_calls"][0]
    assert named["message"]["content"] is None and named["finish_reason"] == "stop"
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    shaper = Shaper(True, "r", M, tools=ToolMode(None))
    two = shaper.full([('[{"name": "get_time", "parameters": {}}]', "stop", None),
                       ('[{"name": "get_weather", "parameters": {"ci', "length", None)],
                      usage)["choices"]
    assert two[0]["finish_reason"] == "tool_calls"
    assert two[0]["message"]["tool_calls"][0]["function"] == {"name": "get_time",
                                                              "arguments": "{}"}
    # cut short by max_tokens: not a whole list, so the text, as it is
    assert two[1]["message"] == {"role": "assistant",
                                 "content": '[{"name": "get_weather", "parameters": {"ci'}
    assert two[1]["finish_reason"] == "length"
    assert mode_of(None, "required") is None and mode_of([WEATHER], "none") is None


def test_streamed_calls():
    named = Shaper(True, "r", M, tools=ToolMode("get_weather"))
    opened = named.chunk("", first=True)["choices"][0]["delta"]
    (head,) = opened["tool_calls"]
    assert opened["role"] == "assistant" and head["function"] == {"name": "get_weather",
                                                                  "arguments": ""}
    parts = [named.chunk(t)["choices"][0]["delta"]["tool_calls"][0] for t in ('{"ci', 'ty": ',
                                                                             '"Paris"}')]
    assert all(p == {"index": 0, "function": {"arguments": p["function"]["arguments"]}}
               for p in parts)
    assert "".join(p["function"]["arguments"] for p in parts) == '{"city": "Paris"}'
    end = named.chunk(None, "stop")["choices"][0]
    assert end["delta"] == {} and end["finish_reason"] == "stop"

    required = Shaper(True, "r", M, tools=ToolMode(None))
    assert required.chunk("", first=True, index=1)["choices"][0]["delta"] == {
        "role": "assistant"}
    assert required.chunk('[{"name": "get_ti', index=1) is None      # no whole name yet
    (opening,) = required.chunk('me", ', index=1)["choices"][0]["delta"]["tool_calls"]
    assert opening["index"] == 0 and opening["id"].startswith("call_")
    assert opening["function"] == {"name": "get_time", "arguments": ""}
    (args,) = required.chunk('"parameters": {}}]', index=1)["choices"][0]["delta"][
        "tool_calls"]
    assert args == {"index": 0, "function": {"arguments": "{}"}}
    end = required.chunk(None, "stop", index=1)["choices"][0]
    assert end["finish_reason"] == "tool_calls" and end["index"] == 1 and end["delta"] == {}
    # cut short before any call opened: the text, as content (as the whole-body shape)
    assert required.chunk('[{"name": "get_ti', index=0) is None
    cut = required.chunk(None, "length", index=0)["choices"][0]
    assert cut["delta"] == {"content": '[{"name": "get_ti'} and cut["finish_reason"] == "length"
    # cut short after one opened: what went out stands, and the finish says why it ended
    required.chunk('[{"name": "get_weather", "parameters": {"ci', index=2)
    cut = required.chunk(None, "length", index=2)["choices"][0]
    assert cut["delta"] == {} and cut["finish_reason"] == "length"


TRICKY = ('[{"name": "get_weather", "parameters": {"city": "Pa\\"ris}, ]", '
          '"days": [1, {"x": null}], "ok": true}}, {"name": "get_time", "parameters": {}}, '
          '{"name": "get_weather", "parameters": {"city": "\\u00e9\\\\"}}]')
# the keys the other way round (the grammar writes name first; the parser does not rely
# on it), and free whitespace
REVERSED = ('[ {"parameters": {"city": "Oslo", "n": [1, 2]} , "name": "get_weather"},'
            '{"parameters":{},"name":"get_time"}, {"name": "get_weather", "parameters": '
            '{"city": "{\\"}"}}]')


@pytest.mark.parametrize("seed", range(40))
@pytest.mark.parametrize("answer", [TRICKY, REVERSED], ids=["name-first", "reversed"])
def test_streamed_required_calls_are_the_whole_answers_calls(answer, seed):
    """Fed in random pieces (one character at a time included), the deltas open each call
    once, in order, with its name, and its arguments add up to its parameters' text:
    the calls ``calls_of`` reads from the whole answer, strings with brackets, commas and
    escaped quotes in them included."""
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(1, len(answer)), rng.randint(1, len(answer) - 1)))
    pieces = [answer[a:b] for a, b in zip([0] + cuts, cuts + [len(answer)])]
    stream = CallStream()
    deltas = [d for piece in pieces for d in stream.feed(piece)]
    opened = [d for d in deltas if "id" in d]
    assert [d["index"] for d in opened] == [0, 1, 2]
    args = {k: "".join(d["function"]["arguments"] for d in deltas if d["index"] == k)
            for k in range(3)}
    want = calls_of(ToolMode(None), answer)
    assert [d["function"]["name"] for d in opened] == [c["function"]["name"] for c in want]
    assert [json.loads(args[k]) for k in range(3)] == [
        json.loads(c["function"]["arguments"]) for c in want]
    assert stream.feed("") == []
