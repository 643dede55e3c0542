"""A prompt's token ids and its prefix block hashes, as the engine computes them. The
tokenizer process uses this, and so does the router (components/router), which must
compute the very keys a replica's prefix cache is indexed by: the same tokenizer, chat
template, public system prompts, scope and model id."""
from __future__ import annotations

import json
from pathlib import Path

from components.model.chat import ChatTemplate
from components.model.fetch import resolve_model
from components.model.hashing import block_hashes
from components.model.vocab import load_tokenizer
from schemas.client import ChatMessage, Tool
from schemas.config import WeirConfig


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
                 logit_bias: dict[int, float] | None = None,
                 tools: tuple[Tool, ...] = ()) -> list[int] | str:
        """Token ids for a request, or why it cannot be tokenized (or its ``logit_bias``
        names an id the vocabulary does not have). ``tools`` go to the chat template."""
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
                extra = {"tools": [_tool(t) for t in tools]} if tools else {}
                text = self.chat.render([self._message(m) for m in messages], **extra)
            except ValueError as exc:
                return str(exc)
        else:
            text = prompt or ""
        return self.bundle.encode(text)

    def _message(self, m: ChatMessage) -> dict:
        """A message as chat templates read it (OpenAI's shape). An assistant's calls go
        as ``tool_calls`` (arguments parsed, as templates that render them expect); to a
        template that does not read them, as the message's text (a JSON list of the
        calls), so the model still sees what it called."""
        out: dict = {"role": m.role, "content": m.content}
        if m.tool_calls:
            calls = [{"id": c.id, "type": "function",
                      "function": {"name": c.name, "arguments": _json_or_text(c.arguments)}}
                     for c in m.tool_calls]
            out["tool_calls"] = calls
            if not self.chat.takes("tool_calls"):
                listed = json.dumps([{"name": c["function"]["name"],
                                      "arguments": c["function"]["arguments"]} for c in calls],
                                    ensure_ascii=False)
                out["content"] = f"{m.content}\n{listed}" if m.content else listed
        if m.tool_call_id is not None:
            out["tool_call_id"] = m.tool_call_id
        return out

    def hashes(self, tenant: str, ids: list[int],
               deterministic: bool = False) -> tuple[list[int], str, int]:
        """The chained hashes of the prompt's full blocks, and its public scope and the
        number of leading blocks in it: blocks in a public scope first, the rest scoped to
        the tenant. A deterministic prompt's blocks are in a scope of their own
        (``deterministic_scope``): the KV of blocks computed in the batch-invariant kernel
        plan is shared only with prompts that would compute it so, never with one computed
        by the fast plan (other bits), and never public."""
        bs = self.block_size
        if deterministic:
            return block_hashes(ids, bs, deterministic_scope(tenant), self.model_id), "", 0
        public_scope, public_blocks = self.scope_prefix(tenant, ids)
        hashes = block_hashes(ids[:public_blocks * bs], bs, public_scope, self.model_id)
        hashes += block_hashes(ids[public_blocks * bs:], bs, tenant, self.model_id,
                               hashes[-1] if hashes else None)
        return hashes, public_scope, public_blocks


def deterministic_scope(tenant: str) -> str:
    """The prefix-cache scope of a tenant's deterministic prompts (a tenant name never
    holds the NUL)."""
    return f"{tenant}\0deterministic"


def _json_or_text(text: str | None):
    """JSON text parsed, or (not JSON) the text as it is. JSON nested deeper than Python's
    recursion limit is text too: ``json.loads`` raises RecursionError on it, which crashed
    the tokenizer (and the router) on one tool whose parameters were 100,000 ``[``."""
    try:
        return json.loads(text) if text else {}
    except (ValueError, RecursionError):
        return text


def _tool(t: Tool) -> dict:
    """A tool as chat templates read it (OpenAI's shape)."""
    function: dict = {"name": t.name}
    if t.description is not None:
        function["description"] = t.description
    if t.parameters is not None:
        function["parameters"] = _json_or_text(t.parameters)
    return {"type": "function", "function": function}
