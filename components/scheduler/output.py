"""The core's output stage: sampled tokens become detokenizer output, n > 1 requests fork
after their first sample, stop conditions end a choice, and a request is released when its
last choice ends. Every end of a choice goes through ``finish`` (a stop, a cancel, the
end-to-end deadline, a reset), which takes it out of the queues and gives its lease back
through the lease book. Owns only the count of discarded samples; what it produced for one
input is returned as an ``Outcome``."""
from __future__ import annotations

from dataclasses import dataclass, field
from itertools import repeat
from typing import Literal

from components.scheduler.kv_requests import LeaseBook
from components.scheduler.queues import Queues
from components.scheduler.sequence import Event, Seq, State, in_running
from components.scheduler.speculation import Speculation
from schemas.wire import (
    DetokParams,
    PromptChunkLogprobs,
    RequestTiming,
    SampleLogprobs,
    StepResult,
    TokenOut,
    Usage,
    carried_tail,
)


@dataclass
class Outcome:
    """What one input produced: detokenizer output, released requests, forgotten requests."""

    tokens: list[TokenOut] = field(default_factory=list)
    released: list[str] = field(default_factory=list)
    forget: list[str] = field(default_factory=list)


class OutputStage:
    def __init__(self, queues: Queues, leases: LeaseBook, max_model_len: int,
                 spec: Speculation | None = None) -> None:
        self.queues = queues
        self.spec = spec
        self.leases = leases
        self.max_model_len = max_model_len
        self.discarded_samples = 0   # sampled for a sequence that ended (or was preempted)
                                     # while the step ran: the price of planning ahead

    def on_result(self, result: StepResult, planned: dict[int, int],
                  now_ns: int = 0) -> Outcome:
        """The oldest step in flight answered; ``planned`` is what it computes per seq id.
        Sequences still in it advance and take their samples; a sequence that ended or was
        preempted since the step was planned has left it (``Seq.in_flight`` cleared), and
        its sample is discarded: not emitted, not charged."""
        out = Outcome()
        step_id = result.step_id
        by_seq = self.queues.by_seq
        live: set[int] = set()
        # a speculating row computed its accepted drafts too (their KV is kept; a rejected
        # one's positions are past num_computed, overwritten by the next step)
        verifies = {sid: (d, a) for sid, d, a in result.drafts}
        for seq_id, n in planned.items():
            seq = by_seq.get(seq_id)
            if (seq is not None and seq.in_flight and seq.in_flight[0].step_id == step_id
                    and in_running(seq)):
                flight = seq.in_flight.popleft()
                seq.num_computed += n
                if seq_id in verifies and flight.drafts:
                    drafted, accepted = verifies[seq_id]
                    accepted = min(accepted, drafted, flight.drafts)
                    seq.num_computed += accepted
                    if self.spec is not None:
                        self.spec.verified(seq, drafted, accepted)
                live.add(seq_id)
        sampled: dict[int, list[tuple[int, SampleLogprobs | None]]] = {}
        # beside the tokens one for one, or not at all (a list of another length, which only
        # a corrupt message could carry, must not cut the tokens short in the zip below)
        lps = result.logprobs if len(result.logprobs) == len(result.token_ids) else repeat(None)
        for seq_id, token, lp in zip(result.seq_ids, result.token_ids, lps):
            if seq_id in live:
                sampled.setdefault(seq_id, []).append((token, lp))
            else:
                self.discarded_samples += 1
        for chunk in result.prompt_logprobs:
            if chunk.seq_id in live:
                self._take_prompt_logprobs(by_seq[chunk.seq_id], chunk)
        for seq_id, tokens in sampled.items():
            seq = by_seq[seq_id]
            forking = seq.n > 1 and not seq.forked
            if forking:                       # every choice's first token is charged here
                self.queues.tenants.charge(seq.tenant, now_ns, output_tokens=len(tokens))
                seq.forked = True
                for index, (token, lp) in enumerate(tokens[1:seq.n], start=1):
                    self._fork(seq, index, token, lp, now_ns, out)
            if seq_id not in verifies:
                tokens = tokens[:1]
            # a verify's tokens in order (its accepted drafts, then the target's own): a
            # stop among them ends the choice, and the rest are discarded, not charged
            emitted = 0
            for token, lp in tokens:
                if seq.ended:
                    self.discarded_samples += 1
                    continue
                seq.token_ids.append(token)
                emitted += 1
                self._emit_token(seq, token, lp, now_ns, out)
            if not forking:
                self.queues.tenants.charge(seq.tenant, now_ns, output_tokens=emitted)
        return out

    @staticmethod
    def _take_prompt_logprobs(seq: Seq, chunk: PromptChunkLogprobs) -> None:
        """Append the entries past those taken (a chunk computed again after preemption
        repeats positions); a chunk that would leave a gap is dropped (only a corrupt
        message could carry one), and so the prompt's entries come out incomplete."""
        if seq.prompt_lps is None:
            return
        have = len(seq.prompt_lps) + 1             # the next position owed
        if chunk.start <= have:
            seq.prompt_lps.extend(chunk.logprobs[have - chunk.start:])

    def _fork(self, parent: Seq, index: int, token: int,
              lp: SampleLogprobs | None, now_ns: int, out: Outcome) -> None:
        """Choice ``index`` of an n > 1 request: the parent's computed prompt plus its own
        first token, sharing the parent's blocks once the kv_manager grants the fork."""
        child = Seq(self.queues.next_id(), parent.header, parent.prompt_len,
                    parent.token_ids + [token], parent.block_hashes, parent.eos_token_ids,
                    state=State.FORKING,
                    num_computed=parent.num_computed, cached_tokens=parent.cached_tokens,
                    first_scheduled_ns=parent.first_scheduled_ns,
                    ingress_ns=parent.ingress_ns, index=index, aging_per_s=parent.aging_per_s,
                    public_scope=parent.public_scope, public_blocks=parent.public_blocks,
                    forked=True, group=parent.group)
        parent.group.append(child)
        self.queues.join(child)
        self.leases.fork(parent, child)
        self._emit_token(child, token, lp, now_ns, out)

    def _emit_token(self, seq: Seq, token: int, lp: SampleLogprobs | None,
                    now_ns: int, out: Outcome) -> None:
        reason = self._stop_reason(seq, token)
        first = seq.outputs_sent == 0
        if first:
            seq.first_token_ns = now_ns
        seq.outputs_sent += 1
        p = seq.params
        carried = min(p.output_offset, seq.prompt_len, carried_tail(p.stop))
        params = (DetokParams(p.stop, p.skip_special_tokens, seq.prompt_len, seq.cached_tokens,
                              max(seq.first_scheduled_ns - seq.arrival_ns, 0) / 1e9, None, p.n,
                              p.min_tokens,
                              tuple(seq.token_ids[seq.prompt_len - carried:seq.prompt_len]))
                  if first else None)
        prompt, owner = None, seq.group[0] if seq.group else seq   # choice 0 computed them
        if owner.prompt_lps is not None:
            # on the request's first token (a fork's comes before choice 0's); whole or not
            # at all: entries that do not line up with the prompt would name the wrong tokens
            if len(owner.prompt_lps) == seq.prompt_len - 1:
                prompt = (seq.token_ids[:seq.prompt_len], owner.prompt_lps)
            owner.prompt_lps = None
        if reason is None:
            out.tokens.append(TokenOut(seq.request_id, [token], params, index=seq.index,
                                       logprobs=None if lp is None else [lp], prompt=prompt))
            return
        usage, timing = _ending(seq, now_ns)
        out.tokens.append(TokenOut(seq.request_id, [token], params, reason, usage, timing,
                                   seq.index, None if lp is None else [lp], prompt))
        self.finish(seq, out)

    def end_at_deadline(self, request_id: str, now_ns: int) -> Outcome:
        """End a request that has streamed tokens at its end-to-end deadline: each choice
        still open finishes ``deadline`` with no new token, its usage and timing as a
        ``length`` finish carries them, and its lease is freed at once (a sample still in
        flight for it is discarded)."""
        seq = self.queues.by_request.get(request_id)
        out = Outcome()
        for s in list(seq.group) if seq is not None else ():
            if not s.ended:
                usage, timing = _ending(s, now_ns)
                out.tokens.append(TokenOut(s.request_id, [], None, "deadline", usage, timing,
                                           s.index))
                self.finish(s, out)
        return out

    def cancel(self, request_id: str) -> Outcome:
        """Cancel a request (every choice) wherever it is; its blocks go back at once."""
        seq = self.queues.by_request.get(request_id)
        out = Outcome()
        if seq is None:
            return out
        if any(s.outputs_sent for s in seq.group):
            out.forget.append(request_id)
        for s in list(seq.group):
            if not s.ended:
                self.finish(s, out)
        return out

    def stop(self, request_id: str, index: int = 0) -> Outcome:
        """A stop string ended choice ``index`` (the detokenizer already closed it)."""
        seq = self.queues.by_request.get(request_id)
        out = Outcome()
        if seq is None:
            return out
        if seq.n == 1:
            return self.cancel(request_id)
        for s in seq.group:
            if s.index == index and not s.ended:
                self.finish(s, out)
        return out

    def _stop_reason(self, seq: Seq, token: int) -> Literal["stop", "length"] | None:
        p = seq.params
        # ``token`` is counted in num_output: min_tokens tokens come before a stop token
        # (the executor bans them until then; this holds if a sampler did not)
        if ((token in seq.eos_token_ids and not p.ignore_eos) or token in p.stop_token_ids) \
                and seq.num_output > p.min_tokens:
            return "stop"
        if ((p.max_tokens is not None and seq.num_output >= p.max_tokens)
                or seq.num_tokens >= self.max_model_len):
            return "length"
        return None

    def finish(self, seq: Seq, out: Outcome, free: bool = True) -> None:
        """End one choice; the request is released when its last choice ends. Its lease is
        freed at once (``free`` false: the pool is gone), steps in flight or not: what they
        compute for it is discarded (``kv_requests.py`` says why the free is safe). A grant
        still in flight is freed when it arrives (``CLOSING``)."""
        self.queues.leave(seq)
        seq.in_flight.clear()
        if free and (seq.holds_lease or seq.block_ids):
            self.leases.free_lease(seq.seq_id, seq.num_computed, seq.tenant)
        if seq.known_to_executor:
            self.leases.drop(seq.seq_id)
        if seq.to(Event.FINISH) is State.DONE:
            self.queues.forget(seq.seq_id)
        if all(s.ended for s in seq.group):
            self.queues.release(seq.request_id)
            out.released.append(seq.request_id)


def _ending(seq: Seq, now_ns: int) -> tuple[Usage, RequestTiming]:
    """A choice's usage and timing as its last output carries them."""
    queue_ns = max(seq.first_scheduled_ns - seq.arrival_ns, 0)
    return (Usage(seq.prompt_len, seq.num_output, seq.cached_tokens),
            RequestTiming(queue_ns / 1e9,
                          max(seq.first_token_ns - seq.first_scheduled_ns, 0) / 1e9,
                          max(now_ns - seq.first_token_ns, 0) / 1e9,
                          sum(s.preemptions for s in seq.group),
                          min(seq.ingress_ns, queue_ns) / 1e9))
