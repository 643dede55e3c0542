"""The end-to-end deadline on the live engine: a request with a short bound and a long
``max_tokens`` is ended by the scheduler at its bound while decoding, as a finish with
reason ``deadline`` and the tokens it streamed, near the bound (not the streamer's
backstop, ``LATE_GRACE_S`` later), and the engine's KV is all free after."""
from __future__ import annotations

import time

import anyio

BOUND_MS = 2000
MAX_TOKENS = 900        # far more than 2 s of decoding on any machine this runs on


def test_a_long_answer_ends_deadline_near_its_bound_and_frees_its_kv(engine):
    finished_before = engine.settled_stats("scheduler").get("deadline_finished", 0)
    backstop_before = engine.settled_stats("streamer").get("requests.deadline_finished", 0)

    async def main():
        async with engine.async_client() as c:
            start = time.monotonic()
            done = await c.generate("Tell me a long story about the sea.", max_tokens=MAX_TOKENS,
                                    ignore_eos=True, temperature=0.0,
                                    e2e_deadline_ms=BOUND_MS)
            return done, time.monotonic() - start

    done, took = anyio.run(main)
    assert done.finish_reason == "deadline"
    assert [c.finish_reason for c in done.choices] == ["deadline"]
    assert 0 < done.usage.completion_tokens < MAX_TOKENS
    assert done.usage.completion_tokens == len(done.token_ids)
    # the engine's arrival is after the send: never early; ended by the scheduler's heap at
    # the first step past the bound, well before the streamer's backstop would
    assert BOUND_MS / 1e3 <= took < BOUND_MS / 1e3 + 0.9, took
    engine.wait_kv_free(timeout=2.0)
    engine.wait_stat("scheduler", "deadline_finished", finished_before + 1, timeout=2.0)
    assert engine.settled_stats("streamer").get("requests.deadline_finished", 0) \
        == backstop_before
