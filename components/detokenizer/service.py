"""The detokenizer process: incremental text for every choice of every request, and stop
strings. A request with n choices ends (one ``Finished``) when its last choice ends."""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import structlog
from opentelemetry import trace
from opentelemetry.trace import Span

from bus import tracing
from bus.component import Component
from components.detokenizer.incremental import IncrementalDetokenizer
from components.model.fetch import resolve_model
from components.model.vocab import load_tokenizer
from schemas.wire import (
    ChoiceEnd,
    DetokenizerMsg,
    EventBatch,
    Finished,
    ForgetRequest,
    PromptLogprobs,
    StopRequest,
    TextDelta,
    TokenBatch,
    TokenLogprob,
    TokenOut,
    TopLogprob,
    Usage,
)

log = structlog.get_logger("detokenizer")
_TRACER = trace.get_tracer("weir.detokenizer")


@dataclass
class _Stream:
    detoks: dict[int, IncrementalDetokenizer]      # open choices, by index
    n: int
    prompt_tokens: int
    cached_tokens: int
    queue_time_s: float
    span: Span
    completion_tokens: int = 0
    ends: dict[int, ChoiceEnd] = field(default_factory=dict)
    choice_tokens: Counter = field(default_factory=Counter)
    timing: object = None


class DetokenizerService(Component):
    name = "detokenizer"

    async def setup(self) -> None:
        self.bundle = load_tokenizer(resolve_model(self.config.engine.model))
        self.streams: dict[str, _Stream] = {}
        self.pieces: dict[int, str] = {}         # token id -> the token alone, decoded
        self.inbox_sock = self.inbox(DetokenizerMsg)
        self.to_streamer = self.push_to("streamer")
        self.to_scheduler = self.push_to("scheduler")

    def _open(self, item: TokenOut) -> tuple[_Stream, IncrementalDetokenizer] | None:
        """The request's stream and this choice's detokenizer (each choice's first output
        carries the params)."""
        stream = self.streams.get(item.request_id)
        p = item.params
        if stream is None and p is not None:
            span = _TRACER.start_span("detokenize", context=tracing.context_from(p.traceparent),
                                      attributes={"weir.detok.stop_strings": len(p.stop),
                                                  "weir.detok.choices": p.n})
            stream = self.streams[item.request_id] = _Stream(
                {}, p.n, p.prompt_tokens, p.cached_tokens, p.queue_time_s, span)
        if stream is None:
            return None
        detok = stream.detoks.get(item.index)
        if detok is None and p is not None and item.index not in stream.ends:
            detok = stream.detoks[item.index] = IncrementalDetokenizer(
                self.bundle.tokenizer, self.bundle.special_ids, p.skip_special_tokens, p.stop,
                p.min_tokens, [t for t in p.carried if 0 <= t < self.bundle.vocab_size])
        return None if detok is None else (stream, detok)

    def piece(self, token: int) -> str:
        """A token decoded alone (special tokens as themselves), as logprobs name it."""
        if (text := self.pieces.get(token)) is None:
            if not 0 <= token < self.bundle.vocab_size:
                return ""
            text = self.pieces[token] = self.bundle.tokenizer.decode(
                [token], skip_special_tokens=False)
        return text

    def named(self, token_ids, entries) -> tuple[TokenLogprob, ...]:
        """Sampled (or prompt) tokens with their logprobs entries, each token named."""
        return tuple(TokenLogprob(t, self.piece(t), lp.logprob, tuple(
            TopLogprob(i, self.piece(i), v) for i, v in zip(lp.top_ids, lp.top_logprobs)))
            for t, lp in zip(token_ids, entries))

    def logprobs(self, item: TokenOut) -> tuple[TokenLogprob, ...]:
        return self.named(item.token_ids, item.logprobs) if item.logprobs else ()

    def prompt(self, item: TokenOut) -> PromptLogprobs | None:
        """prompt_logprobs: the prompt's ids, its text (decoded as the output is), each
        token after the first named. None if an id is outside the vocabulary (only a
        corrupt message could carry one; the decoder would raise)."""
        if item.prompt is None or item.params is None:
            return None
        ids, entries = item.prompt
        if any(not 0 <= t < self.bundle.vocab_size for t in ids):
            return None
        text = self.bundle.tokenizer.decode(
            ids, skip_special_tokens=item.params.skip_special_tokens)
        return PromptLogprobs(tuple(ids), text, self.piece(ids[0]) if ids else "",
                              self.named(ids[1:], entries))

    def process(self, batch: TokenBatch) -> tuple[list, list[tuple[str, int]]]:
        """Events for the streamer, and (request, choice) pairs whose stop string matched."""
        events, stopped = [], []
        for item in batch.items:
            opened = self._open(item)
            if opened is None:
                continue
            stream, detok = opened
            rid, index = item.request_id, item.index
            stream.completion_tokens += len(item.token_ids)
            stream.choice_tokens[index] += len(item.token_ids)
            # only the executor's sampler makes these; an id outside the vocabulary (a
            # forged or corrupt message) must not reach the tokenizer's decoder, which raises
            vocab = self.bundle.vocab_size
            out = detok.push([t for t in item.token_ids if 0 <= t < vocab])
            text, reason = out.text, None
            if out.stopped:
                reason = "stop"
                stopped.append((rid, index))
            elif item.finish_reason is not None:
                text += detok.flush()
                reason = "stop" if detok.stopped else item.finish_reason
            if item.token_ids or text:      # a "deadline" end brings no token: no empty delta
                events.append(TextDelta(rid, text, tuple(item.token_ids), index,
                                        self.logprobs(item), self.prompt(item)))
            if reason is None:
                continue
            del stream.detoks[index]
            stream.ends[index] = ChoiceEnd(index, reason, stream.choice_tokens[index])
            stream.timing = item.timing or stream.timing
            if len(stream.ends) < stream.n:
                continue
            del self.streams[rid]
            ends = tuple(stream.ends[i] for i in sorted(stream.ends))
            stream.span.set_attributes({
                "gen_ai.usage.output_tokens": stream.completion_tokens,
                "gen_ai.response.finish_reasons": tuple(e.finish_reason for e in ends)})
            stream.span.end()
            usage = Usage(stream.prompt_tokens, sum(e.completion_tokens for e in ends),
                          stream.cached_tokens)
            events.append(Finished(rid, ends[0].finish_reason, usage, "", stream.queue_time_s,
                                   stream.timing, ends))
        return events, stopped

    async def run(self) -> None:
        while True:
            match (await self.inbox_sock.recv()).body:
                case TokenBatch() as batch:
                    events, stopped = self.process(batch)
                    if events:
                        await self.to_streamer.send(EventBatch(events))
                    for rid, index in stopped:
                        await self.to_scheduler.send(StopRequest(rid, index))
                case ForgetRequest(request_id=rid):
                    if (stream := self.streams.pop(rid, None)) is not None:
                        stream.span.set_attribute("weir.ended", "forgotten")
                        stream.span.end()

    async def peer_restarted(self, name: str) -> None:
        """A new scheduler or streamer holds none of these requests: their text is dead."""
        if name in ("scheduler", "streamer"):
            for stream in self.streams.values():
                stream.span.set_attribute("weir.ended", f"{name} restarted")
                stream.span.end()
            self.streams.clear()

    def stats(self) -> dict[str, float]:
        return {"streams": len(self.streams)}
