"""Fuzz a live engine's bus: start `weir serve`, send hostile frames to every socket a
peer can reach, and check that no process died, nothing hangs and the engine still
generates exactly what it did before.

    scripts/run reliability/fuzz_bus                       # 10,000 frames per socket
    scripts/run reliability/fuzz_bus --messages 300 --seed 7 --sockets client,executor

Sockets (addresses from the run's Topology): the streamer's client ROUTER (a DEALER sends),
every component's PULL inbox and the supervisor's heartbeat PULL (PUSH sends), and a
router's client ROUTER (``router``: a `weir route` started in front of the engine, its one
replica). The two PUB sockets (control, kv_events) take no input from a peer; their unions
are covered by tests/bus/test_fuzz_codec.py. Frames come from ``FrameGen``
(tests/bus/fuzz_frames.py): random bytes, deep nesting, wrong types and well-typed messages
with extreme values.

Every socket first gets frames past its size bound (ZeroMQ's MAXMSGSIZE: for the client
endpoints ``client_frame_limit``, what a legal request can be; for the rest ``[bus]
max_message_mib``, 4 MiB here): one byte past it and the 16 MB prompt of issue 43. The
bound holds if the socket closes the fuzzer's connection at once, before reading a byte
of it (a frame that was read would not do that); the fuzzer then reconnects and goes on.

At each client endpoint, after its frames, an *attach flood* (``--attach-flood N``, issue
43's D1): one keyed request runs to its end, then N Submits under its idempotency key
come from a raw socket as fast as it can send. Each must be answered (its replay, or a
refusal) and every component must stay up with 0 restarts.

Forged but well-typed messages on internal sockets (a StepPlan, a PeerRestarted-like
reset, a KvHello) may legitimately fail in-flight requests. The criteria are: every
component alive with 0 restarts, status answering, and after the fuzz a greedy request
(on a cold and a warm prefix cache) giving the same text as before. Exit code 0 if all
hold; otherwise the failures are printed, with each dead component's traceback from the
serve log and the frames sent just before saved under the run dir.

Over 400 lines on purpose: one tool (frame generators per socket, the senders, the judge and
the command line) that tests/e2e/test_fuzz_bus.py imports whole for its short seeded run.
"""
from __future__ import annotations

import argparse
import collections
import random
import resource
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
import zmq
from zmq.utils.monitor import recv_monitor_message

from bus.codec import Codec, encode
from schemas.client import Submit
from schemas.config import COMPONENTS, WeirConfig
from schemas.frames import client_frame_limit
from schemas.wire import (
    AdmissionMsg,
    ClientMsg,
    DetokenizerMsg,
    ExecutorMsg,
    KvMsg,
    SchedulerMsg,
    StreamerMsg,
    SupervisorMsg,
    TokenizerMsg,
)
from tests.bus.fuzz_frames import FrameGen
from tests.e2e.conftest import free_port
from tests.e2e.engine import Engine
from tests.e2e.router import Router

UNIONS = {"client": ClientMsg, "tokenizer": TokenizerMsg, "admission": AdmissionMsg,
          "scheduler": SchedulerMsg, "kv_manager": KvMsg, "executor": ExecutorMsg,
          "detokenizer": DetokenizerMsg, "streamer": StreamerMsg,
          "supervisor": SupervisorMsg, "router": ClientMsg}
ORDER = ("client", "streamer", "tokenizer", "admission", "detokenizer", "scheduler",
         "kv_manager", "executor", "supervisor", "router")
CLIENT_SOCKETS = ("client", "router")
# the issue's 16 MB prompt with no credentials (D2, D4): a frame no legal request can be
ISSUE_PROMPT = "lorem ipsum dolor sit amet " * 600_000
# long enough for two full KV blocks, so the warm probe reads the prefix cache
PROBE = ("The river rose through the night, and by morning the old stone weir at the edge of "
         "the village held back a lake that reached the church steps. The miller said")
PROBE_TENANTS = tuple(f"probe{i}" for i in range(16))
# forged well-typed messages here can write KV blocks or lease them (StepPlan copies, KvOps):
# a prefix cached before the fuzz may then hold wrong KV. Nothing in a component can tell a
# forged plan from a real one; only authentication (CURVE, ipc permissions) prevents it.
KV_WRITERS = {"executor", "kv_manager", "scheduler"}
CONFIG = """
[engine]
max_model_len = 512
[kv]
num_blocks = 256
num_cpu_blocks = 64
[scheduler]
max_num_batched_tokens = 256
max_num_seqs = 32
[admission]
tenants = [{ name = "default" }, { name = "acme" }, %s]
[supervisor]
max_restarts = 1000
[bus]
max_message_mib = 4
[gateway]
enabled = false
""" % ", ".join(f'{{ name = "{t}" }}' for t in PROBE_TENANTS)  # noqa: UP031 - TOML braces
# `weir route` in front of the engine (the router's own config: the replica's model shape)
ROUTER_CONFIG = """
[engine]
max_model_len = 512
[supervisor]
max_restarts = 1000
"""


