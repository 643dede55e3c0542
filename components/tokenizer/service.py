"""The tokenizer process: chat templates, tokenization and per-tenant prefix block hashes."""
from __future__ import annotations

from pathlib import Path

import structlog
from opentelemetry import trace

from bus import tracing

from bus.component import Component
from components.tokenizer.chat import ChatTemplate
from components.tokenizer.hashing import block_hashes
from components.tokenizer.vocab import load_tokenizer
from schemas.wire import (CancelRequest, EventBatch, NewRequest, Rejected, Tokenized,
                          TokenizerMsg)
from weir.model_fetch import resolve_model

log = structlog.get_logger("tokenizer")
_TRACER = trace.get_tracer("weir.tokenizer")


class TokenizerService(Component):
    name = "tokenizer"

    async def setup(self) -> None:
        path = resolve_model(self.config.engine.model)
        self.bundle = load_tokenizer(path)
        self.model_id = Path(path).name
        tpl = self.bundle.chat_template
        self.chat = ChatTemplate(tpl, self.bundle.bos_token, self.bundle.eos_token) if tpl else None
        self.inbox_sock = self.inbox(TokenizerMsg)
        self.to_admission = self.push_to("admission")
        self.to_streamer = self.push_to("streamer")
        self.tokenized = 0

    def tokenize(self, req: NewRequest) -> list[int] | str:
        """Token ids for a request, or why it cannot be tokenized."""
        if req.prompt_token_ids is not None:
            vocab = self.bundle.vocab_size
            if any(not 0 <= t < vocab for t in req.prompt_token_ids):
                return f"prompt_token_ids must be in [0, {vocab})"
            return list(req.prompt_token_ids)
        if req.messages is not None:
            if self.chat is None:
                return "this model has no chat template; send a prompt instead"
            if not req.messages:
                return "messages is empty"
            try:
                text = self.chat.render([{"role": m.role, "content": m.content}
                                         for m in req.messages])
            except ValueError as exc:
                return str(exc)
        else:
            text = req.prompt or ""
        return self.bundle.encode(text)

    async def run(self) -> None:
        bs = self.config.kv.block_size
        while True:
            msg = await self.inbox_sock.recv()
            match msg.body:
                case NewRequest() as req:
                    parent = tracing.context_from(msg.envelope.traceparent)
                    with _TRACER.start_as_current_span("tokenize", context=parent) as span:
                        ids = self.tokenize(req)
                        if isinstance(ids, str):
                            span.set_attribute("weir.rejected", "invalid_request")
                            await self.to_streamer.send(EventBatch(
                                [Rejected(req.request_id, "invalid_request", ids)]))
                            continue
                        hashes = block_hashes(ids, bs, req.tenant, self.model_id)
                        span.set_attributes({"gen_ai.usage.input_tokens": len(ids),
                                             "weir.prefix.full_blocks": len(hashes),
                                             "weir.chat": req.messages is not None})
                    self.tokenized += 1
                    await self.to_admission.send(
                        Tokenized(req.request_id, req.tenant, ids, hashes, req.params,
                                  req.arrival_ns, self.bundle.eos_token_ids, req.deadline_ms),
                        traceparent=msg.envelope.traceparent)
                case CancelRequest() as cancel:
                    await self.to_admission.send(cancel)

    def stats(self) -> dict[str, float]:
        return {"tokenized": self.tokenized}
