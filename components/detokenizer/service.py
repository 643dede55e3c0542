"""The detokenizer process: incremental text for every request, and stop strings."""
from __future__ import annotations

from dataclasses import dataclass

import structlog
from opentelemetry import trace
from opentelemetry.trace import Span

from bus import tracing

from bus.component import Component
from components.detokenizer.incremental import IncrementalDetokenizer
from components.tokenizer.vocab import load_tokenizer
from schemas.wire import (DetokenizerMsg, EventBatch, Finished, ForgetRequest, StopRequest,
                          TextDelta, TokenBatch, TokenOut, Usage)
from weir.model_fetch import resolve_model

log = structlog.get_logger("detokenizer")
_TRACER = trace.get_tracer("weir.detokenizer")


@dataclass
class _Stream:
    detok: IncrementalDetokenizer
    prompt_tokens: int
    cached_tokens: int
    queue_time_s: float
    span: Span
    completion_tokens: int = 0


class DetokenizerService(Component):
    name = "detokenizer"

    async def setup(self) -> None:
        self.bundle = load_tokenizer(resolve_model(self.config.engine.model))
        self.streams: dict[str, _Stream] = {}
        self.inbox_sock = self.inbox(DetokenizerMsg)
        self.to_streamer = self.push_to("streamer")
        self.to_scheduler = self.push_to("scheduler")

    def _open(self, item: TokenOut) -> _Stream | None:
        stream = self.streams.get(item.request_id)
        if stream is None and item.params is not None:
            p = item.params
            detok = IncrementalDetokenizer(self.bundle.tokenizer, self.bundle.special_ids,
                                           p.skip_special_tokens, p.stop)
            span = _TRACER.start_span("detokenize", context=tracing.context_from(p.traceparent),
                                      attributes={"weir.detok.stop_strings": len(p.stop)})
            stream = self.streams[item.request_id] = _Stream(detok, p.prompt_tokens, p.cached_tokens,
                                                              p.queue_time_s, span)
        return stream

    def process(self, batch: TokenBatch) -> tuple[list, list[str]]:
        """Events for the streamer, and requests whose stop string matched."""
        events, stopped = [], []
        for item in batch.items:
            stream = self._open(item)
            if stream is None:
                continue
            stream.completion_tokens += len(item.token_ids)
            out = stream.detok.push(item.token_ids)
            text = out.text
            if out.stopped:
                reason = "stop"
                stopped.append(item.request_id)
            elif item.finish_reason is not None:
                text += stream.detok.flush()
                reason = "stop" if stream.detok.stopped else item.finish_reason
            else:
                events.append(TextDelta(item.request_id, text, tuple(item.token_ids)))
                continue
            del self.streams[item.request_id]
            stream.span.set_attributes({"gen_ai.usage.output_tokens": stream.completion_tokens,
                                        "gen_ai.response.finish_reasons": (reason,)})
            stream.span.end()
            events.append(TextDelta(item.request_id, text, tuple(item.token_ids)))
            usage = item.usage or Usage(stream.prompt_tokens, stream.completion_tokens,
                                        stream.cached_tokens)
            events.append(Finished(item.request_id, reason, usage, "", stream.queue_time_s,
                                   item.timing))
        return events, stopped

    async def run(self) -> None:
        while True:
            match (await self.inbox_sock.recv()).body:
                case TokenBatch() as batch:
                    events, stopped = self.process(batch)
                    if events:
                        await self.to_streamer.send(EventBatch(events))
                    for rid in stopped:
                        await self.to_scheduler.send(StopRequest(rid))
                case ForgetRequest(request_id=rid):
                    if (stream := self.streams.pop(rid, None)) is not None:
                        stream.span.set_attribute("weir.ended", "forgotten")
                        stream.span.end()

    def stats(self) -> dict[str, float]:
        return {"streams": len(self.streams)}
