"""Streams continued on another replica (components/router/migration.py): the router in
process in front of scripted replicas that stream one token per step, each a function of
the whole sequence so far (greedy's contract) or of (seed, output index) (seeded
sampling's), so a continuation that is sent prompt + output with the output offset goes on
exactly as the first placement would have. A replica dies, is delayed (its old events come
late and are dropped: the lease), or drains (long streams move, short ones finish)."""
from __future__ import annotations

import anyio
import pytest
import zmq
import zmq.asyncio

from bus.codec import Codec, encode
from components.router import migration
from components.router.routing import Flight
from components.router.service import RouterService
from schemas.client import (
    Accepted,
    Cancel,
    Cancelled,
    ChoiceEnd,
    ClientMsg,
    ComponentStatus,
    Finished,
    Heartbeat,
    SamplingParams,
    ServerHeartbeat,
    ServerMsg,
    StatusQuery,
    StatusReport,
    StructuredOutput,
    Submit,
    TextDelta,
    Usage,
)
from schemas.config import ReplicaSpec, RouterConfig, Topology, WeirConfig

REPLIES = Codec(ServerMsg)
STEP_S = 0.02


def next_token(seq: list[int], p: SamplingParams, output_index: int) -> int:
    """The scripted model: greedy reads the whole sequence; seeded reads (seed, index)."""
    if p.seed is not None:
        return (p.seed * 31 + output_index * 17) % 997
    return (sum(seq) * 7 + len(seq)) % 997


def solo(prompt: list[int], p: SamplingParams) -> list[int]:
    seq, out = list(prompt), []
    for i in range(p.max_tokens or 0):
        t = next_token(seq, p, p.output_offset + i)
        seq.append(t)
        out.append(t)
    return out


class Scripted:
    """A replica: answers heartbeats (``draining`` as set), streams each request a token
    per ``STEP_S``; ``dead`` drops everything; ``hold`` keeps what it sends until
    ``release``."""

    def __init__(self, address: str) -> None:
        self.address = address
        self.dead = self.hold = self.draining = False
        self.held: list[tuple[bytes, object]] = []
        self.submits: list[Submit] = []
        self.cancels: list[str] = []
        self.streams: dict[str, anyio.CancelScope] = {}

    async def send(self, who: bytes, m: object) -> None:
        if self.dead:
            return
        if self.hold:
            self.held.append((who, m))
            return
        await self.sock.send_multipart([who, encode(m)])

    async def release(self) -> None:
        self.hold = False
        for who, m in self.held:
            await self.sock.send_multipart([who, encode(m)])
        self.held.clear()

    async def stream(self, who: bytes, sub: Submit) -> None:
        rid, p = sub.request_id, sub.params
        with anyio.CancelScope() as scope:
            self.streams[rid] = scope
            seq = list(sub.prompt_token_ids or ())
            await self.send(who, Accepted(rid, len(seq)))
            for i in range(p.max_tokens or 0):
                await anyio.sleep(STEP_S)
                t = next_token(seq, p, p.output_offset + i)
                seq.append(t)
                await self.send(who, TextDelta(rid, f"<{t}>", (t,)))
            await self.send(who, Finished(rid, "length", Usage(len(sub.prompt_token_ids or ()),
                                                               p.max_tokens or 0)))

    async def run(self, ctx: zmq.asyncio.Context) -> None:
        self.sock = sock = ctx.socket(zmq.ROUTER)
        sock.linger = 0
        sock.bind(self.address)
        codec = Codec(ClientMsg)
        try:
            async with anyio.create_task_group() as tg:
                while True:
                    who, data = await sock.recv_multipart()
                    match codec.decode(data).body:
                        case Heartbeat():
                            await self.send(who, ServerHeartbeat(7, self.draining))
                        case StatusQuery(query_id=q):
                            await self.send(who, StatusReport(q, (ComponentStatus(
                                "scheduler", 1, True, "ready", 0, 0.0,
                                {"last_step_ms": STEP_S * 1e3}),)))
                        case Submit() as sub:
                            self.submits.append(sub)
                            tg.start_soon(self.stream, who, sub)
                        case Cancel(request_id=rid):
                            self.cancels.append(rid)
                            if (scope := self.streams.pop(rid, None)) is not None:
                                scope.cancel()
                            await self.send(who, Cancelled(rid, "cancelled"))
        finally:
            sock.close(0)


