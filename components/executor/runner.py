"""The step runner: applies a StepPlan's diffs to per-sequence state, runs one flat
forward over every scheduled token, and samples. No policy lives here."""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from components.executor.sampling import sample
from kernels import AttentionMetadata, KVCache
from schemas.wire import StepPlan, StepResult


@dataclass(eq=False)
class SeqState:
    token_ids: list[int]
    prompt_len: int
    num_computed: int
    block_ids: list[int]
    temperature: float
    top_p: float
    top_k: int
    seed: int | None


class ModelRunner:
    def __init__(self, model, kv: KVCache) -> None:
        self.model = model
        self.kv = kv
        self.block_size = kv.block_size
        self.seqs: dict[int, SeqState] = {}

    def step(self, plan: StepPlan) -> StepResult:
        start = time.perf_counter_ns()
        for seq_id in plan.drop:
            self.seqs.pop(seq_id, None)
        for n in plan.new_seqs:
            self.seqs[n.seq_id] = SeqState(list(n.token_ids), n.prompt_len, n.num_computed,
                                           list(n.block_ids), n.temperature, n.top_p, n.top_k,
                                           n.seed)
        input_ids: list[int] = []
        query_lens, context_lens, tables, rows = [], [], [], []
        sampled: list[tuple[int, SeqState]] = []
        for st in plan.steps:
            s = self.seqs[st.seq_id]
            s.block_ids.extend(st.new_block_ids)
            input_ids.extend(s.token_ids[s.num_computed:s.num_computed + st.num_tokens])
            query_lens.append(st.num_tokens)
            context_lens.append(s.num_computed)
            tables.append(s.block_ids)
            if st.sample:
                rows.append(len(input_ids) - 1)
                sampled.append((st.seq_id, s))
        meta = AttentionMetadata.build(query_lens, context_lens, tables, self.block_size,
                                       self.kv.device)
        ids = torch.tensor(input_ids, dtype=torch.long, device=self.kv.device)
        logits = self.model.forward(ids, meta.positions, self.kv, meta,
                                    torch.tensor(rows, dtype=torch.long, device=self.kv.device))
        tokens: list[int] = []
        if sampled:
            states = [s for _, s in sampled]
            tokens = sample(logits, [s.temperature for s in states], [s.top_p for s in states],
                            [s.top_k for s in states], [s.seed for s in states],
                            [len(s.token_ids) - s.prompt_len for s in states]).tolist()
        for st in plan.steps:
            self.seqs[st.seq_id].num_computed += st.num_tokens
        for (_, s), tok in zip(sampled, tokens):
            s.token_ids.append(tok)
        return StepResult(plan.step_id, [sid for sid, _ in sampled], tokens,
                          time.perf_counter_ns() - start)
