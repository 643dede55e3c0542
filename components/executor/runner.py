"""The step runner: applies a StepPlan's diffs to per-sequence state, does the plan's KV
block copies (copy-on-write, swap to and from the host tier, prefix demotion/promotion),
runs one flat forward over every scheduled token, and samples. No policy lives here."""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from components.executor.constraints import Ahead, Constraint, Grammars, apply_constraints
from components.executor.drafting import Drafter
from components.executor.sampling import Logprobs, RowPenalties, all_greedy, apply_penalties, sample
from kernels import AttentionMetadata, KVCache
from schemas.wire import BlockCopy, PromptChunkLogprobs, SampleLogprobs, StepPlan, StepResult


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
    penalties: RowPenalties | None = None
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    constraint: Constraint | None = None
    output_offset: int = 0            # output tokens before its prompt's end (a migration's)
    draft_len: int = 0                # positions a draft model's KV holds for it (drafting.py)
    deterministic: bool = False       # its rows run the batch-invariant kernels
    _index: dict[int, list[int]] | None = None     # prompt lookup: positions by token
    _indexed: int = 0

    def ngram_index(self) -> dict[int, list[int]]:
        """Positions of each token in ``token_ids``, grown by what was appended since."""
        if self._index is None:
            self._index = {}
        ids, index = self.token_ids, self._index
        for p in range(self._indexed, len(ids)):
            index.setdefault(ids[p], []).append(p)
        self._indexed = len(ids)
        return index


