"""An agent loop over the live engine: system prompt + tools + a growing history, 8 turns,
each prompt the previous one plus about 100 tokens. The prefix cache must serve most of
each prompt from turn 2 on, cut TTFT, and leave greedy outputs unchanged."""
import statistics

import pytest

from tests.e2e.engine import Engine, side_by_side

SYSTEM = ("You are an agent with tools. Tools: search(query) returns web results; "
          "read(url) returns a page; calc(expr) evaluates arithmetic; note(text) saves a "
          "note. Think step by step and call one tool per turn. ") * 8
TURN = ("Observation {i}: the search returned several pages about river ecology, sediment "
        "transport and delta formation; one page mentions flood pulses and fish migration. "
        "Decide the next tool call and explain briefly why it helps the task. The user "
        "also asked to keep a running list of sources, so record which pages were useful "
        "and which were not before moving on. Remember that the final answer must cite at "
        "least three independent sources and summarise their agreement in plain words. ")


def run_agent(engine: Engine, turns: int = 8) -> list:
    out = []
    history = SYSTEM
    with engine.client() as c:
        for i in range(turns):
            history += TURN.format(i=i)
            out.append(c.generate(history, max_tokens=8, temperature=0.0, ignore_eos=True,
                                  tenant="agent"))
    return out


@pytest.fixture(scope="module")
def engines(tmp_path_factory, model_path):
    base = """
[kv]
num_blocks = 512
[engine]
max_model_len = 2048
[scheduler]
max_num_batched_tokens = 256
[admission]
tenants = [{ name = "agent" }]
"""
    cached = Engine(tmp_path_factory.mktemp("cached"), base, wait=False)
    uncached = Engine(tmp_path_factory.mktemp("uncached"),
                      base.replace("num_blocks = 512",
                                   "num_blocks = 512\nenable_prefix_cache = false"),
                      wait=False)
    with side_by_side(cached, uncached):
        yield cached, uncached


def test_agent_loop_reuses_its_growing_prefix(engines):
    cached, uncached = engines
    with_cache = run_agent(cached)
    without = run_agent(uncached)
    for turn, (a, b) in enumerate(zip(with_cache, without)):
        assert a.token_ids == b.token_ids, turn                  # the cache changes no output
        assert b.usage.cached_tokens == 0
        if turn >= 1:
            assert a.usage.cached_tokens >= 0.8 * a.usage.prompt_tokens, (turn, a.usage)
    sizes = [r.usage.prompt_tokens for r in with_cache]
    assert sizes[0] > 400
    assert all(80 <= b - a <= 130 for a, b in zip(sizes, sizes[1:])), sizes
    ttft_cached = statistics.median(r.ttft_ms for r in with_cache[1:])
    ttft_plain = statistics.median(r.ttft_ms for r in without[1:])
    assert ttft_cached < ttft_plain, (ttft_cached, ttft_plain)
    cached.wait_kv_free(timeout=1.0)
    uncached.wait_kv_free(timeout=1.0)
