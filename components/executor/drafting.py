"""Draft sources for speculative decoding: each proposes up to k tokens that may follow a
running sequence, and the step runner verifies them against the target model in the same
forward (runner.py). How many a row may draft (k, 0..``speculative.max_k``) is the
scheduler's decision, made every step (components/scheduler/speculation.py); a source may
propose fewer, or none.

One interface, :class:`Drafter`: ``propose`` takes the rows to draft for and returns each
one's proposal. Proposals are deterministic functions of the sequence (the n-gram match,
or the draft model's greedy tokens), so verification treats them as a one-hot draft
distribution: the standard speculative rejection rule then accepts a draft token with the
target's probability of it, and on rejection draws from the target with that token
removed, which is what drawing the target's own token (seeded as without speculation) and
accepting iff it equals the draft does (runner.py). An EAGLE or MTP head would be a third
``Drafter`` that reads the target's hidden states; none is built.

- :class:`NgramDrafter` (prompt lookup): the continuation of the most recent earlier
  occurrence of the sequence's last ``ngram_max``..``ngram_min`` tokens, in its own prompt
  and output. No second model; pays off where the output copies its context (code edits,
  summaries with quotes, RAG, agents' tool output).
- :class:`ModelDrafter`: a smaller model with the same tokenizer, run greedily in this
  process. Its KV lives in its own tensors of the same number of blocks, indexed by the
  target's block tables: no allocation of its own, no second ledger in the kv_manager,
  and a block the scheduler frees or shares is freed or shared for both. The price is the
  draft's KV per target block (for a draft of a few layers, a few percent of the pool).
"""
from __future__ import annotations

from typing import Protocol

import torch

from kernels import AttentionMetadata


class SeqState(Protocol):
    """What a draft source reads of a sequence (the runner's ``SeqState``): its tokens
    (the last one not yet computed), its computed length and block table, and for a draft
    model the positions its own KV holds (``draft_len``, which it advances)."""

    token_ids: list[int]
    num_computed: int
    block_ids: list[int]
    draft_len: int

    def ngram_index(self) -> dict[int, list[int]]: ...


class Drafter(Protocol):
    name: str

    def propose(self, rows: list[tuple[SeqState, int]]) -> list[list[int]]:
        """Each ``(sequence, k)``'s proposal, at most ``k`` tokens, to follow its last token
        (``token_ids[-1]``, not yet computed)."""
        ...


class NgramDrafter:
    """Prompt lookup. A sequence's index of positions by token (kept on its state, grown
    as it does) finds the earlier occurrences of its last token; the most recent one whose
    match, read backwards, reaches ``max_n`` tokens (else the longest of at least ``min_n``)
    gives the tokens after it (continued with the period between the two where it runs
    into the end: a repeating run proposes its full k). At most ``scan`` occurrences are
    read per row: a bounded cost on long, repetitive sequences."""

    name = "ngram"

    def __init__(self, min_n: int = 2, max_n: int = 4, scan: int = 64) -> None:
        self.min_n, self.max_n, self.scan = min_n, max_n, scan

    def propose(self, rows: list[tuple[SeqState, int]]) -> list[list[int]]:
        return [self.lookup(s.token_ids, s.ngram_index(), k) for s, k in rows]

    def lookup(self, ids: list[int], index: dict[int, list[int]], k: int) -> list[int]:
        n = len(ids)
        if k <= 0 or n < self.min_n + 1:
            return []
        best, best_len = -1, self.min_n - 1
        seen = 0
        for p in reversed(index.get(ids[-1], ())):
            if p >= n - 1:
                continue                      # the last token itself
            seen += 1
            length = 1
            while length < self.max_n and p - length >= 0 \
                    and ids[p - length] == ids[n - 1 - length]:
                length += 1
            if length > best_len:
                best, best_len = p, length
                if length == self.max_n:
                    break
            if seen >= self.scan:
                break
        if best < 0:
            return []
        # a continuation that runs into the suffix it matched goes on with the period
        # between them (a repeating run proposes its full k, as an overlapping copy does)
        period = n - 1 - best
        out = ids[best + 1:best + 1 + k]
        while len(out) < k:
            out.append(out[len(out) - period])
        return out


