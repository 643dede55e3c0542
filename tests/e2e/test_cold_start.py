"""Cold start on the live engine: admission predicts TTFT from the first request after a
start, and after a scheduler restart, from the steps the executor timed at startup
(``ExecutorReady.step_costs``), not from steps the scheduler has yet to measure. A burst of
20 requests right after ``weir: ready``, under a class with a tight TTFT SLO: the ones
predicted past it are refused ``deadline_unmeetable`` at once, and a few are let in.
(Before, admission had no rate until the scheduler measured steps: all 20 were accepted,
and on two cores 17 of them answered past a 3 s SLO, the last after 10.8 s.)

The prompt length is sized from the rate admission reports before any request ran, so on a
fast machine or a slow one about five of the 20 fit."""
from __future__ import annotations

import os
import random
import signal
import time

import anyio

from tests.e2e.engine import Engine, wait_for
from weir.errors import RequestRejected

SLO_MS = 2000
CONFIG = f"""
[engine]
max_model_len = 1024
[scheduler]
max_num_batched_tokens = 256
[admission]
policy = "deadline"
classes = [{{ name = "tight", ttft_slo_ms = {SLO_MS} }}]
"""


def cold_rate(eng: Engine) -> float:
    """Admission's prefill rate while the scheduler has run no step: from the startup steps
    alone (0 would mean no prediction)."""
    assert eng.stats("scheduler")["steps"] == 0
    return wait_for(lambda: eng.stats("admission").get("prefill_tokens_per_s"), 5.0,
                    "a prefill rate at admission before any step")


async def _burst(eng: Engine, prompt: int, seed: int) -> list[tuple[str, float]]:
    """20 requests sent together: (outcome, seconds from send to answer) for each."""
    out: list[tuple[str, float]] = []

    async def one(c, i: int) -> None:
        rng = random.Random(seed * 100 + i)
        t0 = time.monotonic()
        try:
            await c.generate(prompt_token_ids=[rng.randrange(1000, 40000) for _ in range(prompt)],
                             max_tokens=1, temperature=0.0)
            out.append(("ok", time.monotonic() - t0))
        except RequestRejected as exc:
            out.append((exc.reason, time.monotonic() - t0))

    async with eng.async_client(max_retries=0, timeout=120) as c:
        async with anyio.create_task_group() as tg:
            for i in range(20):
                tg.start_soon(one, c, i)
    return out


def check(results: list[tuple[str, float]]) -> None:
    """Refused at once, before any prefill, for the predicted TTFT; some let in. Whether
    those meet the SLO is the exact pure test's to show (tests/components/admission/
    test_cold_start.py): here a neighbour's burst on two shared cores slows a step 2-5x
    past the startup timing (a 67-token step took 2.1 s beside two busy processes, 0.3 s
    alone), and a request let in is then answered late or dropped ``deadline_expired``."""
    refused = [s for what, s in results if what == "deadline_unmeetable"]
    let_in = [what for what, _ in results if what in ("ok", "deadline_expired")]
    assert len(refused) + len(let_in) == 20, results
    assert len(refused) >= 5 and max(refused) < 1.0, results
    assert let_in, results


def test_a_burst_right_after_a_cold_start_is_predicted(tmp_path, model_path):
    eng = Engine(tmp_path, CONFIG)
    try:
        rate = cold_rate(eng)
        # about five prompts' prefill within the SLO less its 20% headroom
        prompt = max(16, min(900, int(rate * 0.8 * SLO_MS / 1e3 / 5.5)))
        check(anyio.run(_burst, eng, prompt, 1))
        # a restarted scheduler has measured nothing: the executor hands it the startup
        # steps again, and its first report carries the same rate as at the first start
        pid = eng.status()["scheduler"].pid
        os.kill(pid, signal.SIGKILL)
        wait_for(lambda: (s := eng.status())["scheduler"].pid != pid
                 and all(c.alive and c.state == "ready" for c in s.values()), 60.0,
                 "the scheduler back")
        wait_for(lambda: eng.stats("admission").get("prefill_tokens_per_s") == rate, 5.0,
                 "the restarted scheduler's rate from the startup steps")
        assert eng.stats("scheduler")["steps"] == 0
        check(anyio.run(_burst, eng, prompt, 2))
    finally:
        eng.stop()
