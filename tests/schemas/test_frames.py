"""The client frame bound (schemas/frames.py): the largest legal Submit, every
field at its limit in four-byte characters, fits under it; the issue's oversized prompts
do not; and it is not loose enough to let a frame many times a legal one through."""
import msgspec
import pytest

from bus.codec import encode
from schemas import limits as v
from schemas.client import ChatMessage, SamplingParams, StructuredOutput, Submit, Tool, ToolCall
from schemas.frames import client_frame_limit
from schemas.validate import check_submit

WIDE = "\U0001F600"                 # four bytes in UTF-8


def wide(n: int) -> str:
    return WIDE * n


def largest_legal(max_model_len: int, structured: StructuredOutput) -> Submit:
    """Every bound of validate.py at once: the prompt's whole character budget in four-byte
    characters, as many empty messages as may come, every token id, tool, stop string,
    logit bias and id at its longest, integers at 64 bits."""
    params = SamplingParams(
        max_tokens=max_model_len - 1, temperature=0.123456789, top_p=0.987654321,
        top_k=v.MAX_TOP_K, seed=2**64 - 1, stop=(wide(v.MAX_STOP_CHARS),) * v.MAX_STOP_STRINGS,
        stop_token_ids=(v.MAX_TOKEN_ID,) * v.MAX_STOP_TOKEN_IDS, n=v.MAX_N,
        presence_penalty=-1.5, frequency_penalty=1.5, repetition_penalty=99.5,
        logit_bias={v.MAX_TOKEN_ID - i: -99.5 for i in range(v.MAX_LOGIT_BIAS)},
        logprobs=v.MAX_LOGPROBS, prompt_logprobs=v.MAX_LOGPROBS, structured=structured)
    chars = max_model_len * v.CHARS_PER_TOKEN_BOUND        # tools' names count toward it
    tools = tuple(Tool(f"t{i:063d}") for i in range(min(v.MAX_TOOLS, chars // 2 // 64)))
    return Submit(
        wide(v.MAX_ID_CHARS), wide(chars - 64 * len(tools)),
        (ChatMessage("", ""),) * max_model_len, [v.MAX_TOKEN_ID] * (max_model_len - 1),
        params, tenant=wide(v.MAX_ID_CHARS), deadline_ms=2**63 - 1, priority=-(2**63),
        api_key=wide(v.MAX_API_KEY_CHARS), idempotency_key=wide(v.MAX_ID_CHARS),
        attempt=2**63 - 1, service_class=wide(v.MAX_ID_CHARS),
        session_id=wide(v.MAX_ID_CHARS), tools=tools, batch_events=True)


GRAMMAR = StructuredOutput(grammar=wide(v.MAX_GRAMMAR_CHARS))
CHOICES = StructuredOutput(choice=(wide(v.MAX_GRAMMAR_CHARS // v.MAX_CHOICES),) * v.MAX_CHOICES)


@pytest.mark.parametrize("max_model_len", [16, 1024, 8192])
@pytest.mark.parametrize("structured", [GRAMMAR, CHOICES], ids=["grammar", "choices"])
def test_the_largest_legal_submit_fits(max_model_len, structured):
    sub = largest_legal(max_model_len, structured)
    assert (why := check_submit(sub, max_model_len)) is None, why
    size = len(encode(sub, traceparent="00-" + "a" * 32 + "-" + "b" * 16 + "-01"))
    limit = client_frame_limit(max_model_len)
    assert size <= limit, (size, limit)
    # an over-estimate (widest headers, budgets that cannot all be full at once), not a
    # loose one: measured 1.15-1.3x
    assert limit < 1.35 * size, (size, limit)


def test_one_past_each_text_bound_is_refused_before_it_could_fit():
    """The budgets the frame bound is built on: past any of them, check_submit refuses the
    request (prompt_too_long) whatever its frame's size. Empty messages and tool calls
    used to cost nothing, so a legal request had no largest frame."""
    L = 1024
    largest = largest_legal(L, GRAMMAR)
    over = msgspec.structs.replace(largest, prompt=largest.prompt + "x")
    assert check_submit(over, L)[0] == "prompt_too_long", "a character past the budget"
    many = Submit("r", messages=(ChatMessage("", ""),) * (L + 1))
    assert check_submit(many, L)[0] == "prompt_too_long"
    calls = Submit("r", messages=(ChatMessage("assistant", "", (ToolCall("", "", ""),) * L),))
    assert check_submit(calls, L)[0] == "prompt_too_long"        # L calls + their message
    named = Submit("r", messages=(ChatMessage("tool", "", tool_call_id="x" * (L * 32)),))
    assert check_submit(named, L)[0] == "prompt_too_long"        # a call's id is text too


@pytest.mark.parametrize("prompt", ["lorem ipsum dolor sit amet " * 150_000,     # 4 MB
                                    "lorem ipsum dolor sit amet " * 600_000])    # 16 MB
def test_the_issues_prompts_do_not_fit(prompt):
    """The frames of issue 43 (D2, D4), at the issue's max_model_len: ZeroMQ drops them
    before a byte of them is decoded."""
    assert len(encode(Submit("big", prompt))) > client_frame_limit(8192)
    assert len(encode(Submit("big", prompt))) > 1.5 * client_frame_limit(8192)
