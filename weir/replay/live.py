"""``weir replay``: send a trace to a live server on the trace's own clock. (Past 400
lines: both targets and both loops write the one record each request gets.)

Open loop by default: each request goes out at its (scaled) arrival time, whether or not
earlier ones have finished. With ``closed_loop``, the turns of one session go in order, each
after the previous answer ends (and not before its own arrival time). Two targets:

- ``SdkTarget``: Weir's ZeroMQ endpoint through the SDK; prompts go as token ids (exact
  counts) and every event (accepted, each token, finished with timing) is recorded.
- ``HttpTarget``: any OpenAI-compatible ``/v1/completions`` (Weir's gateway, vLLM, ...);
  prompts go as text that the synthesizer guarantees tokenizes back to the same ids.

Every request carries a W3C ``traceparent`` with a fresh trace id, written to its record,
so a request in the report can be found in Jaeger. Schedule lag (actual send − scheduled
send) is measured for every request; a run whose p99 lag exceeds ``max_lag_ms`` is marked
invalid, since its load was not the trace's.
"""
from __future__ import annotations

import random
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from contextlib import nullcontext
from typing import Protocol

import anyio
import msgspec

from weir.replay.types import (
    CANCELLED,
    COMPLETED,
    FAILED,
    REJECTED,
    RequestRecord,
    RunResult,
    Scaling,
    TimelinePoint,
    TraceRequest,
)

_REJECT_STATUS = {429, 503, 403, 400, 413, 401}


class Sent(msgspec.Struct, kw_only=True):
    """What a target needs for one request."""

    request: TraceRequest
    request_id: str
    token_ids: list[int]
    text: str
    max_tokens: int
    traceparent: str


class Target(Protocol):
    label: str

    async def __aenter__(self) -> Target: ...
    async def __aexit__(self, *exc) -> None: ...
    async def send(self, item: Sent, rec: RequestRecord, t0: float) -> None: ...
    async def sample(self, t: float) -> TimelinePoint | None: ...


def _clock(t0: float) -> float:
    return time.perf_counter() - t0


class SdkTarget:
    """Weir's SDK endpoint. ``api_key`` acts for the trace's tenants (an operator's or the
    service key); a trace row's own ``api_key`` is used as is."""

    def __init__(self, endpoint: str, api_key: str | None = None) -> None:
        self.endpoint, self.api_key = endpoint, api_key
        self.label = endpoint
        self._clients: dict[str | None, object] = {}

    async def __aenter__(self) -> SdkTarget:
        await self._client(self.api_key)
        return self

    async def _client(self, key: str | None):
        from weir.client import AsyncClient

        if key not in self._clients:
            c = AsyncClient(self.endpoint, api_key=key, max_retries=0,
                            stream_buffer=1 << 16)
            await c.__aenter__()
            self._clients[key] = c
        return self._clients[key]

    async def __aexit__(self, *exc) -> None:
        for c in self._clients.values():
            await c.__aexit__(None, None, None)

    async def send(self, item: Sent, rec: RequestRecord, t0: float) -> None:
        from weir.errors import RequestCancelled, RequestRejected, WeirError

        req = item.request
        client = await self._client(req.api_key or self.api_key)
        last = None
        try:
            stream = await client.stream(
                prompt_token_ids=item.token_ids, request_id=item.request_id,
                tenant=req.tenant, deadline_ms=req.deadline_ms, traceparent=item.traceparent,
                session_id=req.session_id, max_tokens=item.max_tokens, ignore_eos=True,
                temperature=0.0, n=req.n)
            async for delta in _with_cancel(stream, req.cancel_after_s):
                if delta.index:
                    continue
                now = _clock(t0)
                if last is None:
                    rec.ttft_s = now - rec.sent_s
                else:
                    rec.itl_s.append(now - last)
                rec.itl_s.extend([0.0] * (len(delta.token_ids) - 1))
                last = now
            result = stream.result
            rec.e2e_s = _clock(t0) - rec.sent_s
            if result.finish_reason == "cancelled":
                rec.terminal = CANCELLED
            rec.finish_reason = result.finish_reason
            rec.prompt_tokens = result.usage.prompt_tokens
            rec.output_tokens = result.usage.completion_tokens
            rec.cached_tokens = result.usage.cached_tokens
            rec.queue_s = result.queue_time_s
            if result.timing is not None:
                rec.preemptions = result.timing.preemptions
                rec.prefill_s = result.timing.prefill_s
                rec.ingress_s = result.timing.ingress_s
        except RequestRejected as exc:
            rec.decision, rec.reason, rec.terminal = "reject", exc.reason, REJECTED
            rec.e2e_s = _clock(t0) - rec.sent_s
        except RequestCancelled as exc:
            rec.terminal, rec.reason = CANCELLED, str(exc)
            rec.e2e_s = _clock(t0) - rec.sent_s
        except WeirError as exc:
            rec.terminal, rec.reason = FAILED, f"{type(exc).__name__}: {exc}"[:200]
            rec.e2e_s = _clock(t0) - rec.sent_s

    async def sample(self, t: float) -> TimelinePoint | None:
        client = await self._client(self.api_key)
        try:
            report = await client.status(timeout=2.0)
        except Exception:                       # noqa: BLE001 - a missed sample is no error
            return None
        stats = {c.name: c.stats for c in report.components}
        sched, kv = stats.get("scheduler", {}), stats.get("kv_manager", {})
        total = int(kv.get("total_blocks", 0))
        return TimelinePoint(t, int(sched.get("running", 0)), int(sched.get("waiting", 0)),
                             total - int(kv.get("free_blocks", total)), total)

    async def engine_counts(self) -> dict[str, float]:
        client = await self._client(self.api_key)
        report = await client.status(timeout=5.0)
        return {f"{c.name}.{k}": v for c in report.components for k, v in c.stats.items()}


