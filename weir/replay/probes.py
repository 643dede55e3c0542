"""Live probes of scheduling behaviour, shared by the benchmarks and the end-to-end tests."""
from __future__ import annotations

import random
import time

import anyio


async def decode_through_burst(endpoint: str, api_key: str, *, streams: int = 16,
                               stream_tokens: int = 120, burst: int = 32,
                               burst_tokens: int = 512, cancel_burst: bool = False,
                               seed: int = 0, stream_gaps: list[list[float]] | None = None,
                               ) -> tuple[list[float], list[float]]:
    """``streams`` requests (32-token prompts) decode ``stream_tokens`` tokens each; once all
    are decoding, and a second later, ``burst`` prompts of ``burst_tokens`` tokens arrive at
    once. Returns the streams' inter-token gaps (seconds) from the burst's arrival on, and
    the burst's TTFTs (seconds; only those that finished). ``cancel_burst``: cancel the
    burst when the last stream ends (the gaps are all that is wanted). ``stream_gaps``: each
    stream's own gaps from its first token on are appended to it, one list per stream: its
    TPOT as the SLO measures it is their mean (from the first token, so time a stream banked
    before the burst counts, as the scheduler counts it)."""
    from weir.client import AsyncClient

    rng = random.Random(seed)
    gaps: list[float] = []
    burst_ttft: list[float] = []
    async with AsyncClient(endpoint, api_key=api_key, max_retries=0, timeout=600) as c:
        decoding, burst_sent = anyio.Event(), anyio.Event()
        started = [0]

        async def stream() -> None:
            s = await c.stream(prompt_token_ids=[rng.randrange(1000, 40000) for _ in range(32)],
                               max_tokens=stream_tokens, ignore_eos=True, temperature=0.0)
            last, mine = None, []
            async for _ in s:
                now = time.perf_counter()
                if last is None:
                    started[0] += 1
                    if started[0] == streams:
                        decoding.set()
                else:
                    mine.append(now - last)
                    if burst_sent.is_set():
                        gaps.append(now - last)
                last = now
            if stream_gaps is not None:
                stream_gaps.append(mine)

        async def burst_one() -> None:
            r = await c.generate(prompt_token_ids=[rng.randrange(1000, 40000)
                                                   for _ in range(burst_tokens)],
                                 max_tokens=2, ignore_eos=True, temperature=0.0)
            burst_ttft.append(r.ttft_ms / 1e3)

        async with anyio.create_task_group() as outer:
            async with anyio.create_task_group() as tg:
                for _ in range(streams):
                    tg.start_soon(stream)
                await decoding.wait()
                await anyio.sleep(1.0)
                burst_sent.set()
                for _ in range(burst):
                    outer.start_soon(burst_one)
            if cancel_burst:                   # the streams are done
                outer.cancel_scope.cancel()
    return gaps, burst_ttft
