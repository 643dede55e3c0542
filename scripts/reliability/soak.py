"""Soak: N requests in waves through the SDK and the HTTP gateway (streamed, cancelled,
rejected and client-abandoned ones among them), with every process's RSS and open file
descriptors sampled after each wave. Prints the curve, and exits non-zero if any process
grew past the stated margin between the first measured wave and the last.

    scripts/run reliability/soak [--requests 2000] [--wave 100] [--dtype bfloat16]

A real `weir serve` (all components, gateway on) is started and stopped by the script.
The first wave warms caches and allocators; growth is measured from the end of wave 2.
Requests of every kind by default: plain, streamed, cancelled, abandoned, invalid, held to
one of 400 JSON schemas (the compiled-language caches turn over), and sampled with n 2,
logprobs, penalties, a logit bias and a stop string. ``--kinds`` keeps some of them, to find
which kind a growth comes from. The engine's KV pool is small, so that every block has been
written within the first waves: a block's pages are zero pages until then, and a default
pool's would read as growth for thousands of requests.
"""
from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
import time
from pathlib import Path

import anyio
import httpx

from kernels.machine import summary_line
from tests.e2e.conftest import free_port
from tests.e2e.engine import Engine
from weir import WeirError

RSS_MARGIN = 0.10          # a process may grow 10% (plus 8 MiB of allocator slack) ...
RSS_SLACK_KB = 8 * 1024
FD_MARGIN = 4              # ... and hold 4 more file descriptors


def sample(pids: dict[str, int]) -> dict[str, tuple[int, int]]:
    """(RSS in KiB, open fds) of each process."""
    out = {}
    for name, pid in pids.items():
        try:
            rss = next(int(line.split()[1]) for line in Path(f"/proc/{pid}/status").read_text()
                       .splitlines() if line.startswith("VmRSS:"))
            out[name] = (rss, len(os.listdir(f"/proc/{pid}/fd")))
        except (OSError, StopIteration):
            out[name] = (-1, -1)
    return out


SDK_KINDS = ("generate", "stream", "cancel", "bad")
HTTP_KINDS = ("json", "sse", "abandon", "bad", "structured", "sampling")


async def one_sdk(client, i: int, rng: random.Random, tally: dict, kinds=SDK_KINDS) -> None:
    kind = rng.choice(kinds)
    try:
        if kind == "bad":
            await client.generate("x", max_tokens=-1)
        elif kind == "cancel":
            stream = await client.stream(f"Soak {i}: tell a story", max_tokens=64,
                                         ignore_eos=True)
            async for _ in stream:
                await stream.cancel()
                break
            async for _ in stream:
                pass
        else:
            await client.generate(f"Soak {i}: say something", max_tokens=rng.randint(4, 32),
                                  temperature=rng.choice([0.0, 0.8]), seed=i)
        tally[kind] = tally.get(kind, 0) + 1
    except WeirError as exc:
        tally[f"{kind}:{type(exc).__name__}"] = tally.get(f"{kind}:{type(exc).__name__}", 0) + 1


def schema(i: int) -> dict:
    """One of 400 distinct small JSON schemas: more than the executor keeps compiled (64)
    and the tokenizer keeps checked (256), so both caches turn over."""
    return {"type": "object", "required": [f"k{i % 400}"],
            "properties": {f"k{i % 400}": {"type": "integer", "minimum": 0, "maximum": 999},
                           "note": {"type": "string", "maxLength": 12}}}


async def one_http(http, i: int, rng: random.Random, tally: dict, kinds=HTTP_KINDS) -> None:
    kind = rng.choice(kinds)
    body = {"prompt": f"Soak {i}: say something", "max_tokens": rng.randint(4, 32),
            "temperature": 0}
    try:
        if kind == "structured":         # held to a schema, streamed or not
            chat = {"max_tokens": 24, "stream": bool(i % 3),
                    "messages": [{"role": "user", "content": f"Soak {i}: a record"}],
                    "response_format": {"type": "json_schema",
                                        "json_schema": {"name": "r", "schema": schema(i)}}}
            async with http.stream("POST", "/v1/chat/completions", json=chat) as r:
                code = r.status_code
                async for _ in r.aiter_lines():
                    pass
        elif kind == "sampling":         # n > 1, logprobs, penalties, a bias, a stop string
            code = (await http.post("/v1/completions", json={
                **body, "n": 2, "temperature": 0.8, "seed": i, "logprobs": 3,
                "presence_penalty": 0.5, "frequency_penalty": 0.3, "repetition_penalty": 1.1,
                "logit_bias": {"13": -5}, "stop": [" the"]})).status_code
        elif kind == "bad":
            r = await http.post("/v1/completions", json={**body, "max_tokens": -5})
            code = r.status_code
        elif kind == "json":
            code = (await http.post("/v1/completions", json=body)).status_code
        else:
            async with http.stream("POST", "/v1/completions",
                                   json={**body, "stream": True, "max_tokens": 48,
                                         "ignore_eos": True}) as r:
                code = r.status_code
                async for line in r.aiter_lines():
                    if kind == "abandon" and line.startswith("data: "):
                        break                  # drop the connection mid-stream
        tally[f"{kind}:{code}"] = tally.get(f"{kind}:{code}", 0) + 1
    except httpx.HTTPError as exc:
        tally[f"{kind}:{type(exc).__name__}"] = tally.get(f"{kind}:{type(exc).__name__}", 0) + 1