@dataclass
class Report:
    sent: dict[str, int] = field(default_factory=dict)
    oversized: dict[str, int] = field(default_factory=dict)     # dropped unread, each
    malformed: dict[str, float] = field(default_factory=dict)
    rejected: dict[str, int] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)
    seconds: dict[str, float] = field(default_factory=dict)
    restarts: int = 0
    notes: list[str] = field(default_factory=list)
    attached: dict[str, int] = field(default_factory=dict)     # attach-flood answers

    def fail(self, msg: str) -> None:
        print(f"FAIL: {msg}", flush=True)
        self.failures.append(msg)


def target(config: WeirConfig, name: str, router: Router | None = None) -> tuple[str, int]:
    t = config.topology
    if name == "client":
        return t.client_connect, zmq.DEALER
    if name == "router":
        assert router is not None
        return router.endpoint, zmq.DEALER
    if name == "supervisor":
        return t.heartbeats(), zmq.PUSH
    return t.inbox(name), zmq.PUSH


def frame_bound(config: WeirConfig, name: str) -> int:
    """The size past which socket ``name`` drops a frame unread (the router's config has
    the engine's max_model_len)."""
    if name in CLIENT_SOCKETS:
        return client_frame_limit(config.engine.max_model_len)
    return config.bus.max_message_bytes


def probe(engine, tenant: str, timeout: float = 60.0) -> str:
    with engine.client() as c:
        r = c.generate(PROBE, max_tokens=12, temperature=0.0, ignore_eos=True, tenant=tenant,
                       timeout=timeout)
    return r.text


def serves(engine, baseline: str, tenant: str, where: str, report: Report,
           within: float = 120.0) -> bool:
    """The engine answers the greedy probe with the baseline text. Forged messages still
    queued in an inbox may fail (or, on a forged KV copy, disturb) the first tries; the
    engine must get there within ``within`` seconds, and stay there."""
    deadline = time.monotonic() + within
    notes = []
    while time.monotonic() < deadline:
        try:
            text = probe(engine, tenant, timeout=max(5.0, deadline - time.monotonic()))
        except Exception as exc:
            notes.append(f"{type(exc).__name__}: {str(exc)[:120]}")
            time.sleep(1.0)
            continue
        if text == baseline:
            if notes:
                print(f"  {where}: serves again after {len(notes)} failed tries "
                      f"(first: {notes[0]})", flush=True)
            return True
        notes.append(f"text {text!r}")
        time.sleep(1.0)
    report.fail(f"{where}: no correct answer within {within:.0f}s: {notes[-3:]}")
    return False


def live_engine(run_dir: Path, config_toml: str, mem_gb: float = 8.0,
                log_level: str = "warning") -> Engine:
    """`weir serve` over ipc in ``run_dir``, every process limited to ``mem_gb`` of address
    space: a forged message that makes a component allocate without bound must fail in
    that process (a crash the fuzz reports), not take the machine's memory."""
    limit = int(mem_gb * 2**30)

    def limit_memory() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))

    return Engine(run_dir, config_toml, log_level=log_level, full_config=True,
                  preexec_fn=limit_memory if mem_gb > 0 else None)


def status(engine, timeout: float) -> dict:
    with engine.client() as c:
        return {x.name: x for x in c.status(timeout=timeout).components}