async def fleet(tmp_path, names, body):
    """The router in front of scripted replicas ``names``; ``body(svc, reps, client)``."""
    ctx = zmq.asyncio.Context()
    reps = {n: Scripted(f"ipc://{tmp_path}/{n}.sock") for n in names}
    svc = RouterService(WeirConfig(
        Topology(run_dir=str(tmp_path), client_endpoint=f"ipc://{tmp_path}/client.sock"),
        router=RouterConfig(replicas=tuple(ReplicaSpec(n, r.address) for n, r in reps.items()),
                            heartbeat_interval_s=0.05, heartbeat_timeout_s=0.4,
                            load_interval_s=0.05, policy="least_loaded")))
    await svc.setup()
    client = ctx.socket(zmq.DEALER)
    client.linger = 0
    client.connect(svc.topology.client_endpoint)
    try:
        async with anyio.create_task_group() as tg:
            for r in reps.values():
                tg.start_soon(r.run, ctx)
            tg.start_soon(svc.run)
            with anyio.fail_after(10):
                while not all(r.healthy and r.report for r in svc.members):
                    await anyio.sleep(0.02)
            await body(svc, reps, client)
            tg.cancel_scope.cancel()
    finally:
        svc.close()
        client.close(0)
        ctx.term()


async def collect(client, rids: set[str], timeout: float = 20.0) -> dict[str, list]:
    """Every event for ``rids`` until each has its terminal."""
    got: dict[str, list] = {rid: [] for rid in rids}
    open_ = set(rids)
    with anyio.fail_after(timeout):
        while open_:
            m = REPLIES.decode(await client.recv()).body
            got[m.request_id].append(m)
            if isinstance(m, Finished | Cancelled) or type(m).__name__ in ("Failed", "Rejected"):
                open_.discard(m.request_id)
    return got


def check_exact(events: list, prompt: list[int], p: SamplingParams) -> None:
    """One Accepted, the solo output token for token, one Finished counting all of it."""
    kinds = [type(e).__name__ for e in events]
    assert kinds[0] == "Accepted" and kinds.count("Accepted") == 1, kinds
    tokens = [t for e in events if isinstance(e, TextDelta) for t in e.token_ids]
    assert tokens == solo(prompt, p)
    end = events[-1]
    assert isinstance(end, Finished), end
    assert end.usage.completion_tokens == p.max_tokens
    assert end.usage.prompt_tokens == len(prompt)


async def wait_until(cond, timeout: float = 10.0) -> None:
    with anyio.fail_after(timeout):
        while not cond():
            await anyio.sleep(0.01)


PROMPT = [11, 12, 13, 14, 15]


@pytest.mark.anyio
@pytest.mark.parametrize("seed", [None, 1234])
async def test_a_dead_replica_s_streams_continue_on_another_exactly(tmp_path, seed):
    async def body(svc, reps, client):
        p = SamplingParams(max_tokens=30, temperature=0.0 if seed is None else 1.0, seed=seed)
        rids = {f"r{i}" for i in range(4)}
        for rid in sorted(rids):
            await client.send(encode(Submit(rid, prompt_token_ids=PROMPT, params=p)))
        await wait_until(lambda: all(len(f.out_ids) >= 3 for f in svc.flights.values())
                         and len(svc.flights) == 4)
        victim = next(n for n, r in svc.members.replicas.items() if r.open)
        moved = len(svc.members[victim].open)
        reps[victim].dead = True
        got = await collect(client, rids)
        for rid in rids:
            check_exact(got[rid], PROMPT, p)
        assert svc.counts["migrated.replica_lost"] == moved >= 1
        (other,) = set(reps) - {victim}
        conts = [s for s in reps[other].submits if "~" in s.request_id]
        assert len(conts) == moved
        for s in conts:          # prompt + output so far; caps and seed index moved by it
            k = s.params.output_offset
            assert k >= 3 and s.prompt_token_ids[:len(PROMPT)] == PROMPT
            assert len(s.prompt_token_ids) == len(PROMPT) + k
            assert s.params.max_tokens == 30 - k and s.idempotency_key is None
        assert not svc.flights and not svc.wires
        assert svc.stats()["migration.handover_ms.p50"] > 0

    await fleet(tmp_path, ("a", "b"), body)


@pytest.mark.anyio
async def test_late_events_from_an_old_placement_are_dropped(tmp_path):
    """The lease: ``a`` is delayed (everything it sends is held) until the router loses it
    and its streams continue on ``b``; then ``a``'s held events (tokens, its Finished,
    under the old id) arrive and not one reaches the client."""
    async def body(svc, reps, client):
        p = SamplingParams(max_tokens=25, temperature=0.0)
        await client.send(encode(Submit("x", prompt_token_ids=PROMPT, params=p)))
        await wait_until(lambda: "x" in svc.flights and len(svc.flights["x"].out_ids) >= 4)
        a = svc.flights["x"].replica
        (b,) = set(reps) - {a}
        reps[a].hold = True                   # a keeps streaming; nothing it sends arrives
        await wait_until(lambda: svc.flights.get("x") is not None
                         and svc.flights["x"].replica == b
                         and len(svc.flights["x"].out_ids) >= 8)
        await wait_until(lambda: len(reps[a].held) >= 10)
        await reps[a].release()               # a's late tokens, its own Finished
        got = await collect(client, {"x"})
        check_exact(got["x"], PROMPT, p)
        await wait_until(lambda: svc.members[a].healthy)
        assert svc.members[a].counts["late_events"] >= 10
        assert svc.flights == {} and svc.counts["migrated"] == 1

    await fleet(tmp_path, ("a", "b"), body)


