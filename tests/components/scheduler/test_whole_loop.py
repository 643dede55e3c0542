"""The randomized whole-loop check: the scheduler's own loop, a kv_manager over a real
BlockPool and an executor model, joined by channels delivered in random order, over 800
seeds (moved out of test_core.py, whose unit tests it complements)."""
from __future__ import annotations

import random
from collections import Counter, deque

import pytest

from components.kv_manager.ops import apply_ops
from components.kv_manager.pool import BlockPool
from components.model.hashing import block_hashes
from components.scheduler import sequence
from components.scheduler.loop import SchedulerLoop
from components.scheduler.sequence import State
from schemas.config import (
    AdmissionConfig,
    EngineConfig,
    KvConfig,
    SchedulerConfig,
    SpeculativeConfig,
    TenantConfig,
    Topology,
    WeirConfig,
)
from schemas.wire import (
    CancelRequest,
    KvGrants,
    KvHello,
    KvManagerUp,
    PromptChunkLogprobs,
    Released,
    SampleLogprobs,
    SamplingParams,
    StepResult,
    TokenBatch,
)
from tests import messages as msgs

BS = 8                                       # block size, as in test_core.py


class Cluster:
    """The scheduler service's own loop (``SchedulerLoop``, exactly what the service runs), a
    kv_manager over a real BlockPool and an executor model, joined by FIFO channels delivered
    in random order.

    The executor model keeps what each KV slot holds (tenant, hash of the token prefix up
    to it), replays every block copy a plan carries (copy-on-write, swap, demotion,
    promotion), and checks, for every token it computes, that its whole context reads back
    exactly its own prefix: a wrong block table, a bad prefix-cache hit, a block reused
    while still needed, a lost or misordered copy, or KV leaking between tenants all fail
    here. Requests may ask for n > 1 choices and carry priorities and deadlines; a host tier
    of random size makes preemption swap as well as recompute; tenants may have KV budgets
    (enforced by the pool) and running caps (enforced by the core).

    Speculation is drawn on in about half the seeds (n-gram, a random ``max_k``, the
    scheduler's control or fixed k, a CPU-like step-cost prior or none): the executor model
    then drafts up to each row's ``draft_k`` tokens (sometimes none) and accepts a random
    number of them, exact as verification is: the accepted drafts are the model's own next
    tokens, listed in order with the target's token after them. It writes the KV of every
    draft it verifies; a rejected draft's is poisoned, so a read of it before the next step
    writes that position again fails the KV check. A verify never goes past the blocks the
    sequence holds, its ``max_tokens`` or the model's length.

    ``scheduler.async_depth`` is 1 or 2. At 2 the executor model tends to hold a plan until
    the next one is queued behind it (it runs them in order), so step N's result reaches the
    scheduler after N+1 was planned. Requests may have EOS ids, so a step's sample can end a
    sequence already planned into the next step. A sequence that ends or is preempted gives
    its blocks back at once, so a step still in flight may run for it on blocks the pool
    has already taken back (``stale_steps`` counts them). Such a step's result will be
    discarded, so the model writes a poison value where it writes KV: the KV check above
    then says that no later read ever sees what a discarded step wrote (in a block handed
    on, in a prefix-cache entry, in a swap or a copy). Such a step may well write a block
    the pool has meanwhile made a prefix-cache entry of (the target of a promotion): the
    copy that fills it rides in a later plan, so it lands after the write. Besides, when a
    step runs: a sequence whose result the scheduler will take runs on blocks leased to it,
    and no block a step writes is used by another sequence of the same plan.
    ``check_quiescent``: every block free again, and every finished request's output exactly
    what the model gives alone (so depth 2 emits what depth 1 does)."""

    def __init__(self, seed: int) -> None:
        self.rng = rng = random.Random(seed)
        self.seed = seed
        self.num_blocks = rng.choice([4, 6, 8, 12, 20])
        self.num_cpu_blocks = rng.choice([0, 2, 8, 20])
        self.max_model_len = min(self.num_blocks * BS, 64)
        mode = rng.choice(["auto", "recompute"] + ["swap"] * (self.num_cpu_blocks > 0))
        tenants = (TenantConfig("a", weight=rng.choice([1.0, 2.0]),
                                kv_blocks=rng.choice([0, 0, self.num_blocks // 2 + 2]),
                                max_running=rng.choice([0, 0, 1, 2])),
                   TenantConfig("b"))
        self.kv_budgets = {t.name: t.kv_blocks for t in tenants if t.kv_blocks}
        self.caps = {t.name: t.max_running for t in tenants if t.max_running}
        self.depth = rng.choice([1, 2])
        # speculation from a stream of its own: a seed without it runs as it always did
        self.spec_rng = srng = random.Random(seed * 7919 + 1)
        speculative = SpeculativeConfig(method="off")
        if srng.random() < 0.5:
            speculative = SpeculativeConfig(method="ngram", max_k=srng.randint(1, 5),
                                            control=srng.choice(["scheduler", "fixed"]),
                                            acceptance_prior=srng.choice([0.3, 0.6, 0.9]))
        self.spec_on = speculative.on
        self.verifies = self.accepted = 0      # verifies the executor ran, drafts kept
        self.stops_in_drafts = 0               # verifies whose accepted drafts hold an EOS
        config = WeirConfig(
            Topology(run_dir="/nonexistent"),
            engine=EngineConfig(max_model_len=self.max_model_len),
            scheduler=SchedulerConfig(max_num_seqs=rng.choice([1, 2, 4]),
                                      max_num_batched_tokens=rng.choice([16, 24, 32]),
                                      lookahead_tokens=rng.choice([1, 4, 8]),
                                      fairness=rng.choice(["vtc", "fcfs"]),
                                      chunking=rng.choice(["slack", "fixed"]),
                                      async_depth=self.depth),
            kv=KvConfig(block_size=BS, num_blocks=self.num_blocks, grow_blocks=rng.choice([1, 2]),
                        num_cpu_blocks=self.num_cpu_blocks, preemption_mode=mode),
            admission=AdmissionConfig(tenants=tenants), speculative=speculative)
        self.loop = SchedulerLoop(config, epoch=1)
        self.core = self.loop.core
        if self.spec_on and srng.random() < 0.7:   # a CPU's step: drafts pay at small batches
            self.core.cost.set_prior([12e-3, 0.12e-3, 1e-8, 0.0, 1e-8])
        if rng.random() < 0.8:                # swap costs 2 blocks * 1 B / bw; recompute 1 ms/token
            self.core.on_executor(1, rng.choice([100.0, 1e5]))
            self.core.prices.recompute_s = lambda tokens: tokens * 1e-3
        self.prefix_cache = rng.random() < 0.8
        self.pool = self.new_pool()
        self.kv_epoch = 0
        self.to_kv: deque = deque()
        self.to_executor: deque = deque()
        self.inbox = {"from_kv": deque(), "from_executor": deque(), "from_client": deque()}
        self.kv_slots: dict[tuple[int, int], tuple[str, int]] = {}
        self.ex_seqs: dict[int, dict] = {}
        self.announced: set[int] = set()       # seq ids a plan has introduced (new_seqs)
        self.tenant_of: dict[int, str] = {}
        self.request_of: dict[int, str] = {}
        self.requests: dict[str, dict] = {}
        self.ended: dict[str, str] = {}
        self.restarts = 0
        self.clock = 0                         # ns; both of the loop's clocks
        self.max_running_seen: Counter[str] = Counter()
        self.overlapped = 0                    # plans sent while another step was in flight
        self.stale_steps = 0                   # steps run for a sequence already released
        self.inbox["from_kv"].append(KvManagerUp(0, self.num_blocks))

    def new_pool(self) -> BlockPool:
        return BlockPool(self.num_blocks, BS, self.prefix_cache, self.num_cpu_blocks,
                         tenant_blocks=self.kv_budgets)

    @staticmethod
    def next_token(tenant: str, tokens: list[int], sample: int = 0) -> int:
        return hash((tenant == "a", tuple(tokens), sample)) % 50 + 1000

    # -- the scheduler service: the loop's sends, routed
    def deliver(self, sends) -> None:
        assert len(self.core.in_flight) <= self.depth, f"seed {self.seed}: too many in flight"
        for to, msg in sends:
            if to == "executor":
                self.to_executor.append(msg)
                step = self.loop.steps.get(msg.step_id)
                self.overlapped += bool(step and step.in_flight_before)
            elif to == "kv_manager":
                self.to_kv.append(msg)
            elif to == "detokenizer" and isinstance(msg, TokenBatch):
                for t in msg.items:
                    r = self.requests[t.request_id]
                    r["out"].setdefault(t.index, []).extend(t.token_ids)
                    # each token travels with its own logprobs (the executor's below name
                    # the token they belong to), through forks, discards and overlap
                    assert [lp.top_ids[0] for lp in t.logprobs] == t.token_ids, \
                        f"seed {self.seed}: logprobs of {t.request_id} paired wrongly"
                    if t.prompt is not None:  # whole, in order, once, on its first token
                        assert t.prompt[0] == r["tokens"] and r["out"][t.index] == t.token_ids
                        assert [lp.top_ids[0] for lp in t.prompt[1]] == r["tokens"][1:], \
                            f"seed {self.seed}: prompt logprobs of {t.request_id} wrong"
                        r["prompts"] += 1
                    if t.finish_reason:
                        r["ends"][t.index] = t.finish_reason
            elif to == "admission" and isinstance(msg, Released):
                for rid in msg.request_ids:
                    ends = self.requests[rid]["ends"]
                    self.ended[rid] = ("failed" if len(ends) < self.requests[rid]["n"]
                                       or "failed" in ends.values() else "done")
        self.tenant_of.update((s.seq_id, s.tenant) for s in self.core.by_seq.values())
        self.request_of.update((s.seq_id, s.request_id) for s in self.core.by_seq.values())
        for tenant, n in self.core.running_slots().items():
            self.max_running_seen[tenant] = max(self.max_running_seen[tenant], n)
            cap = self.caps.get(tenant)
            # a request alone may exceed the cap (it would never run otherwise)
            assert not cap or n <= cap or len({s.request_id for s in self.core.running
                                               if s.tenant == tenant}) == 1, \
                f"seed {self.seed}: tenant {tenant} runs {n} > cap {cap}"

    def scheduler_step(self, source: str) -> None:
        self.clock += self.rng.randint(1, 5_000_000)
        msg = self.inbox[source].popleft()
        self.deliver(self.loop.handle(msg, self.clock, self.clock))

    # -- the kv_manager service
    def kv_step(self) -> None:
        msg = self.to_kv.popleft()
        if msg.epoch > self.kv_epoch:
            self.pool.reclaim(msg.epoch)
            self.kv_epoch = msg.epoch
        if isinstance(msg, KvHello) or msg.epoch < self.kv_epoch:
            return
        grants = apply_ops(self.pool, msg)
        for tenant, budget in self.kv_budgets.items():
            assert self.pool.tenant_blocks(tenant) <= budget, f"seed {self.seed}: budget"
        if grants:
            self.inbox["from_kv"].append(KvGrants(grants, self.pool.num_free,
                                                  self.pool.num_cpu_free))

    def kv_restart(self) -> None:
        self.pool = self.new_pool()
        self.kv_epoch = 0
        self.inbox["from_kv"].append(KvManagerUp(self.restarts + 1, self.num_blocks))

    # -- the executor
    def executor_step(self) -> None:
        plan = self.to_executor.popleft()
        for seq_id in plan.drop:
            self.ex_seqs.pop(seq_id, None)
        for c in plan.copies:
            for slot in range(BS):
                if (c.src, slot) in self.kv_slots:
                    self.kv_slots[(c.dst, slot)] = self.kv_slots[(c.src, slot)]
                else:
                    self.kv_slots.pop((c.dst, slot), None)
        for n in plan.new_seqs:
            # a prompt owed its logprobs is computed whole, never read from the cache; one
            # back from the host tier (a swap keeps its seq id) resumes on its own KV, its
            # logprobs so far already taken
            assert (n.prompt_logprobs is None or n.num_computed == 0
                    or n.seq_id in self.announced), f"seed {self.seed}"
            self.announced.add(n.seq_id)
            self.ex_seqs[n.seq_id] = dict(tokens=list(n.token_ids), done=n.num_computed,
                                          blocks=list(n.block_ids), tenant=self.tenant_of[n.seq_id],
                                          prompt_len=n.prompt_len, prompt_lp=n.prompt_logprobs,
                                          request=self.requests[self.request_of[n.seq_id]])
        ids, tokens, prompt_chunks = [], [], []
        verifies: list[tuple[int, int, int]] = []
        writes: dict[int, int] = {}           # block -> the sequence writing it in this plan
        used_by: dict[int, set[int]] = {}     # block -> the sequences using it in this plan
        discarded: set[int] = set()           # sequences whose result here will be dropped
        drafted: dict[int, int] = {}          # seq id -> drafts it verifies in this plan
        for st in plan.steps:
            if st.draft_k:                    # a decode row, one sample, past any fork
                assert st.num_tokens == 1 and st.sample and st.num_samples == 1, \
                    f"seed {self.seed}: drafts for seq {st.seq_id} that is not decoding"
                # the n-gram source proposes up to draft_k tokens, or finds none
                drafted[st.seq_id] = self.spec_rng.randint(0, st.draft_k)
        for st in plan.steps:
            s = self.ex_seqs[st.seq_id]
            s["blocks"].extend(st.new_block_ids)
            blocks, start = s["blocks"], s["done"]
            stop = start + st.num_tokens + drafted.get(st.seq_id, 0)
            for b in blocks[:-(-stop // BS)]:
                used_by.setdefault(b, set()).add(st.seq_id)
            for b in {blocks[p // BS] for p in range(start, min(stop, len(blocks) * BS))}:
                assert writes.setdefault(b, st.seq_id) == st.seq_id, \
                    f"seed {self.seed}: block {b} written by two sequences in one step"
            seq = self.core.by_seq.get(st.seq_id)
            if seq is None or all(f.step_id != plan.step_id for f in seq.in_flight):
                discarded.add(st.seq_id)      # ended or preempted since it was planned
                if not self.pool.blocks_of(st.seq_id) or self.pool._leases[st.seq_id].swapped:
                    self.stale_steps += 1     # and its blocks are back at the pool already
            elif not self.restarts:   # (a restarted pool lost the leases of steps in flight)
                assert set(blocks[:-(-stop // BS)]) <= set(self.pool.blocks_of(st.seq_id)), \
                    f"seed {self.seed}: seq {st.seq_id} runs on blocks it no longer leases"
        for b, seq_id in writes.items():
            assert used_by[b] == {seq_id}, \
                f"seed {self.seed}: block {b} written by {seq_id}, used by {used_by[b]} at once"
        for st in plan.steps:
            s = self.ex_seqs[st.seq_id]
            toks, blocks, tenant = s["tokens"], s["blocks"], s["tenant"]
            if s["prompt_lp"] is not None:    # each entry names the token it is for
                first, last = s["done"] + 1, min(s["done"] + st.num_tokens, s["prompt_len"] - 1)
                if first <= last:
                    prompt_chunks.append(PromptChunkLogprobs(st.seq_id, first, [
                        SampleLogprobs(-1.0, [toks[p]], [-1.0]) for p in range(first, last + 1)]))
            d = drafted.get(st.seq_id, 0)
            if d:
                # the verify: each draft accepted with the sampler's agreement, up to the
                # first it refuses; an accepted draft is the model's own next token
                a = 0
                while a < d and self.spec_rng.random() < 0.7:
                    a += 1
                ext = list(toks)
                for _ in range(a + 1):
                    ext.append(self.next_token(tenant, ext))
                drafts = ext[len(toks):len(toks) + a] + [
                    self.next_token(tenant, ext[:len(toks) + j]) + 100 for j in range(a, d)]
            for p in range(s["done"], s["done"] + st.num_tokens + d):
                assert p < len(blocks) * BS, f"seed {self.seed}: no slot for token {p}"
                if p >= s["done"] + st.num_tokens:    # a draft's position
                    ctx = toks + drafts[:p - s["done"] - st.num_tokens + 1]
                else:
                    ctx = toks[:p + 1]
                if st.seq_id in discarded:    # what it reads and writes is thrown away:
                    # poison what it writes, so any later read of it fails
                    self.kv_slots[(blocks[p // BS], p % BS)] = ("discarded", plan.step_id)
                    continue
                for q in range(p):
                    assert self.kv_slots.get((blocks[q // BS], q % BS)) == (
                        tenant, hash(tuple(ctx[:q + 1]))), \
                        f"seed {self.seed}: seq {st.seq_id} reads wrong KV at {q}"
                self.kv_slots[(blocks[p // BS], p % BS)] = (tenant, hash(tuple(ctx)))
            s["done"] += st.num_tokens
            assert (s["done"] == len(toks)) == st.sample, f"seed {self.seed}: sample flag"
            if st.sample:
                # planned ahead or not, no step samples past a sequence's certain end, and
                # an n > 1 request draws its n first tokens once (then it forks)
                cap = s["request"]["max_tokens"]
                assert ((cap is None or len(toks) - s["prompt_len"] < cap)
                        and len(toks) < self.max_model_len), f"seed {self.seed}: past the end"
                assert st.num_samples == 1 or len(toks) == s["prompt_len"], \
                    f"seed {self.seed}: seq {st.seq_id} draws {st.num_samples} again"
                if st.draft_k:    # its 1 + k tokens stay within max_tokens and the length
                    assert ((cap is None or len(toks) - s["prompt_len"] + 1 + st.draft_k <= cap)
                            and len(toks) + 1 + st.draft_k <= self.max_model_len), \
                        f"seed {self.seed}: seq {st.seq_id} drafts past its end"
                if d:
                    drawn = ext[len(toks):]           # the accepted drafts, then its own
                    verifies.append((st.seq_id, d, a))
                    self.verifies += 1
                    self.accepted += a
                    self.stops_in_drafts += any(t in s["request"]["eos"] for t in drawn[:-1])
                else:
                    drawn = [self.next_token(tenant, toks, i) for i in range(st.num_samples)]
                ids += [st.seq_id] * len(drawn)
                tokens += drawn
                if d:
                    toks.extend(drawn)
                    s["done"] += a                    # the accepted drafts' KV is kept
                else:
                    toks.append(drawn[0])
        self.inbox["from_executor"].append(StepResult(
            plan.step_id, ids, tokens, self.rng.randint(1, 3_000_000),
            logprobs=[SampleLogprobs(-1.0, [t], [-1.0]) for t in tokens],
            prompt_logprobs=prompt_chunks, drafts=verifies))

    def executor_restart(self) -> None:
        """Its state and KV are gone; plans not yet run are lost, results already sent are
        still delivered. The scheduler hears of it at once (a fresh executor must not get
        diffs for sequences it never saw; that window is the executor service's concern)."""
        self.ex_seqs.clear()
        self.kv_slots.clear()
        self.to_executor.clear()
        self.deliver(self.loop.peer_restarted("executor", self.clock, self.clock))
        self.pool.drop_cache()            # the kv_manager forgets what lived in that memory

    # -- the world
    def run(self, num_requests: int, restarts: bool) -> None:
        rng, arrived = self.rng, 0
        for _ in range(20_000):
            moves = []
            if arrived < num_requests:
                moves.append("arrive")
            if self.to_kv:
                moves += ["kv"] * 3
            # at depth 2 the executor mostly waits for the next plan behind the one it runs
            if self.to_executor and (self.depth == 1 or len(self.to_executor) > 1
                                     or rng.random() < 0.2):
                moves += ["executor"] * 2
            moves += [src for src, q in self.inbox.items() if q for _ in range(2)]
            if not moves and self.to_executor:
                moves.append("executor")
            if not moves:
                return
            live = [r for r in self.requests if r not in self.ended]
            if live and rng.random() < 0.03:
                moves.append("cancel")
            if restarts and self.restarts < 2 and rng.random() < 0.01:
                moves.append("kv_restart")
                # the pool's prefix cache outlives the executor's KV memory (see
                # test_prefix_cache_survives_executor_restart): restart it only without one
                if not self.prefix_cache:
                    moves.append("executor_restart")
            move = rng.choice(moves)
            if move == "arrive":
                arrived += 1
                tenant = rng.choice("ab")
                n = rng.randint(1, self.max_model_len // 2)
                shared = rng.choice([[1] * 8, [2] * 8, []])
                toks = (shared + [rng.randint(0, 3) for _ in range(n)])[:n]
                rid = f"r{arrived}"
                n = rng.choice([1, 1, 1, 2, 3])
                # None: to max_model_len (not for a tenant whose KV budget is smaller)
                max_tokens = rng.choice([rng.randint(1, 12)] * 9
                                        + [None] * (tenant not in self.kv_budgets))
                eos = tuple(rng.sample(range(1000, 1050), rng.choice([0, 0, 4])))
                prompt_lp = rng.choice([None, None, None, 1])
                self.requests[rid] = dict(tenant=tenant, tokens=toks, out={}, ends={}, n=n,
                                          max_tokens=max_tokens, eos=eos, prompts=0,
                                          prompt_lp=prompt_lp)
                self.inbox["from_client"].append(
                    msgs.admitted(rid, tenant, toks, block_hashes(toks, BS, tenant, "m"),
                             SamplingParams(max_tokens=max_tokens, n=n,
                                            prompt_logprobs=prompt_lp), self.clock, eos,
                             deadline_ms=rng.choice([None, 2, 10, 50]),
                             priority=rng.choice([0, 1])))
            elif move == "cancel":
                self.inbox["from_client"].append(CancelRequest(rng.choice(live), "client"))
            elif move == "kv":
                self.kv_step()
            elif move == "executor":
                self.executor_step()
            elif move.endswith("_restart"):
                self.restarts += 1
                getattr(self, move)()
            else:
                self.scheduler_step(move)
        raise AssertionError(f"seed {self.seed}: no quiescence")

    def check_quiescent(self) -> None:
        stuck = sorted(set(self.requests) - set(self.ended))
        assert not stuck, f"seed {self.seed}: requests never finished: {stuck}"
        assert not self.core.has_work and self.core.by_request == {}
        assert self.pool.num_free == self.num_blocks, f"seed {self.seed}: leaked blocks"
        assert self.pool.num_cpu_free == self.num_cpu_blocks, f"seed {self.seed}: leaked cpu"
        assert self.pool.stats().leased_seqs == 0
        for rid, r in self.requests.items():
            assert r["prompts"] <= 1, f"seed {self.seed}: {rid}'s prompt logprobs sent twice"
            if self.ended[rid] == "done":
                assert sorted(r["out"]) == list(range(r["n"])), f"seed {self.seed}: {rid}"
                assert r["prompts"] == (r["prompt_lp"] is not None), f"seed {self.seed}: {rid}"
                for index, out in r["out"].items():
                    # exactly the output the model gives alone, one step at a time: every
                    # token continues its own prefix, up to the first EOS or the length cap
                    # (so overlapped steps emit what depth 1 does, and nothing after an end)
                    assert (out, r["ends"][index]) == self.expected(r, index), \
                        f"seed {self.seed}: {rid}[{index}]"
            else:                     # cancelled, or failed by a restart: a prefix of it
                for index, out in r["out"].items():
                    assert out == self.expected(r, index)[0][:len(out)], \
                        f"seed {self.seed}: {rid}[{index}]"

    def expected(self, r: dict, index: int) -> tuple[list[int], str]:
        toks, out = list(r["tokens"]), []
        while True:
            t = self.next_token(r["tenant"], toks, index if not out else 0)
            toks.append(t)
            out.append(t)
            if t in r["eos"]:
                return out, "stop"
            if len(out) == r["max_tokens"] or len(toks) >= self.max_model_len:
                return out, "length"


@pytest.mark.parametrize("restarts", [False, True])
def test_random_interleavings_finish_everything_and_keep_kv_consistent(restarts, monkeypatch):
    """Also: every transition of the sequence state machine is taken, and none that is not
    in its table (``Seq.to`` raises)."""
    monkeypatch.setattr(sequence, "record_transitions", True)
    monkeypatch.setattr(sequence, "taken", set())
    kinds, reasons, forked, capped = Counter(), Counter(), 0, 0
    overlap, spec = Counter(), Counter()
    for seed in range(800):
        cluster = Cluster(seed)
        cluster.run(num_requests=cluster.rng.randint(1, 8), restarts=restarts)
        cluster.check_quiescent()
        kinds.update(k for k, v in cluster.core.preemptions_by_kind.items() if v)
        reasons.update(cluster.core.preemption_reasons)
        forked += any(r["n"] > 1 and r["ends"] for r in cluster.requests.values())
        capped += any(cluster.max_running_seen[t] == cap for t, cap in cluster.caps.items())
        overlap[f"depth{cluster.depth}"] += 1
        overlap["overlapped_plans"] += cluster.overlapped
        overlap["discarded_samples"] += cluster.core.discarded_samples
        overlap["stale_steps"] += cluster.stale_steps
        overlap["stopped_by_eos"] += sum(e == "stop" for r in cluster.requests.values()
                                         for e in r["ends"].values())
        if cluster.spec_on:
            spec["seeds"] += 1
            spec["verifies"] += cluster.verifies
            spec["accepted"] += cluster.accepted
            spec["seeds_verified"] += cluster.verifies > 0
            spec["discarded_samples"] += cluster.core.discarded_samples
            spec[cluster.core.spec.cfg.control] += cluster.verifies
            spec["no_gain"] += cluster.core.spec.stats.reasons["no_gain"]
            spec["stops_in_drafts"] += cluster.stops_in_drafts
        else:
            assert not cluster.verifies
        if cluster.depth == 1:
            assert not cluster.overlapped
    assert kinds["recompute"] > 50 and kinds["swap"] > 50, kinds   # both kinds exercised
    assert forked > 100 and capped > 20, (forked, capped)
    assert reasons["tenant_kv_budget"] > 10 and reasons["urgency"] > 5, reasons
    assert overlap["depth1"] > 300 and overlap["depth2"] > 300, overlap
    assert overlap["overlapped_plans"] > 5000 and overlap["discarded_samples"] > 200, overlap
    assert overlap["stale_steps"] > 100, overlap      # released with a step in flight
    assert overlap["stopped_by_eos"] > 200, overlap
    # speculation drawn on: verifies under both controls, drafts kept, a stop among the
    # accepted drafts (the rest discarded), and steps where no draft paid
    assert spec["seeds_verified"] > 200 and spec["accepted"] > 1500, spec
    assert spec["fixed"] > 500 and spec["scheduler"] > 500 and spec["no_gain"] > 30, spec
    assert spec["stops_in_drafts"] > 10, spec
    print(spec)
    every = {(state, event) for state, moves in sequence.TRANSITIONS.items() for event in moves}
    # the pool refusing a swap-out the core thought would fit, and a refused swap-in being
    # cancelled, are too rare here: test_states.py drives each of them
    rare = {(State.SWAPPING_OUT, sequence.Event.RECOMPUTE),
            (State.SWAP_REFUSED, sequence.Event.FINISH)}
    assert every - sequence.taken <= rare
