"""A completions request's batch of prompts, read as one stream: one engine request per
prompt, their events merged as they come, their results merged once all have finished.
Choice ``j`` of prompt ``i`` is choice ``i * n + j`` of the response (OpenAI's and vLLM's
numbering)."""
from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator

import msgspec

from schemas.client import Accepted, TextDelta, Usage
from weir.client import Completion, Stream


class StreamGroup:
    """The SDK streams of one batch, streamed or not (the gateway reads it as it reads
    one ``Stream``: ``accepted``, async iteration, ``result``, ``abandon``)."""

    def __init__(self, streams: list[Stream], n: int) -> None:
        self.streams, self.n = streams, n

    @property
    def accepted(self) -> Accepted | None:
        """What admission granted: the first prompt's, or a degraded one's if any was."""
        got = [s.accepted for s in self.streams if s.accepted is not None]
        return next((a for a in got if a.degraded), got[0] if got else None)

    def __aiter__(self) -> AsyncIterator[TextDelta]:
        return self._events()

    async def _events(self) -> AsyncIterator[TextDelta]:
        """Every stream's deltas as they arrive, re-indexed; the first error (a refusal, a
        failure) ends the merge and is raised. Closing it stops reading every stream."""
        its = [s.__aiter__() for s in self.streams]
        pending = {asyncio.ensure_future(it.__anext__()): k for k, it in enumerate(its)}
        try:
            while pending:
                done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                ready = sorted(done, key=pending.__getitem__)
                events = []
                for fut in ready:             # every finished read is taken off: none is lost
                    k = pending.pop(fut)
                    events.append((k, fut))
                for k, fut in events:
                    try:
                        event = fut.result()
                    except StopAsyncIteration:
                        continue
                    pending[asyncio.ensure_future(its[k].__anext__())] = k
                    yield msgspec.structs.replace(event, index=k * self.n + event.index)
        finally:
            for fut in pending:
                fut.cancel()

    @property
    def result(self) -> Completion | None:
        """All prompts' results as one: choices in order, usage summed, degraded if any
        was; None until every one has finished."""
        results = [s.result for s in self.streams]
        if any(r is None for r in results):
            return None
        choices = [dataclasses.replace(c, index=k * self.n + c.index)
                   for k, r in enumerate(results) for c in r.choices]
        usage = Usage(sum(r.usage.prompt_tokens for r in results),
                      sum(r.usage.completion_tokens for r in results),
                      sum(r.usage.cached_tokens for r in results))
        return dataclasses.replace(results[0], choices=choices, usage=usage,
                                   degraded=any(r.degraded for r in results))

    @property
    def prompts(self) -> list:
        """Each prompt's prompt_logprobs (None where not asked), once all have finished."""
        return [s.result.prompt for s in self.streams]

    async def abandon(self) -> None:
        """Every stream not finished is abandoned (cancelled, its KV freed)."""
        for s in self.streams:
            if s.result is None:
                await s.abandon()