async def _with_cancel(stream, cancel_after_s: float | None):
    """The stream's deltas; past ``cancel_after_s`` the request is cancelled (and the
    stream ends with finish_reason "cancelled")."""
    if cancel_after_s is None:
        async for delta in stream:
            yield delta
        return
    deadline = time.monotonic() + cancel_after_s
    it = stream.__aiter__()
    while True:
        with anyio.move_on_after(max(deadline - time.monotonic(), 0)) as scope:
            try:
                delta = await it.__anext__()
            except StopAsyncIteration:
                return
        if scope.cancelled_caught:
            await stream.cancel()
            async for _ in it:
                pass
            return
        yield delta


class HttpTarget:
    """An OpenAI-compatible server's ``/v1/completions``, streamed (SSE)."""

    def __init__(self, base_url: str, model: str = "", api_key: str | None = None) -> None:
        self.base_url = base_url.rstrip("/")
        if not self.base_url.endswith("/v1"):
            self.base_url += "/v1"
        self.model, self.api_key = model, api_key
        self.label = base_url
        self.reports_cached = False          # does the server say how much prompt was cached?

    async def __aenter__(self) -> HttpTarget:
        import httpx

        self.http = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=10.0),
                                      limits=httpx.Limits(max_connections=4096,
                                                          max_keepalive_connections=256))
        if not self.model:
            r = await self.http.get(f"{self.base_url}/models", headers=self._headers(None))
            r.raise_for_status()
            self.model = r.json()["data"][0]["id"]
        return self

    async def __aexit__(self, *exc) -> None:
        await self.http.aclose()

    def _headers(self, item: Sent | None) -> dict[str, str]:
        h = {}
        key = (item.request.api_key if item else None) or self.api_key
        if key:
            h["Authorization"] = f"Bearer {key}"
        if item is not None:
            h["traceparent"] = item.traceparent
            if item.request.session_id is not None:
                h["X-Session-Id"] = item.request.session_id
        return h

    async def send(self, item: Sent, rec: RequestRecord, t0: float) -> None:
        req = item.request
        body = {"model": self.model, "prompt": item.text, "max_tokens": item.max_tokens,
                "temperature": 0.0, "ignore_eos": True, "stream": True, "n": req.n,
                "stream_options": {"include_usage": True}}
        last = None
        try:
            with anyio.fail_after(req.cancel_after_s) if req.cancel_after_s else nullcontext():
                async with self.http.stream("POST", f"{self.base_url}/completions", json=body,
                                            headers=self._headers(item)) as r:
                    if r.status_code != 200:
                        text = (await r.aread()).decode(errors="replace")
                        code = _error_code(text) or f"http_{r.status_code}"
                        rec.e2e_s = _clock(t0) - rec.sent_s
                        if r.status_code in _REJECT_STATUS:
                            rec.decision, rec.reason, rec.terminal = "reject", code, REJECTED
                        else:
                            rec.terminal, rec.reason = FAILED, code
                        return
                    async for line in r.aiter_lines():
                        if not line.startswith("data: ") or line == "data: [DONE]":
                            continue
                        chunk = msgspec.json.decode(line[6:])
                        if chunk.get("error"):
                            rec.terminal, rec.reason = FAILED, str(chunk["error"])[:200]
                            continue
                        for choice in chunk.get("choices") or ():
                            if choice.get("index", 0) != 0:
                                continue
                            if choice.get("text"):
                                now = _clock(t0)
                                if last is None:
                                    rec.ttft_s = now - rec.sent_s
                                else:
                                    rec.itl_s.append(now - last)
                                last = now
                            if choice.get("finish_reason"):
                                rec.finish_reason = choice["finish_reason"]
                        if usage := chunk.get("usage"):
                            rec.prompt_tokens = usage.get("prompt_tokens", 0)
                            rec.output_tokens = usage.get("completion_tokens", 0)
                            details = usage.get("prompt_tokens_details")
                            if details and details.get("cached_tokens") is not None:
                                rec.cached_tokens = details["cached_tokens"]
                                self.reports_cached = True
        except TimeoutError:
            rec.terminal, rec.reason = CANCELLED, "cancel_after"
        except Exception as exc:                # noqa: BLE001 - any transport failure
            rec.terminal, rec.reason = FAILED, f"{type(exc).__name__}: {exc}"[:200]
        rec.e2e_s = _clock(t0) - rec.sent_s
        if rec.terminal == COMPLETED and not rec.output_tokens:
            rec.output_tokens = 1 + len(rec.itl_s) if rec.ttft_s is not None else 0

    async def sample(self, t: float) -> TimelinePoint | None:
        """The server's own gauges from its Prometheus ``/metrics`` (vLLM's ``vllm:`` and
        Weir's ``weir:`` names agree): running, waiting, KV cache usage (as per mille)."""
        try:
            r = await self.http.get(self.base_url[:-3] + "/metrics", headers=self._headers(None),
                                    timeout=2.0)
        except Exception:                       # noqa: BLE001 - a missed sample is no error
            return None
        if r.status_code != 200:
            return None
        m = prometheus_gauges(r.text)
        if "num_requests_running" not in m:
            return None
        usage = m.get("kv_cache_usage_perc", m.get("gpu_cache_usage_perc", 0.0))
        return TimelinePoint(t, int(m["num_requests_running"]),
                             int(m.get("num_requests_waiting", 0)), round(usage * 1000), 1000)


