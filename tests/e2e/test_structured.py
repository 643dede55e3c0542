"""Structured output through the whole engine, asked for as users do: OpenAI's
``response_format`` through the official `openai` client (chat, streamed, n > 1), vLLM's
``guided_*`` and ``structured_outputs``, the SDK's ``structured=`` and ``weir generate``.
Every answer that ends by EOS is a whole sentence of its language; a language that does
not parse is a 400 with the parser's reason; KV comes back."""
import json
import os
import re
import subprocess
import sys

import openai
import pytest

from tests.e2e.conftest import GATEWAY_KEY as KEY, GATEWAY_MODEL as MODEL, start_gateway
from tests.e2e.engine import ROOT

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "pet"],
          "properties": {"name": {"type": "string", "maxLength": 24},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "pet": {"enum": ["cat", "dog", "none"]}}}


def a_person(text: str) -> bool:
    value = json.loads(text)
    return (set(value) == {"name", "age", "pet"} and isinstance(value["name"], str)
            and len(value["name"]) <= 24 and isinstance(value["age"], int)
            and 0 <= value["age"] <= 120 and value["pet"] in ("cat", "dog", "none"))


@pytest.fixture(scope="module")
def gw(tmp_path_factory, model_path):
    eng = start_gateway(tmp_path_factory)
    yield eng
    eng.stop()


@pytest.fixture
def oai(gw):
    return openai.OpenAI(base_url=gw.base_url + "/v1", api_key=KEY, max_retries=0)


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
    gw.wait_kv_free(timeout=2.0)


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