class Watch:
    """Component liveness across the run: restarts are counted against the last look, so
    one crash is reported once and the sweep goes on (the fuzz config allows many).
    ``names``: the components watched (a router's endpoint lists "router")."""

    def __init__(self, engine, report: Report, names: tuple[str, ...] = COMPONENTS) -> None:
        self.engine, self.report, self.names = engine, report, names
        self.restarts: dict[str, int] = {}
        self.total_restarts = 0

    def check(self, where: str, timeout: float = 10.0) -> bool:
        """Every component alive, ready and not restarted since the last check; status
        answers. (Forged ClusterStatus on the streamer's inbox is overwritten by the
        supervisor's relay every heartbeat interval, hence the short wait.)"""
        for _ in range(5):
            time.sleep(0.3)
            try:
                comps = status(self.engine, timeout)
            except Exception as exc:
                self.report.fail(f"{where}: status did not answer ({type(exc).__name__}: {exc})")
                return False
            if set(self.names) <= set(comps):
                break
            # a forged ClusterStatus (the streamer's inbox takes one from anyone who can
            # reach it) answers until the supervisor's next relay
            print(f"  {where}: status lists {sorted(comps)}; asking again", flush=True)
        bad = {}
        for name in self.names:
            x = comps.get(name)
            if x is None:
                bad[name] = "missing"
                continue
            new = x.restarts - self.restarts.get(name, 0)
            self.restarts[name] = x.restarts
            if new > 0 or not x.alive:
                self.total_restarts += max(new, 0)
                bad[name] = f"alive={x.alive} state={x.state} restarts+{new}"
        if bad:
            self.report.fail(f"{where}: {bad}")
            self.wait_ready()
            return False
        return True

    def wait_ready(self, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                comps = status(self.engine, 2.0)
                if all(comps.get(n) and comps[n].alive and comps[n].state == "ready"
                       for n in self.names):
                    for n in self.names:
                        self.restarts[n] = comps[n].restarts
                    return
            except Exception:
                pass
            time.sleep(0.5)


def crash_log(engine, since: int) -> str:
    """Tracebacks of processes that died (plain text in the serve log) and error lines,
    without the expected noise (malformed frames, failed forged steps)."""
    text = engine.log_path.read_bytes()[since:].decode(errors="replace")
    noise = ("malformed_message", "step_failed", "kv_manager_restarted", "leases_reclaimed")
    keep = [line[:400] for line in text.splitlines()
            if not any(n in line for n in noise) and ('"level": "error"' in line
                                                      or not line.startswith("{"))]
    return "\n".join(keep[-60:])


def dump(engine, name: str, recent, log_mark: int) -> None:
    path = Path(engine.run_dir) / f"fuzz-{name}-{time.time_ns()}.msgpack"
    path.write_bytes(msgspec.msgpack.encode(list(recent)))
    print(f"  the last {len(recent)} frames sent: {path}\n{crash_log(engine, log_mark)}",
          flush=True)


def connection_event(monitor, want: int, timeout_s: float = 10.0) -> bool:
    """Whether the fuzzer's connection reports ``want`` (connected, disconnected) in time."""
    deadline = time.monotonic() + timeout_s
    while (left := deadline - time.monotonic()) > 0:
        if not monitor.poll(int(left * 1000) + 1):
            return False
        if recv_monitor_message(monitor)["event"] == want:
            return True
    return False


def oversized(sock, monitor, name: str, bound: int, report: Report) -> None:
    """Frames past the socket's bound: undecodable bytes one past it, then (at a client
    endpoint) the issue's 16 MB prompt, well-typed, or (elsewhere) four times the bound.
    Each must cost the fuzzer its connection at once: ZeroMQ read the size and closed it,
    never the frame. The fuzzer's socket reconnects before the sweep goes on."""
    frames = [b"\xc1" * (bound + 1),
              encode(Submit("issue-43", ISSUE_PROMPT)) if name in CLIENT_SOCKETS
              else b"\xc1" * (4 * bound)]
    for frame in frames:
        assert len(frame) > bound
        sock.send(frame)
        if not connection_event(monitor, zmq.EVENT_DISCONNECTED):
            report.fail(f"{name}: a frame of {len(frame)} bytes, past its bound of {bound}, "
                        f"was taken (the connection stayed open 10 s)")
            return
        report.oversized[name] = report.oversized.get(name, 0) + 1
        if not connection_event(monitor, zmq.EVENT_CONNECTED):
            report.fail(f"{name}: no reconnection within 10 s after an oversized frame")
            return


def fuzz_socket(engine, config: WeirConfig, name: str, n: int, seed: int, big: int,
                report: Report, watch: Watch, baseline: str, forge: str = "all",
                probe_after: bool = True, router: Router | None = None) -> None:
    """Send ``n`` frames to socket ``name`` (after its oversized ones). ``forge="client"``:
    internal sockets get only frames their codec rejects (no well-typed forgeries), the
    client endpoints everything. ``router``: the `weir route` whose endpoint is
    ``name="router"``; ``watch`` then watches it."""
    address, kind = target(config, name, router)
    server = router if name == "router" else engine      # answers status and the probe
    union = UNIONS[name]
    gen = FrameGen(random.Random(f"{seed}:{name}"), big=big)
    codec = Codec(union)
    only_malformed = forge == "client" and name not in CLIENT_SOCKETS
    ctx = zmq.Context.instance()
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDTIMEO, 30_000)
    sock.setsockopt(zmq.RECONNECT_IVL, 20)
    monitor = sock.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
    sock.connect(address)
    recent: collections.deque[bytes] = collections.deque(maxlen=200)
    log_mark = server.log_path.stat().st_size
    before = status(server, 10.0)
    start = time.monotonic()
    sent = 0
    try:
        if not connection_event(monitor, zmq.EVENT_CONNECTED):
            report.fail(f"{name}: could not connect to {address} within 10 s")
        else:
            oversized(sock, monitor, name, frame_bound(config, name), report)
        if name in CLIENT_SOCKETS:  # the frame from the reliability issue goes first
            sock.send(b"\x91" * 100_000 + b"\xc0")
            sent += 1
        while sent < n:
            frame = gen.frame(union)
            try:
                codec.decode(frame)
                if only_malformed:
                    continue
            except msgspec.DecodeError:
                pass
            recent.append(frame)
            try:
                if gen.r.randrange(100) == 0:
                    sock.send_multipart([frame, gen.bytes_(8)])
                else:
                    sock.send(frame)
            except zmq.Again:
                report.fail(f"{name}: the socket stopped taking frames after {sent} (30 s)")
                break
            sent += 1
            if kind == zmq.DEALER:                   # read (and drop) the server's replies
                while sock.poll(0):
                    sock.recv_multipart()
            if sent % 1000 == 0 and not watch.check(f"{name} after {sent}"):
                dump(server, name, recent, log_mark)
                log_mark = server.log_path.stat().st_size
        report.sent[name] = sent
        report.rejected[name] = codec.malformed
        report.seconds[name] = round(time.monotonic() - start, 1)
        if not watch.check(f"{name} after {sent}"):
            dump(server, name, recent, log_mark)
    finally:
        sock.disable_monitor()
        monitor.close(0)
        sock.close(0)
    if probe_after:      # a fresh tenant: a cold prefix cache, so the answer is computed now
        tenant = PROBE_TENANTS[2 + ORDER.index(name)]
        serves(server, baseline, tenant, f"{name}: after the fuzz", report)
    comp = "streamer" if name == "client" else name
    if comp in watch.names:         # the component's own count (on heartbeats, so it lags)
        deadline = time.monotonic() + 10
        while True:
            after = status(server, 10.0)
            counted = (after[comp].stats.get("malformed", 0)
                       - before[comp].stats.get("malformed", 0))
            if counted >= codec.malformed or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        report.malformed[name] = counted
    print(f"{name:12s} sent {sent:6d} in {report.seconds.get(name, 0):6.1f}s, "
          f"{codec.malformed} of them undecodable; the component counted "
          f"{report.malformed.get(name, '?')} malformed", flush=True)