class ModelDrafter:
    """A draft model's greedy proposals. Each row first catches the draft's KV up to the
    sequence (the positions its state's ``draft_len`` does not cover: the prompt the first
    time, the verified tokens since its last draft), its last query row giving the first
    draft token; then one batched forward per further token. Positions past what the
    target verified hold rejected drafts and are overwritten, as the target's are:
    ``draft_len`` is clamped to the sequence's computed length before each draft."""

    name = "draft"

    def __init__(self, model, kv) -> None:
        self.model, self.kv = model, kv
        self.block_size = kv.block_size
        self.forwards = 0

    def propose(self, rows: list[tuple[SeqState, int]]) -> list[list[int]]:
        out: list[list[int]] = [[] for _ in rows]
        live = [i for i, (_, k) in enumerate(rows) if k > 0]
        if not live:
            return out
        dev = self.kv.device
        # first pass: catch up and draft the first token
        query, ctx, tables, ids = [], [], [], []
        for i in live:
            s, _ = rows[i]
            start = min(s.draft_len, s.num_computed)
            new = s.token_ids[start:]
            query.append(len(new))
            ctx.append(start)
            tables.append(s.block_ids)
            ids.extend(new)
        toks = self._forward(ids, query, ctx, tables, dev)
        for i, t in zip(live, toks):
            s, _ = rows[i]
            s.draft_len = len(s.token_ids)
            out[i].append(t)
        step = 1
        while True:
            live = [i for i in live if rows[i][1] > step]
            if not live:
                return out
            ids = [out[i][-1] for i in live]
            ctx = [rows[i][0].draft_len for i in live]
            toks = self._forward(ids, [1] * len(live), ctx, [rows[i][0].block_ids for i in live],
                                 dev)
            for i, t in zip(live, toks):
                rows[i][0].draft_len += 1
                out[i].append(t)
            step += 1

    def _forward(self, ids: list[int], query: list[int], ctx: list[int],
                 tables: list[list[int]], dev) -> list[int]:
        meta = AttentionMetadata.build(query, ctx, tables, self.block_size, dev)
        last, at = [], 0
        for q in query:
            at += q
            last.append(at - 1)
        out = self.model.forward(torch.tensor(ids, dtype=torch.long, device=dev), meta.positions,
                                 self.kv, meta, torch.tensor(last, dtype=torch.long, device=dev),
                                 greedy=True)
        self.forwards += 1
        return out.tolist()


def build_drafter(spec_cfg, *, target_spec, load_weights, build, kv_cache) -> Drafter | None:
    """The configured draft source (None: speculation off). ``load_weights()`` gives the
    draft's (spec, weights) when it is a model; ``build(spec, weights)`` builds it as the
    target is built (its kernel plan included); ``kv_cache(model)`` allocates its KV."""
    if not spec_cfg.on:
        return None
    if spec_cfg.method == "ngram":
        return NgramDrafter(spec_cfg.ngram_min, spec_cfg.ngram_max)
    spec, weights = load_weights()
    if spec.vocab_size != target_spec.vocab_size:
        raise ValueError(f"speculative.draft_model has a vocabulary of {spec.vocab_size} "
                         f"tokens, the served model {target_spec.vocab_size}: a draft must "
                         "share the tokenizer")
    if spec_cfg.draft_layers:
        import msgspec
        if spec_cfg.draft_layers > spec.num_layers:
            raise ValueError(f"speculative.draft_layers {spec_cfg.draft_layers} exceeds the "
                             f"draft model's {spec.num_layers} layers")
        spec = msgspec.structs.replace(spec, num_layers=spec_cfg.draft_layers)
    model = build(spec, weights)
    return ModelDrafter(model, kv_cache(model))
