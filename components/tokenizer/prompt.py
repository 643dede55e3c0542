"""A prompt's token ids and its prefix block hashes, as the engine computes them. The
tokenizer process uses this, and so does the router (components/router), which must
compute the very keys a replica's prefix cache is indexed by: the same tokenizer, chat
template, public system prompts, scope and model id."""
from __future__ import annotations

from pathlib import Path

from components.tokenizer.chat import ChatTemplate
from components.tokenizer.hashing import block_hashes
from components.tokenizer.vocab import load_tokenizer
from schemas.client import ChatMessage
from schemas.config import WeirConfig
from weir.model_fetch import resolve_model


class PromptHasher:
    def __init__(self, config: WeirConfig) -> None:
        path = resolve_model(config.engine.model)
        self.bundle = load_tokenizer(path)
        self.model_id = Path(path).name
        self.block_size = config.kv.block_size
        tpl = self.bundle.chat_template
        self.chat = ChatTemplate(tpl, self.bundle.bos_token, self.bundle.eos_token) if tpl else None
        self.public = self._public_prefixes(config)

    def _public_prefixes(self, config: WeirConfig) -> list[tuple[str, list[int], frozenset[str]]]:
        """(scope, token ids, tenants) of each configured public system prompt: the tokens
        of that system message alone, which prefix every chat prompt that starts with it."""
        out = []
        for p in config.kv.public_prefixes:
            if self.chat is None:
                raise ValueError("kv.public_prefixes needs a model with a chat template")
            ids = self.bundle.encode(self.chat.render(
                [{"role": "system", "content": p.system_prompt}], add_generation_prompt=False))
            out.append((f"public:{p.name}", ids, frozenset(p.tenants)))
        return out

    def scope_prefix(self, tenant: str, ids: list[int]) -> tuple[str, int]:
        """The public scope and the number of leading full blocks in it, for this prompt
        (("", 0) unless it starts with a public system prompt this tenant may share)."""
        bs = self.block_size
        for scope, pref, tenants in self.public:
            if (not tenants or tenant in tenants) and len(pref) >= bs and ids[:len(pref)] == pref:
                return scope, len(pref) // bs
        return "", 0

    def tokenize(self, prompt: str | None, messages: tuple[ChatMessage, ...] | None,
                 prompt_token_ids: list[int] | None,
                 logit_bias: dict[int, float] | None = None) -> list[int] | str:
        """Token ids for a request, or why it cannot be tokenized (or its ``logit_bias``
        names an id the vocabulary does not have)."""
        vocab = self.bundle.vocab_size
        if logit_bias and any(not 0 <= t < vocab for t in logit_bias):
            return f"logit_bias keys must be token ids in [0, {vocab})"
        if prompt_token_ids is not None:
            if any(not 0 <= t < vocab for t in prompt_token_ids):
                return f"prompt_token_ids must be in [0, {vocab})"
            return list(prompt_token_ids)
        if messages is not None:
            if self.chat is None:
                return "this model has no chat template; send a prompt instead"
            if not messages:
                return "messages is empty"
            try:
                text = self.chat.render([{"role": m.role, "content": m.content}
                                         for m in messages])
            except ValueError as exc:
                return str(exc)
        else:
            text = prompt or ""
        return self.bundle.encode(text)

    def hashes(self, tenant: str, ids: list[int]) -> tuple[list[int], str, int]:
        """The chained hashes of the prompt's full blocks, and its public scope and the
        number of leading blocks in it: blocks in a public scope first, the rest scoped to
        the tenant."""
        bs = self.block_size
        public_scope, public_blocks = self.scope_prefix(tenant, ids)
        hashes = block_hashes(ids[:public_blocks * bs], bs, public_scope, self.model_id)
        hashes += block_hashes(ids[public_blocks * bs:], bs, tenant, self.model_id,
                               hashes[-1] if hashes else None)
        return hashes, public_scope, public_blocks