def attach_flood(server, config: WeirConfig, name: str, n: int, report: Report,
                 watch: Watch, router: Router | None = None) -> None:
    """Issue 43, D1: a finished keyed request, then ``n`` Submits under its key from a raw
    DEALER, sent as fast as it can. Every one must be answered (a replay ending
    ``finished``, or a refusal), and nothing may die or restart."""
    from schemas.client import Finished, Rejected, SamplingParams, ServerMsg

    address, _ = target(config, name, router)
    key = f"flood-{name}"
    with server.client() as c:
        c.generate("Tell me a story:", max_tokens=64, ignore_eos=True, temperature=0.0,
                   idempotency_key=key, tenant="acme")
    sock = zmq.Context.instance().socket(zmq.DEALER)
    for opt in (zmq.LINGER, zmq.SNDHWM, zmq.RCVHWM):
        sock.setsockopt(opt, 0)
    sock.connect(address)
    replies, answered, start = Codec(ServerMsg), 0, time.monotonic()
    try:
        for i in range(n):
            sock.send(encode(Submit(f"attach-{i}", "Tell me a story:", tenant="acme",
                                    params=SamplingParams(max_tokens=64, temperature=0.0,
                                                          ignore_eos=True),
                                    api_key=getattr(server, "service_key", None),
                                    idempotency_key=key)))
        while answered < n and sock.poll(30_000):
            answered += isinstance(replies.decode(sock.recv()).body, (Finished, Rejected))
    finally:
        sock.close(0)
    report.attached[name] = answered
    if answered < n:
        report.fail(f"{name}: {n - answered} of {n} attaching Submits never answered")
    watch.check(f"{name} after an attach flood of {n}")
    print(f"{name:12s} attach flood: {answered} of {n} answered in "
          f"{time.monotonic() - start:.1f}s", flush=True)