@pytest.mark.anyio
async def test_a_draining_replica_hands_long_streams_over_and_finishes_short_ones(tmp_path):
    async def body(svc, reps, client):
        long_p = SamplingParams(max_tokens=60, temperature=0.0)
        short_p = SamplingParams(max_tokens=6, temperature=0.0)
        await client.send(encode(Submit("long", prompt_token_ids=PROMPT, params=long_p)))
        await client.send(encode(Submit("short", prompt_token_ids=PROMPT[:3], params=short_p)))
        await wait_until(lambda: all(len(f.out_ids) >= 3 for f in svc.flights.values())
                         and len(svc.flights) == 2)
        for f in svc.flights.values():
            reps[f.replica].draining = True
        got = await collect(client, {"long", "short"})
        check_exact(got["long"], PROMPT, long_p)
        check_exact(got["short"], PROMPT[:3], short_p)
        assert svc.counts["migrated.cheaper_to_move"] >= 1
        assert "short" not in {s.request_id.partition("~")[0] for r in reps.values()
                               for s in r.submits if "~" in s.request_id}
        assert any(c == "long" for r in reps.values() for c in r.cancels)

    await fleet(tmp_path, ("a", "b", "c"), body)


def test_the_continuation_and_the_drain_choice():
    f = Flight(b"", Submit("q", prompt="hi", params=SamplingParams(
        max_tokens=10, min_tokens=6, seed=5), deadline_ms=100, e2e_deadline_ms=5000,
        idempotency_key="k"), "default", 0.0, 2, prompt_ids=[1, 2], out_ids=[7, 8, 9],
        wire_id="q~n.1")
    s = migration.continuation(f, 1.0)
    assert s.request_id == "q~n.1" and s.prompt is None and s.prompt_token_ids == [1, 2, 7, 8, 9]
    assert (s.params.max_tokens, s.params.min_tokens, s.params.output_offset) == (7, 3, 3)
    assert s.deadline_ms is None and s.e2e_deadline_ms == 4000 and s.idempotency_key is None
    assert migration.resumable(f) is None
    # 100 tokens left at 20 ms: 2 s in place; moving 1,000 tokens at 10k tok/s: 0.15 s
    assert migration.drain_choice(100, 0.02, 30.0, 1000, 1e4) == (True, "cheaper_to_move")
    assert migration.drain_choice(3, 0.02, 30.0, 1000, 1e4) == (False, "finishes_in_place")
    assert migration.drain_choice(100, 0.02, 1.0, 10**6, 1e4) == (True, "past_drain_deadline")


def test_every_kind_but_n_after_output_continues_and_keeps_its_own_counts():
    """Stop strings, penalties, structured output and prompt logprobs continue (the
    replica reads the carried output as output); prompt logprobs are asked again only
    before any output; n > 1 continues only before its first output, and then its
    terminal's per-choice counts are the continuation's own."""
    def flight(out_ids, **kw):
        return Flight(b"", Submit("q", prompt="hi", params=SamplingParams(max_tokens=10,
                                                                          **kw)),
                      "default", 0.0, 2, prompt_ids=[1, 2], out_ids=out_ids, wire_id="q~n.1")
    kinds = [dict(stop=("x",)), dict(presence_penalty=0.5, frequency_penalty=0.2),
             dict(structured=StructuredOutput(regex="[a-z]+")), dict(prompt_logprobs=2)]
    for kw in kinds:
        for out in ([], [7, 8]):
            f = flight(out, **kw)
            assert migration.resumable(f) is None, kw
            s = migration.continuation(f, 0.0)
            assert s.params.output_offset == len(out) and s.prompt_token_ids == [1, 2] + out
            assert s.params.stop == f.submit.params.stop
            assert s.params.structured == f.submit.params.structured
            assert s.params.presence_penalty == f.submit.params.presence_penalty
            assert s.params.prompt_logprobs == (None if out else kw.get("prompt_logprobs"))
    assert migration.resumable(flight([7], n=2)) == "n > 1 with output relayed"
    f = flight([], n=2, seed=3)
    assert migration.resumable(f) is None
    s = migration.continuation(f, 0.0)
    assert (s.params.n, s.params.seed, s.params.output_offset) == (2, 3, 0)
    f.out_ids = [4, 5, 6, 7, 8]                  # relayed from the continuation: 3 and 2
    end = Finished("q~n.1", "length", Usage(2, 5, 1), choices=(
        ChoiceEnd(0, "length", 3), ChoiceEnd(1, "stop", 2)))
    got = migration.relabel(f, end)
    assert got.request_id == "q" and got.usage == Usage(2, 5, 1)
    assert got.choices == end.choices
    one = flight([7, 8, 9], stop=("x",))
    got = migration.relabel(one, Finished("q~n.1", "stop", Usage(5, 1, 4),
                                          choices=(ChoiceEnd(0, "stop", 1),)))
    assert got.usage == Usage(2, 3, 2) and got.choices == (ChoiceEnd(0, "stop", 3),)
