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
        self.public = self._public_prefixes()

    def _public_prefixes(self) -> list[tuple[str, list[int], frozenset[str]]]:
        """(scope, token ids, tenants) of each configured public system prompt: the tokens
        of that system message alone, which prefix every chat prompt that starts with it."""
        out = []
        for p in self.config.kv.public_prefixes:
            if self.chat is None:
                raise ValueError("kv.public_prefixes needs a model with a chat template")
            ids = self.bundle.encode(self.chat.render(
                [{"role": "system", "content": p.system_prompt}], add_generation_prompt=False))
            out.append((f"public:{p.name}", ids, frozenset(p.tenants)))
        return out

    def scope_prefix(self, tenant: str, ids: list[int]) -> tuple[str, int]:
        """The public scope and the number of leading full blocks in it, for this prompt
        (("", 0) unless it starts with a public system prompt this tenant may share)."""
        bs = self.config.kv.block_size
        for scope, pref, tenants in self.public:
            if (not tenants or tenant in tenants) and len(pref) >= bs and ids[:len(pref)] == pref:
                return scope, len(pref) // bs
        return "", 0

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
                        public_scope, public_blocks = self.scope_prefix(req.tenant, ids)
                        hashes = block_hashes(ids[:public_blocks * bs], bs, public_scope,
                                              self.model_id)
                        hashes += block_hashes(ids[public_blocks * bs:], bs, req.tenant,
                                               self.model_id, hashes[-1] if hashes else None)
                        span.set_attributes({"gen_ai.usage.input_tokens": len(ids),
                                             "weir.prefix.full_blocks": len(hashes),
                                             "weir.chat": req.messages is not None})
                    self.tokenized += 1
                    await self.to_admission.send(
                        Tokenized(req.request_id, req.tenant, ids, hashes, req.params,
                                  req.arrival_ns, self.bundle.eos_token_ids, req.deadline_ms,
                                  req.priority, public_scope, public_blocks, req.service_class),
                        traceparent=msg.envelope.traceparent)
                case CancelRequest() as cancel:
                    await self.to_admission.send(cancel)

    def stats(self) -> dict[str, float]:
        return {"tokenized": self.tokenized}
