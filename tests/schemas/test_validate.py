"""The edge validator: every limit, at and just past its boundary (pure, no engine)."""
import pytest

from schemas import limits as v
from schemas.client import ChatMessage, SamplingParams, StructuredOutput, Submit
from schemas.validate import (
    check_length,
    check_logit_bias,
    check_params,
    check_prompt_size,
    check_submit,
)

L = 2048                                            # max_model_len


def sub(**kw) -> Submit:
    params = kw.pop("params", {})
    kw.setdefault("prompt", None if ("messages" in kw or "prompt_token_ids" in kw) else "hi")
    return Submit("r1", params=SamplingParams(**params), **kw)


@pytest.mark.parametrize("params", [
    {}, {"top_k": 0}, {"top_k": v.MAX_TOP_K}, {"top_k": 49152}, {"n": 16}, {"max_tokens": None},
    {"max_tokens": 1}, {"seed": -(2**63)}, {"seed": 2**64 - 1}, {"temperature": 0.0},
    {"temperature": 100.0}, {"temperature": 1e-30}, {"top_p": 1e-9}, {"top_p": 1.0},
    {"stop": ("x" * 256,) * 16}, {"stop_token_ids": tuple(range(64))},
    {"stop_token_ids": (2**31 - 1,)},
    {"presence_penalty": -2.0}, {"presence_penalty": 2}, {"frequency_penalty": -2},
    {"frequency_penalty": 2.0}, {"repetition_penalty": 1e-6}, {"repetition_penalty": 100.0},
    {"logit_bias": {0: -100.0, 2**31 - 1: 100}}, {"logit_bias": {i: 1.0 for i in range(300)}},
    {"logprobs": 0}, {"logprobs": 20}, {"min_tokens": 16}, {"min_tokens": 0},
    {"max_tokens": None, "min_tokens": 2**31 - 1},
    {"structured": StructuredOutput(json="x" * v.MAX_GRAMMAR_CHARS)},
    {"structured": StructuredOutput(choice=("x" * 256,) * 256)},
    {"structured": StructuredOutput(json_object=True, json_whitespace=True)},
    {"structured": StructuredOutput(regex="a"), "max_tokens": 3},
])
def test_params_at_their_limits_pass(params):
    assert check_params(SamplingParams(**params)) is None


