"""The tokenizer process: chat templates, tokenization and per-tenant prefix block hashes."""
from __future__ import annotations

import functools

import structlog
from opentelemetry import trace

from bus import tracing
from bus.component import Component
from components.model import structured
from components.model.identity import TEMPLATE_SHA256, text_sha256
from components.model.prompt import PromptHasher
from schemas.wire import (
    CancelRequest,
    EventBatch,
    NewRequest,
    Rejected,
    StructuredOutput,
    Tokenized,
    TokenizerMsg,
)

log = structlog.get_logger("tokenizer")
_TRACER = trace.get_tracer("weir.tokenizer")


class TokenizerService(Component):
    name = "tokenizer"

    async def setup(self) -> None:
        self.prompts = PromptHasher(self.config)
        self.bundle = self.prompts.bundle
        self.template_sha256 = text_sha256(self.bundle.chat_template)
        self.inbox_sock = self.inbox(TokenizerMsg)
        self.to_admission = self.push_to("admission")
        self.to_streamer = self.push_to("streamer")
        self.tokenized = 0
        # structured output's vocabulary (0.4 s, mostly holding the GIL), built before the
        # first request: built on the first request that asked, it held up every prompt
        # behind it
        try:
            vocab = structured.ll_tokenizer(self.bundle)
        except Exception as exc:              # a tokenizer llguidance cannot read: a 400 each
            log.error("structured_output_unavailable", error=repr(exc)[:200])
            why = f"structured output is unavailable for this model's tokenizer: {exc}"[:500]
            self._checked = lambda so: why
        else:
            self._checked = functools.lru_cache(maxsize=256)(
                lambda so: structured.check(so, vocab))

    async def run(self) -> None:
        while True:
            msg = await self.inbox_sock.recv()
            match msg.body:
                case NewRequest() as req:
                    parent = tracing.context_from(msg.envelope.traceparent)
                    with _TRACER.start_as_current_span("tokenize", context=parent) as span:
                        ids = self.prompts.tokenize(req.prompt, req.messages,
                                                    req.prompt_token_ids,
                                                    req.params.logit_bias, req.tools)
                        if (so := req.params.structured) is not None:
                            # which kind of language, never its text (a schema is the user's)
                            span.set_attribute("weir.structured", structured.kind(so))
                            if not isinstance(ids, str):
                                ids = self._check_structured(so) or ids
                        if isinstance(ids, str):
                            span.set_attribute("weir.rejected", "invalid_request")
                            await self.to_streamer.send(EventBatch(
                                [Rejected(req.request_id, "invalid_request", ids)]))
                            continue
                        hashes, public_scope, public_blocks = self.prompts.hashes(
                            req.tenant, ids, req.params.deterministic)
                        span.set_attributes({"gen_ai.usage.input_tokens": len(ids),
                                             "weir.prefix.full_blocks": len(hashes),
                                             "weir.chat": req.messages is not None,
                                             "weir.tools": len(req.tools)})
                    self.tokenized += 1
                    await self.to_admission.send(
                        Tokenized(req.header, ids, hashes, self.bundle.eos_token_ids,
                                  public_scope, public_blocks),
                        traceparent=msg.envelope.traceparent)
                case CancelRequest() as cancel:
                    await self.to_admission.send(cancel)

    def _check_structured(self, so: StructuredOutput) -> str | None:
        """Why the request's structured output cannot be used with this model, or None;
        the answers for the last 256 languages kept (a service sends one schema often)."""
        return self._checked(so)

    def stats(self) -> dict[str, float]:
        return {"tokenized": self.tokenized}

    def info(self) -> dict[str, str]:
        return {TEMPLATE_SHA256: self.template_sha256}