async def wave(eng: Engine, start: int, size: int, rng: random.Random, tally: dict,
               kinds: tuple[str, ...] = ()) -> None:
    """``size`` requests, alternately SDK and HTTP, of ``kinds`` (all: every kind)."""
    sdk = tuple(k for k in SDK_KINDS if not kinds or k in kinds)
    web = tuple(k for k in HTTP_KINDS if not kinds or k in kinds)
    async with eng.async_client(timeout=120) as client, \
            httpx.AsyncClient(base_url=eng.base_url, timeout=120) as http, \
            anyio.create_task_group() as tg:
        for i in range(start, start + size):
            if web and (i % 2 == 0 or not sdk):
                tg.start_soon(one_http, http, i, rng, tally, web)
            else:
                tg.start_soon(one_sdk, client, i, rng, tally, sdk)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--wave", type=int, default=100)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--verbose", action="store_true", help="print the outcomes after each wave")
    ap.add_argument("--kinds", default="", help="only these kinds of request, comma-separated "
                    f"(SDK: {', '.join(SDK_KINDS)}; HTTP: {', '.join(HTTP_KINDS)}; "
                    "default: all), to find which one a growth comes from")
    args = ap.parse_args()
    kinds = tuple(k for k in args.kinds.split(",") if k)
    if unknown := set(kinds) - set(SDK_KINDS) - set(HTTP_KINDS):
        ap.error(f"unknown kinds: {', '.join(sorted(unknown))}")
    print(f"cpu: {summary_line()}; "
          f"{args.requests} requests in waves of {args.wave}, {args.dtype}")
    run_dir = Path(tempfile.mkdtemp(prefix="weir-soak-"))
    # a small KV pool and host tier: every block is written within the first waves (the
    # pool is zero pages until a block is first written, so a large one would read as
    # growth until it had all been used once), and preemption runs too
    eng = Engine(run_dir, "[engine]\nmax_model_len = 1024\n[kv]\nnum_blocks = 256\n"
                 "num_cpu_blocks = 64\n", http_port=free_port(), extra_args=("--dtype", args.dtype))
    rng = random.Random(args.seed)
    tally: dict = {}
    try:
        status = eng.status()
        pids = {name: c.pid for name, c in status.items()}
        pids["supervisor"] = eng.proc.pid
        names = sorted(pids)
        print("wave  requests  secs  " + "  ".join(f"{n[:10]:>15}" for n in names))
        print("                      " + "  ".join(f"{'rss MiB / fds':>15}" for _ in names))
        curve = []
        sent = 0
        while sent < args.requests:
            t0 = time.monotonic()
            size = min(args.wave, args.requests - sent)
            anyio.run(wave, eng, sent, size, rng, tally, kinds)
            sent += size
            eng.wait_kv_free(timeout=30)
            s = sample(pids)
            curve.append(s)
            print(f"{len(curve):4}  {sent:8}  {time.monotonic() - t0:4.0f}  " + "  ".join(
                f"{s[n][0] / 1024:8.1f} / {s[n][1]:3}" for n in names), flush=True)
            if args.verbose:
                print("      ", dict(sorted(tally.items())), flush=True)
        base, last = curve[min(1, len(curve) - 1)], curve[-1]
        grew = [n for n in names if last[n][0] > base[n][0] * (1 + RSS_MARGIN) + RSS_SLACK_KB
                or last[n][1] > base[n][1] + FD_MARGIN]
        print("outcomes:", dict(sorted(tally.items())))
        restarts = {n: c.restarts for n, c in eng.status().items() if c.restarts}
        print(f"restarts: {restarts or 'none'}; KV free == total after every wave")
        if grew:
            print(f"GREW past {RSS_MARGIN:.0%} RSS + {RSS_SLACK_KB // 1024} MiB or "
                  f"{FD_MARGIN} fds since wave 2: {grew}")
            return 1
        print(f"flat: every process within {RSS_MARGIN:.0%} RSS (+{RSS_SLACK_KB // 1024} MiB) "
              f"and {FD_MARGIN} fds of wave 2")
        return 0 if not restarts else 1
    finally:
        eng.stop()


if __name__ == "__main__":
    sys.exit(main())