def prometheus_gauges(text: str) -> dict[str, float]:
    """Metric name (after its ``prefix:``) → value summed over label sets."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        name, _, rest = line.partition("{") if "{" in line.split(" ", 1)[0] else \
            line.partition(" ")
        value = rest.rsplit(" ", 1)[-1] if rest else ""
        try:
            number = float(value)
        except ValueError:
            continue
        name = name.split(":", 1)[-1].strip()
        out[name] = out.get(name, 0.0) + number
    return out


def _error_code(text: str) -> str:
    try:
        err = msgspec.json.decode(text).get("error") or {}
    except (msgspec.DecodeError, AttributeError):
        return ""
    return str(err.get("code") or err.get("type") or "") if isinstance(err, dict) else ""


def _traceparent(rng: random.Random) -> tuple[str, str]:
    trace_id = f"{rng.getrandbits(128):032x}"
    return trace_id, f"00-{trace_id}-{rng.getrandbits(64):016x}-01"


class Progress:
    """One status line on a terminal (stderr), redrawn at most every 0.25 s."""

    def __init__(self, total: int, enabled: bool | None = None) -> None:
        self.total = total
        self.enabled = sys.stderr.isatty() if enabled is None else enabled
        self.sent = self.done = self.rejected = 0
        self._drawn = 0.0

    def update(self, force: bool = False) -> None:
        now = time.monotonic()
        if not self.enabled or (not force and now - self._drawn < 0.25):
            return
        self._drawn = now
        width = 30
        filled = int(width * self.done / max(self.total, 1))
        sys.stderr.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {self.done}/{self.total} "
                         f"done, {self.sent} sent, {self.rejected} rejected ")
        if force:
            sys.stderr.write("\n")
        sys.stderr.flush()


async def replay(requests: list[TraceRequest], target, prompt: Callable[[TraceRequest],
                 tuple[list[int], str]], *, scaling: Scaling = Scaling(),
                 closed_loop: bool = False, max_lag_ms: float = 100.0,
                 sample_every_s: float = 0.5, progress: bool | None = None,
                 label: str = "") -> RunResult:
    """Replay ``requests`` (already scaled) against ``target``; ``prompt(req)`` gives the
    token ids and the text for a request."""
    rng = random.Random(scaling.seed)
    items: list[tuple[Sent, RequestRecord]] = []
    for req in requests:                        # prompts are built before the clock starts
        ids, text = prompt(req)
        trace_id, tp = _traceparent(rng)
        rid = f"replay-{req.index}-{trace_id[:8]}"
        max_tokens = req.max_tokens or req.output_tokens or 1
        items.append((Sent(request=req, request_id=rid, token_ids=ids, text=text,
                           max_tokens=max(max_tokens, 1), traceparent=tp),
                      RequestRecord(index=req.index, request_id=rid,
                                    tenant=req.tenant or "default",
                                    service_class=req.service_class or "default",
                                    session_id=req.session_id, arrival_s=req.arrival_s,
                                    sent_s=req.arrival_s, prompt_tokens=len(ids),
                                    deadline_ms=req.deadline_ms, trace_id=trace_id, n=req.n)))
    bar = Progress(len(items), progress)
    lags: list[float] = []
    timeline: list[TimelinePoint] = []
    engine: dict[str, float] = {}
    async with target:
        counts = getattr(target, "engine_counts", None)
        before = await counts() if counts else {}
        t0 = time.perf_counter()

        async def one(item: Sent, rec: RequestRecord, not_before: float) -> None:
            await _sleep_until(t0 + not_before)
            rec.sent_s = _clock(t0)
            lags.append(rec.sent_s - not_before)
            bar.sent += 1
            await target.send(item, rec, t0)
            bar.done += 1
            bar.rejected += rec.terminal == REJECTED
            bar.update()

        async def session(turns: list[tuple[Sent, RequestRecord]]) -> None:
            for item, rec in turns:
                ready = max(rec.arrival_s, _clock(t0))
                await one(item, rec, ready)

        async def sampler(done: anyio.Event) -> None:
            while not done.is_set():
                point = await target.sample(_clock(t0))
                if point is not None:
                    timeline.append(point)
                with anyio.move_on_after(sample_every_s):
                    await done.wait()

        finished = anyio.Event()
        async with anyio.create_task_group() as outer:
            outer.start_soon(sampler, finished)
            async with anyio.create_task_group() as tg:
                if closed_loop:
                    sessions: dict[str, list] = defaultdict(list)
                    for item, rec in items:
                        key = item.request.session_id or f"#{item.request.index}"
                        sessions[key].append((item, rec))
                    for turns in sessions.values():
                        tg.start_soon(session, turns)
                else:
                    # one dispatcher sleeps to each arrival and starts its send then: tasks
                    # start in FIFO order, so a burst of one instant goes out in the trace's
                    # order (timers of one instant, a task per request, fire in no fixed one)
                    for item, rec in sorted(items, key=lambda x: x[1].arrival_s):
                        await _sleep_until(t0 + rec.arrival_s)
                        tg.start_soon(one, item, rec, rec.arrival_s)
            finished.set()
        bar.update(force=True)
        if counts:
            engine = await _engine_delta(counts, before, items)
    records = [rec for _, rec in items]
    ends = [r.sent_s + (r.e2e_s or 0.0) for r in records]
    lags.sort()
    p50 = lags[len(lags) // 2] * 1e3 if lags else 0.0
    p99 = lags[min(len(lags) - 1, int(len(lags) * 0.99))] * 1e3 if lags else 0.0
    reasons = []
    if p99 > max_lag_ms:
        reasons.append(f"schedule lag p99 {p99:.0f} ms > {max_lag_ms:g} ms: the client fell "
                       f"behind the trace")
    return RunResult(label=label or target.label, mode="live", records=records,
                     timeline=timeline, scaling=scaling,
                     duration_s=max(ends, default=0.0) - min((r.arrival_s for r in records),
                                                             default=0.0),
                     meta={"target": target.label, "closed_loop": closed_loop,
                           "max_lag_ms": max_lag_ms,
                           "cached_tokens_reported": getattr(target, "reports_cached", True),
                           "preemptions_reported": isinstance(target, SdkTarget),
                           **engine},
                     valid=not reasons, invalid_reasons=reasons, lag_p50_ms=p50, lag_p99_ms=p99)


async def _engine_delta(counts, before: dict[str, float], items) -> dict[str, float]:
    """What the engine itself counted over the run: requests it finished and the tokens its
    preemptions wasted. Its stats ride on heartbeats, so wait (2 s at most) until its
    finished count has caught up with the completions this client saw."""
    completed = sum(rec.terminal == COMPLETED for _, rec in items)
    deadline = time.monotonic() + 2.0
    while True:
        after = await counts()
        finished = after.get("streamer.requests.finished", 0) - before.get(
            "streamer.requests.finished", 0)
        if finished >= completed or time.monotonic() > deadline:
            break
        await anyio.sleep(0.1)
    return {"engine_finished": int(finished),
            "wasted_tokens": int(after.get("scheduler.wasted_tokens", 0)
                                 - before.get("scheduler.wasted_tokens", 0))}


async def _sleep_until(t: float) -> None:
    delay = t - time.perf_counter()
    if delay > 0:
        await anyio.sleep(delay)