@pytest.mark.parametrize("params, words", [
    ({"top_k": 2**63}, "top_k"),                    # overflowed int64 in the executor
    ({"top_k": 2**64 - 1}, "top_k"),
    ({"top_k": v.MAX_TOP_K + 1}, "top_k"),
    ({"top_k": -1}, "top_k"),
    ({"n": 0}, "n must be"), ({"n": 17}, "n must be"), ({"n": 2**70}, "n must be"),
    ({"max_tokens": 0}, "max_tokens"), ({"max_tokens": -5}, "max_tokens"),
    ({"max_tokens": 2**31}, "max_tokens"), ({"max_tokens": 10**30}, "max_tokens"),
    ({"seed": 2**64}, "seed"), ({"seed": -(2**63) - 1}, "seed"), ({"seed": 10**40}, "seed"),
    ({"temperature": -0.1}, "temperature"), ({"temperature": 100.5}, "temperature"),
    ({"temperature": float("nan")}, "temperature"), ({"temperature": float("inf")}, "temperature"),
    ({"top_p": 0.0}, "top_p"), ({"top_p": 1.0001}, "top_p"), ({"top_p": float("nan")}, "top_p"),
    ({"stop": ("a",) * 17}, "stop"), ({"stop": ("",)}, "stop"),
    ({"stop": ("x" * 257,)}, "stop string"),
    ({"stop_token_ids": tuple(range(65))}, "stop_token_ids"),
    ({"stop_token_ids": (-1,)}, "stop_token_ids"), ({"stop_token_ids": (2**31,)}, "stop_token_ids"),
    ({"stop_token_ids": (2**80,)}, "stop_token_ids"),
    ({"max_tokens": "16"}, "max_tokens"), ({"top_k": 1.5}, "top_k"), ({"top_k": True}, "top_k"),
    ({"presence_penalty": 2.01}, "presence_penalty"),
    ({"presence_penalty": float("nan")}, "presence_penalty"),
    ({"frequency_penalty": -2.5}, "frequency_penalty"),
    ({"frequency_penalty": float("inf")}, "frequency_penalty"),
    ({"frequency_penalty": "1"}, "frequency_penalty"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ({"repetition_penalty": -1.0}, "repetition_penalty"),
    ({"repetition_penalty": 100.5}, "repetition_penalty"),
    ({"repetition_penalty": float("nan")}, "repetition_penalty"),
    ({"logit_bias": {i: 1.0 for i in range(301)}}, "at most 300"),
    ({"logit_bias": {-1: 1.0}}, "keys"), ({"logit_bias": {2**31: 1.0}}, "keys"),
    ({"logit_bias": {"5": 1.0}}, "keys"), ({"logit_bias": {True: 1.0}}, "keys"),
    ({"logit_bias": {5: 100.5}}, "values"), ({"logit_bias": {5: float("nan")}}, "values"),
    ({"logit_bias": [(5, 1.0)]}, "logit_bias"),
    ({"logprobs": -1}, "logprobs"), ({"logprobs": 21}, "logprobs"),
    ({"logprobs": True}, "logprobs"), ({"logprobs": 2**70}, "logprobs"),
    ({"min_tokens": 17}, "min_tokens"), ({"min_tokens": -1}, "min_tokens"),
    ({"max_tokens": None, "min_tokens": 2**31}, "min_tokens"),
    ({"min_tokens": 1.5}, "min_tokens"),
    ({"structured": StructuredOutput()}, "exactly one of"),
    ({"structured": StructuredOutput(regex="a", grammar="b")}, "got regex, grammar"),
    ({"structured": StructuredOutput(json="{}", json_object=True)}, "got json, json_object"),
    ({"structured": StructuredOutput(json="x" * (v.MAX_GRAMMAR_CHARS + 1))}, "at most 65536"),
    ({"structured": StructuredOutput(choice=("x" * 257,) * 256)}, "at most 65536"),
    ({"structured": StructuredOutput(choice=())}, "1 to 256 non-empty"),
    ({"structured": StructuredOutput(choice=("a", ""))}, "1 to 256 non-empty"),
    ({"structured": StructuredOutput(choice=("a",) * 257)}, "1 to 256 non-empty"),
    ({"structured": StructuredOutput(regex="a", json_whitespace=True)}, "json_whitespace"),
    ({"structured": StructuredOutput(regex="a"), "min_tokens": 1}, "min_tokens cannot"),
])
def test_params_past_their_limits_are_refused(params, words):
    why = check_params(SamplingParams(**params))
    assert why is not None and words in why


def test_logit_bias():
    assert check_logit_bias(None) is None and check_logit_bias({}) is None
    assert check_logit_bias({"0": -100, "50256": 100.0, str(2**31 - 1): 0.5}) is None
    assert check_logit_bias({str(i): 1.0 for i in range(300)}) is None
    assert "at most 300" in check_logit_bias({str(i): 1.0 for i in range(301)})
    for key in ("-1", "abc", "", "1.5", str(2**31), "9" * 40, "１２", " 1"):
        assert "keys" in check_logit_bias({key: 1.0}), key
    for value in (100.5, -101, float("nan"), float("inf"), "1", None, True):
        assert "values" in check_logit_bias({"5": value}), value


def test_prompt_size_before_tokenizing():
    assert check_prompt_size("x" * (L * 32), None, None, L) is None
    assert check_prompt_size("x" * (L * 32 + 1), None, None, L)[0] == "prompt_too_long"
    assert check_prompt_size("x" * 101, None, None, L, max_prompt_chars=100)[0] == "prompt_too_long"
    msgs = [ChatMessage("user", "x" * (L * 16)), ChatMessage("assistant", "y" * (L * 16))]
    assert check_prompt_size(None, msgs, None, L)[0] == "prompt_too_long"   # roles count too
    assert check_prompt_size(None, [{"role": "user", "content": "hi"}], None, L) is None
    assert check_prompt_size(None, [], None, L) == ("invalid_request", "messages is empty")
    assert check_prompt_size(None, None, [1] * (L - 1), L) is None
    assert check_prompt_size(None, None, [1] * L, L)[0] == "prompt_too_long"
    for bad in (-1, 2**31, 2**70):
        reason, msg = check_prompt_size(None, None, [1, bad], L)
        assert reason == "invalid_request" and "prompt_token_ids" in msg


def test_check_submit_for_the_streamer():
    assert check_submit(sub(), L) is None
    assert check_submit(sub(params={"top_k": 2**63}), L)[0] == "invalid_request"
    assert check_submit(sub(params={"max_tokens": L - 1}), L) is None
    reason, msg = check_submit(sub(params={"max_tokens": L}), L)
    assert reason == "invalid_request" and "context window" in msg
    assert check_submit(sub(prompt="x" * (L * 32 + 1)), L)[0] == "prompt_too_long"
    assert check_submit(sub(prompt_token_ids=[1] * L), L)[0] == "prompt_too_long"
    assert check_submit(sub(messages=()), L) == ("invalid_request", "messages is empty")
    assert check_submit(sub(priority=2**63), L)[0] == "invalid_request"
    assert check_submit(sub(priority=-(2**63)), L) is None
    assert "deadline_ms" in check_submit(sub(deadline_ms=-1), L)[1]
    assert check_submit(sub(deadline_ms=2**63), L)[0] == "invalid_request"
    assert "e2e_deadline_ms must be >= 1" in check_submit(sub(e2e_deadline_ms=0), L)[1]
    assert check_submit(sub(e2e_deadline_ms=2**63), L)[0] == "invalid_request"
    assert check_submit(sub(e2e_deadline_ms=1), L) is None
    long_id = Submit("r" * 257, prompt="hi")
    assert "request_id" in check_submit(long_id, L)[1]


def test_check_length_unchanged():
    assert check_length(0, 4, L) == ("invalid_request", "the prompt is empty")
    assert check_length(L, None, L)[0] == "prompt_too_long"
    assert check_length(10, L - 10, L) is None
    assert "context window" in check_length(10, L - 9, L)[1]


class _Unread(str):
    """A prompt whose characters may be counted but not read."""

    def __iter__(self):
        raise AssertionError("the prompt's characters were read")

    def encode(self, *args, **kwargs):
        raise AssertionError("the prompt was encoded")

    def __getitem__(self, i):
        raise AssertionError("the prompt was indexed")


class _Uniterated(list):
    """Token ids that may be counted but not iterated."""

    def __iter__(self):
        raise AssertionError("the token ids were iterated")

    def __getitem__(self, i):
        raise AssertionError("the token ids were indexed")


def test_a_20_mb_prompt_is_refused_by_its_size_before_anything_is_read():
    big = sub(prompt=_Unread("x" * (20 << 20)))
    ids = sub(prompt_token_ids=_Uniterated(range(500_000)))
    assert check_submit(big, L)[0] == "prompt_too_long"
    assert check_submit(ids, L)[0] == "prompt_too_long"