def run(messages: int, seed: int, sockets: list[str], run_dir: Path, big: int,
        mem_gb: float = 8.0, log_level: str = "warning", forge: str = "all",
        probe_each: bool = True, attach: int = 0) -> Report:
    report = Report()
    t0 = time.monotonic()
    kv_events = f"tcp://127.0.0.1:{free_port()}"         # the router's view of its cache
    engine = live_engine(run_dir, CONFIG + f'[topology]\nkv_events_endpoint = "{kv_events}"\n',
                         mem_gb, log_level)
    engine.kv_events = kv_events
    router = None
    print(f"engine ready in {time.monotonic() - t0:.1f}s", flush=True)
    try:
        config = msgspec.json.decode((run_dir / "config.json").read_bytes(), type=WeirConfig)
        watch = Watch(engine, report)
        router_watch = None
        if "router" in sockets:
            t0 = time.monotonic()
            router = Router(run_dir / "router", {"engine": engine}, ROUTER_CONFIG)
            router_watch = Watch(router, report, ("router",))
            print(f"router ready in {time.monotonic() - t0:.1f}s", flush=True)
        t0 = time.monotonic()
        baseline = probe(engine, PROBE_TENANTS[0])
        print(f"baseline {baseline!r} in {time.monotonic() - t0:.1f}s", flush=True)
        if not watch.check("before the fuzz") or \
                (router_watch is not None and not router_watch.check("before the fuzz")):
            return report
        for name in sockets:
            fuzz_socket(engine, config, name, messages, seed, big, report,
                        router_watch if name == "router" else watch, baseline, forge,
                        probe_each, router)
            if attach and name in CLIENT_SOCKETS:
                attach_flood(router if name == "router" else engine, config, name, attach,
                             report, router_watch if name == "router" else watch, router)
        # the engine still serves, identically: a cold prefix cache (a fresh tenant), then
        # the prefix cached before the fuzz
        t0 = time.monotonic()
        serves(engine, baseline, PROBE_TENANTS[1], "after the fuzz (cold cache)", report)
        warm = Report()
        serves(engine, baseline, PROBE_TENANTS[0], "after the fuzz (warm cache)", warm, 30.0)
        if warm.failures and forge == "all" and KV_WRITERS & set(sockets):
            print(f"NOTE: the prefix cached before the fuzz now answers wrong: forged "
                  f"messages to {sorted(KV_WRITERS & set(sockets))} wrote or moved its KV "
                  f"(only authentication can prevent this)", flush=True)
            report.notes.append("warm prefix cache poisoned by forged KV writes")
        else:
            report.failures += warm.failures
        watch.check("after the fuzz")
        if router_watch is not None:
            router_watch.check("after the fuzz")
        print(f"final probes and checks in {time.monotonic() - t0:.1f}s", flush=True)
        report.restarts = watch.total_restarts + (router_watch.total_restarts
                                                  if router_watch is not None else 0)
    finally:
        if router is not None:
            router.stop()
        engine.stop()
    return report


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--messages", type=int, default=10_000, help="frames per socket")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sockets", default=",".join(ORDER),
                   help=f"comma-separated, from {','.join(ORDER)}")
    p.add_argument("--big", type=int, default=2_000,
                   help="length of the huge strings and lists in generated messages")
    p.add_argument("--mem-gb", type=float, default=8.0,
                   help="address-space limit of every engine process (0: none)")
    p.add_argument("--forge", choices=["all", "client"], default="all",
                   help="who gets well-typed forged messages: every socket, or only the "
                        "client endpoint (internal sockets then get only undecodable frames)")
    p.add_argument("--attach-flood", type=int, default=10_000,
                   help="Submits under one idempotency key at each client endpoint (0: none)")
    p.add_argument("--run-dir", default=None)
    args = p.parse_args(argv)
    sockets = [s for s in args.sockets.split(",") if s]
    unknown = set(sockets) - set(ORDER)
    if unknown:
        p.error(f"unknown sockets: {sorted(unknown)}")
    run_dir = Path(args.run_dir or tempfile.mkdtemp(prefix="weir-fuzz-"))
    run_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    report = run(args.messages, args.seed, sockets, run_dir, args.big, args.mem_gb,
                 forge=args.forge, attach=args.attach_flood)
    print(f"\n{sum(report.sent.values())} frames to {len(report.sent)} sockets in "
          f"{time.monotonic() - t0:.0f}s (run dir {run_dir}); "
          f"{sum(report.oversized.values())} oversized ones dropped unread")
    if report.failures:
        print(f"{len(report.failures)} failure(s):")
        for f in report.failures:
            print(f"  - {f}")
        return 1
    for note in report.notes:
        print(f"note: {note}")
    print("no process died, nothing hung, the engine serves the same text")
    return 0


if __name__ == "__main__":
    sys.exit(main())