class ModelRunner:
    def __init__(self, model, kv: KVCache, num_host_blocks: int = 0, graphs=None,
                 grammars: Grammars | None = None, drafter: Drafter | None = None,
                 pieces=None) -> None:
        """``grammars``: matchers for structured output (none: a constrained sequence
        fails its step); ``drafter``: speculative decoding's draft source (none: a plan's
        ``draft_k`` is ignored); ``pieces``: the other steps' dense parts under CUDA
        graphs (PiecewiseGraphs; none: they run eagerly)."""
        self.model = model
        self.drafter = drafter
        self.drafted = 0                  # draft tokens verified, and of those accepted
        self.accepted = 0
        self.draft_ns = 0                 # time proposing them
        self.grammars = grammars
        self.kv = kv
        self.graphs = graphs              # DecodeGraphs (CUDA) or None
        self.graph_steps = 0
        self.pieces = pieces              # PiecewiseGraphs (CUDA) or None
        self.piecewise_steps = 0
        self.constrained_rows = 0         # rows sampled under structured output's masks
        self.mask_ns = 0                  # time making and applying those masks
        self.grammar_wait_ns = 0          # time steps waited for a language's compile
        self.block_size = kv.block_size
        self.seqs: dict[int, SeqState] = {}
        self.num_blocks = kv.num_blocks
        # the host-memory tier: same layout, pinned when the main pool is on a GPU; pages
        # are only touched when a block is first copied there
        shape = list(kv.data.shape)
        shape[2] = num_host_blocks
        self.host = torch.empty(shape, dtype=kv.dtype, device="cpu",
                                pin_memory=kv.device.type == "cuda")
        self.copied_blocks = 0
        plan = getattr(model, "plan", None)
        self.native_sampling = plan is None or plan.sampling == "native"

    @property
    def block_bytes(self) -> int:
        """Bytes of one KV block across every layer (keys and values)."""
        return self.kv.data[:, :, 0].numel() * self.kv.data.element_size()

    def _tier(self, block: int) -> tuple[torch.Tensor, int]:
        return (self.kv.data, block) if block < self.num_blocks else (self.host,
                                                                      block - self.num_blocks)

    def copy_blocks(self, copies: list[BlockCopy]) -> None:
        """Do the copies in order. Between CPU tiers each block is copied on its own: a
        block is one strided slice per layer, and slice copies ran 10-12 GB/s where one
        batched index copy ran 2-5 (32 blocks, 2 Zen 4 cores). Elsewhere consecutive copies
        between the same pair of tiers go as one batched index copy (one gather, one
        transfer), unless one reads a block an earlier one in the batch wrote."""
        if self.kv.device.type == "cpu":
            for c in copies:
                (src_t, s), (dst_t, d) = self._tier(c.src), self._tier(c.dst)
                dst_t[:, :, d].copy_(src_t[:, :, s])
            self.copied_blocks += len(copies)
            return
        i = 0
        while i < len(copies):
            src_t, _ = self._tier(copies[i].src)
            dst_t, _ = self._tier(copies[i].dst)
            src, dst, written = [], [], set()
            while i < len(copies):
                c = copies[i]
                (s_t, s), (d_t, d) = self._tier(c.src), self._tier(c.dst)
                if s_t is not src_t or d_t is not dst_t or c.src in written:
                    break
                src.append(s)
                dst.append(d)
                written.add(c.dst)
                i += 1
            s_idx = torch.tensor(src, device=src_t.device)
            d_idx = torch.tensor(dst, device=dst_t.device)
            dst_t[:, :, d_idx] = src_t[:, :, s_idx].to(dst_t.device, non_blocking=True)
            self.copied_blocks += len(src)

    def measure_copy_bandwidth(self, blocks: int = 32) -> float:
        """Bytes/s of moving blocks main -> host -> main (median of 5, after a first round
        that maps the pages both tiers had not touched yet), 0 without a host tier."""
        n = min(blocks, self.host.shape[2], self.num_blocks)
        if n == 0:
            return 0.0
        ids = list(range(n))
        times = []
        for _ in range(6):
            t0 = time.perf_counter()
            self.copy_blocks([BlockCopy(b, self.num_blocks + b) for b in ids])
            self.copy_blocks([BlockCopy(self.num_blocks + b, b) for b in ids])
            if self.kv.device.type == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        self.copied_blocks = 0
        return 2 * n * self.block_bytes / sorted(times[1:])[2]

    def step(self, plan: StepPlan) -> StepResult:
        start = time.perf_counter_ns()
        for seq_id in plan.drop:
            self.seqs.pop(seq_id, None)
        if plan.copies:
            self.copy_blocks(plan.copies)
        for n in plan.new_seqs:
            # the prompt's last output_offset tokens are output (a migrated stream's): the
            # penalties count them and the grammar is advanced over them
            carried = min(n.output_offset, n.prompt_len)
            self.seqs[n.seq_id] = SeqState(list(n.token_ids), n.prompt_len, n.num_computed,
                                           list(n.block_ids), n.temperature, n.top_p, n.top_k,
                                           n.seed,
                                           None if n.penalties is None
                                           else RowPenalties(n.penalties, carried), n.logprobs,
                                           n.prompt_logprobs,
                                           None if n.structured is None
                                           else self.grammars.constraint(
                                               n.structured,
                                               n.token_ids[n.prompt_len - carried:]),
                                           n.output_offset, deterministic=n.deterministic)
        drafted_ns = self.draft_ns
        drafts = self._draft(plan)
        drafted_ns = self.draft_ns - drafted_ns
        input_ids: list[int] = []
        query_lens, context_lens, tables, rows = [], [], [], []
        # one entry per sampled row: (seq, state, which sample, draft position): an n > 1
        # fork's extra samples are 1.. of its last row; a speculating row's rows are 0..d,
        # the position after its last token and after each of its d draft tokens
        sampled: list[tuple[int, SeqState, int, int]] = []
        # prompt_logprobs: (seq, first position, rows), each row's logits read the token at
        # the next position (the prompt's last row is the sampling row, not among them)
        prompt_rows: list[tuple[int, int, range]] = []
        # a deterministic step (design/executor.md, "Deterministic steps"): the whole step
        # on the invariant kernels when any row asks (the scheduler says so; a row's own
        # flag too, so a plan that forgot cannot change that row's bits)
        invariant = plan.deterministic
        for st in plan.steps:
            s = self.seqs[st.seq_id]
            invariant = invariant or s.deterministic
            if s.prompt_logprobs is not None and s.num_computed < s.prompt_len - 1:
                end = min(s.num_computed + st.num_tokens, s.prompt_len - 1)
                prompt_rows.append((st.seq_id, s.num_computed + 1,
                                    range(len(input_ids), len(input_ids) + end - s.num_computed)))
            input_ids.extend(s.token_ids[s.num_computed:s.num_computed + st.num_tokens])
            d = drafts.get(st.seq_id, ())
            input_ids.extend(d)
            query_lens.append(st.num_tokens + len(d))
            context_lens.append(s.num_computed)
            tables.append(s.block_ids)
            if st.sample and d:
                first = len(input_ids) - len(d) - 1
                for j in range(len(d) + 1):
                    rows.append(first + j)
                    sampled.append((st.seq_id, s, 0, j))
            elif st.sample:
                for k in range(st.num_samples):
                    rows.append(len(input_ids) - 1)
                    sampled.append((st.seq_id, s, k, 0))
        n = len(query_lens)
        prompt_lps: list[PromptChunkLogprobs] = []
        if n == 0:                    # only drops and copies: no forward to run
            return StepResult(plan.step_id, [], [], time.perf_counter_ns() - start)
        states = [s for _, s, _, _ in sampled]
        greedy_tokens = None
        if (self.graphs is not None and not invariant and len(input_ids) == n == len(rows)
                and self.graphs.can_replay(n, max(context_lens) + 1)):
            # decode only, one sample each: replay the captured graph of this batch bucket
            logits = self.graphs.replay(input_ids, context_lens, tables)
            self.graph_steps += 1
        else:
            meta = AttentionMetadata.build(query_lens, context_lens, tables, self.block_size,
                                           self.kv.device)
            ids = torch.tensor(input_ids, dtype=torch.long, device=self.kv.device)
            extra = [i for *_, r in prompt_rows for i in r]
            # every row takes its argmax and nothing reads the logits: the model returns
            # the tokens (on the AMX tiles without writing the logits)
            greedy = bool(sampled) and not extra and self._plain_greedy(states)
            forward = self.model.forward
            if self.pieces is not None and not invariant and self.pieces.fits(len(input_ids)):
                # prefill, mixed and verify steps: the dense parts replay their bucket's
                # graphs, attention runs eagerly between them
                forward = self.pieces.forward
                self.piecewise_steps += 1
            out = forward(ids, meta.positions, self.kv, meta,
                          torch.tensor(rows + extra, dtype=torch.long, device=self.kv.device),
                          greedy=greedy, **({"deterministic": True} if invariant else {}))
            if greedy:
                greedy_tokens = out.tolist()
            else:
                logits = out
            if extra:
                prompt_lps = self._prompt_logprobs(logits[len(rows):], prompt_rows)
                logits = logits[:len(rows)]
        tokens: list[int] = []
        logprobs: list[SampleLogprobs | None] = []
        if greedy_tokens is not None:
            tokens = greedy_tokens
        elif sampled:                 # a step of middle prefill chunks samples nothing
            tokens, logprobs = self._sample(logits, sampled, drafts)
        for st in plan.steps:
            self.seqs[st.seq_id].num_computed += st.num_tokens
        # verification: a speculating row keeps its drafts up to the first the target's own
        # token (drawn as without speculation) differs from, then that token
        out_ids: list[int] = []
        out_tokens: list[int] = []
        out_lps: list[SampleLogprobs | None] = []
        spec: list[tuple[int, int, int]] = []
        errors: list[tuple[int, str]] = []          # structured output past its limits
        failed: set[int] = set()
        i = 0
        while i < len(sampled):
            sid, s, k, _ = sampled[i]
            d = drafts.get(sid, ()) if k == 0 else ()
            take = 1
            if d:
                while take <= len(d) and tokens[i + take - 1] == d[take - 1]:
                    take += 1
                spec.append((sid, len(d), take - 1))
                s.num_computed += take - 1           # the accepted drafts' KV is kept
                self.drafted += len(d)
                self.accepted += take - 1
            for j in range(i, i + take):
                out_ids.append(sid)
                out_tokens.append(tokens[j])
                if logprobs:
                    out_lps.append(logprobs[j])
                if k == 0:                           # choice 0's (a fork takes its own)
                    s.token_ids.append(tokens[j])
                    if s.constraint is not None and sid not in failed:
                        s.constraint.advance(tokens[j])
                        if (why := s.constraint.error()) is not None:
                            errors.append((sid, why))
                            failed.add(sid)
            i += len(d) + 1
        return StepResult(plan.step_id, out_ids, out_tokens,
                          time.perf_counter_ns() - start, logprobs=out_lps,
                          prompt_logprobs=prompt_lps, structured_errors=errors, drafts=spec,
                          draft_ns=drafted_ns)

    def _draft(self, plan: StepPlan) -> dict[int, list[int]]:
        """Extend each planned row's block table, and draft for the decode rows the plan
        gave a k: each proposal cut to the blocks the row holds and, for a constrained
        row, to the prefix its language allows."""
        want: list[tuple[SeqState, int]] = []
        ids: list[int] = []
        for st in plan.steps:
            s = self.seqs[st.seq_id]
            s.block_ids.extend(st.new_block_ids)
            if st.draft_k and self.drafter is not None and st.sample \
                    and st.num_samples == 1 and s.num_computed == len(s.token_ids) - st.num_tokens:
                room = len(s.block_ids) * self.block_size - len(s.token_ids)
                if min(st.draft_k, room) > 0:
                    want.append((s, min(st.draft_k, room)))
                    ids.append(st.seq_id)
        if not want:
            return {}
        t0 = time.perf_counter_ns()
        out: dict[int, list[int]] = {}
        for sid, (s, _), d in zip(ids, want, self.drafter.propose(want)):
            if d and s.constraint is not None:
                s.constraint.ready()
                d = d[:s.constraint.matcher.validate_tokens(d)]
            if d:
                out[sid] = d
        self.draft_ns += time.perf_counter_ns() - t0
        return out

    def _sample(self, logits: torch.Tensor, sampled: list[tuple[int, SeqState, int, int]],
                drafts: dict[int, list[int]]
                ) -> tuple[list[int], list[SampleLogprobs | None]]:
        """One token per row of ``sampled`` from its logits: penalties, structured output's
        mask and the draw as the row's sequence would meet them with the drafts before it
        appended (so a speculating row's token at draft position j is the one decoding
        without speculation would draw there, given the same history)."""
        states = [s for _, s, _, _ in sampled]
        ahead = [drafts[sid][:j] if j else [] for sid, _, _, j in sampled]
        # extra samples of one row (n > 1) draw as choices 1.. would: seed + k
        penalized = [(i, s.token_ids + a if a else s.token_ids, s.prompt_len,
                      s.penalties.ahead(s.token_ids, s.prompt_len, a) if a else s.penalties)
                     for i, (s, a) in enumerate(zip(states, ahead)) if s.penalties is not None]
        asked = [i for i, s in enumerate(states) if s.logprobs is not None]
        lps = Logprobs(logits, asked, [states[i].logprobs for i in asked],
                       any(states[i].penalties is not None for i in asked),
                       self.native_sampling) if asked else None
        if penalized:
            apply_penalties(logits, penalized)
        # after the forward is launched: on a GPU the masks are made while it runs
        constrained = [(i, Ahead(s.constraint, a) if a else s.constraint)
                       for i, (s, a) in enumerate(zip(states, ahead)) if s.constraint is not None]
        if constrained:
            self.grammar_wait_ns += sum(c.ready() for _, c in constrained)
            t0 = time.perf_counter_ns()
            apply_constraints(logits, constrained, self.native_sampling)
            self.constrained_rows += len(constrained)
            self.mask_ns += time.perf_counter_ns() - t0
        seeds = [None if s.seed is None else s.seed + k for _, s, k, _ in sampled]
        tokens = sample(logits, [s.temperature for s in states], [s.top_p for s in states],
                        [s.top_k for s in states], seeds,
                        [len(s.token_ids) - s.prompt_len + s.output_offset + a for s, a in
                         zip(states, map(len, ahead))],
                        self.native_sampling).tolist()
        return tokens, (lps.finish(tokens, len(sampled)) if lps is not None else [])

    @staticmethod
    def _plain_greedy(states: list[SeqState]) -> bool:
        """Every row greedy, and no penalty, logprobs or grammar reads its logits."""
        return all(s.penalties is None and s.logprobs is None and s.constraint is None
                   for s in states) and all_greedy([s.temperature for s in states])

    def _prompt_logprobs(self, logits: torch.Tensor, prompt_rows: list[tuple[int, int, range]]
                         ) -> list[PromptChunkLogprobs]:
        """Each prompt row's next token's log-probability and the top k there, from
        ``logits`` (one row per position of ``prompt_rows``, in their order)."""
        targets, tops = [], []
        for seq_id, first, r in prompt_rows:
            s = self.seqs[seq_id]
            targets.extend(s.token_ids[first:first + len(r)])
            tops.extend([s.prompt_logprobs] * len(r))
        lps = Logprobs(logits, list(range(len(targets))), tops, False,
                       self.native_sampling).finish(targets, len(targets))
        out, at = [], 0
        for seq_id, first, r in prompt_rows:
            out.append(PromptChunkLogprobs(seq_id, first, lps[at:at + len(r)]))
            at += len(r)
        return out
