"""Trace replay by an independent client: aiperf's Mooncake replay (fixed schedule) against
Weir's gateway, then against vLLM's CPU build, one server at a time, each on its defaults.

The slice is written as a Mooncake trace aiperf reads: the first --limit requests after
--start, timestamps rebased to 0 and multiplied by --time-scale (ms), input and output lengths
multiplied by --length-scale (rounded half to even, at least 1, as weir.replay scales them),
hash_ids as they are, less any past the length; aiperf builds each hash id's block of
--block-size × --length-scale tokens (--isl-block-size), so requests share prefixes as the
trace says. aiperf runs from its own venv (.bench/aiperf-venv: `pip install aiperf`), one
worker, no UI, no server metrics, so its own processes take as little of the machine as they
can.

Per engine: aiperf's own summary (profile_export_aiperf.json: good requests and goodput per
second, TTFT, ITL, where ITL is a request's mean gap after its first token) and, from its
per-request records, the requests the server refused (an HTTP error before any token) and
"met": the SLO met over every request sent, counting a one-token answer (no ITL) as meeting
it, as weir.replay's report does; aiperf's own count leaves those out. Servers:
serving.start_weir and start_vllm, as bench/replay.py starts them (dtype and max model
length only; Weir with no admission config).
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from kernels.machine import summary_line
from scripts.bench.serving import (
    BENCH,
    ROOT,
    SERVED,
    ensure_hf_dir,
    ensure_vllm_venv,
    start_vllm,
    start_weir,
    stop,
    wait_http,
)

TRACE = ROOT.parent / "shared" / "traces" / "mooncake_conversation_trace.jsonl"
AIPERF = BENCH / "aiperf-venv" / "bin" / "aiperf"
TOKENIZER_REPO = "local/smollm2-135m"   # a name in tokenizer_cache(), never fetched


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trace", default=str(TRACE))
    ap.add_argument("--start", type=int, default=0)
    ap.add_argument("--limit", type=int, default=116)
    ap.add_argument("--length-scale", type=float, default=0.0625)
    ap.add_argument("--time-scale", type=float, default=1.0)
    ap.add_argument("--block-size", type=int, default=512, help="the trace's, before scaling")
    ap.add_argument("--ttft-ms", type=float, default=3000.0)
    ap.add_argument("--itl-ms", type=float, default=300.0)
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--max-model-len", type=int, default=8192)
    ap.add_argument("--engines", default="weir,vllm", help="comma-separated: weir, vllm")
    ap.add_argument("--weir-port", type=int, default=8100)
    ap.add_argument("--vllm-port", type=int, default=8200)
    ap.add_argument("--out", default=None)
    return ap.parse_args()


def write_slice(args, path: Path) -> tuple[int, float]:
    """The scaled slice as a Mooncake trace; returns (requests, span in s)."""
    rows = []
    with open(args.trace) as f:
        for i, line in enumerate(f):
            if i >= args.start + args.limit:
                break
            if i >= args.start and line.strip():
                rows.append(json.loads(line))
    first = rows[0]["timestamp"]

    def scaled(x: int) -> int:
        return max(1, round(x * args.length_scale))

    block = max(1, round(args.block_size * args.length_scale))
    with open(path, "w") as f:
        for r in rows:
            length = scaled(r["input_length"])
            # aiperf wants the last block non-empty: a row whose length fills its blocks
            # exactly and names one id more (the trace has such rows) keeps the ids it fills
            ids = r["hash_ids"][:-(-length // block)]
            f.write(json.dumps({"timestamp": (r["timestamp"] - first) * args.time_scale,
                                "input_length": length,
                                "output_length": scaled(r["output_length"]),
                                "hash_ids": ids}) + "\n")
    return len(rows), (rows[-1]["timestamp"] - first) * args.time_scale / 1000


def tokenizer_cache() -> Path:
    """The served model's tokenizer as a Hugging Face cache entry, TOKENIZER_REPO at revision
    main: aiperf's prompt workers load their tokenizer offline through the hub cache, which
    refuses a plain directory path (aiperf 0.13)."""
    cache = BENCH / "aiperf-hf"
    entry = cache / f"models--{TOKENIZER_REPO.replace('/', '--')}"
    snapshot = entry / "snapshots" / ("0" * 40)
    snapshot.mkdir(parents=True, exist_ok=True)
    (entry / "refs").mkdir(exist_ok=True)
    (entry / "refs" / "main").write_text("0" * 40)
    for f in ensure_hf_dir().iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "chat_template", "config")):
            link = snapshot / f.name
            if not link.exists():
                link.symlink_to(f)
    return cache


def run_aiperf(url: str, args, trace: Path, out: Path) -> None:
    block = max(1, round(args.block_size * args.length_scale))
    env = dict(os.environ, HF_HUB_CACHE=str(tokenizer_cache()), HF_HUB_OFFLINE="1",
               TRANSFORMERS_OFFLINE="1")
    cmd = [str(AIPERF), "profile", "--model", SERVED, "--url", url,
           "--endpoint-type", "completions", "--streaming",
           "--tokenizer", TOKENIZER_REPO,
           "--input-file", str(trace), "--custom-dataset-type", "mooncake_trace",
           "--fixed-schedule", "--isl-block-size", str(block), "--random-seed", "0",
           "--extra-inputs", "ignore_eos:true", "--extra-inputs", "temperature:0",
           "--use-server-token-count",
           "--goodput", f"time_to_first_token:{args.ttft_ms:g} "
                        f"inter_token_latency:{args.itl_ms:g}",
           "--workers-max", "1", "--record-processors", "1", "--ui-type", "none",
           "--no-server-metrics", "--no-gpu-telemetry", "--artifact-dir", str(out)]
    print("bench: " + " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, cwd=BENCH, env=env)


def _stat(summary: dict, tag: str, key: str) -> float | None:
    m = summary.get(tag)
    return m.get(key) if isinstance(m, dict) else None


def digest(name: str, out: Path, sent: int, args) -> dict:
    summary = json.loads(next(out.rglob("profile_export_aiperf.json")).read_text())
    refused = met = 0
    records = next(out.rglob("profile_export.jsonl"), None)
    for line in records.read_text().splitlines() if records else ():
        rec = json.loads(line)
        metrics = rec.get("metrics", {})
        if rec.get("error") or "time_to_first_token" not in metrics:
            refused += 1
            continue
        ttft = metrics["time_to_first_token"]["value"]
        itl = metrics.get("inter_token_latency", {}).get("value", 0.0)
        met += ttft <= args.ttft_ms and itl <= args.itl_ms
    row = {"engine": name, "sent": sent, "good": _stat(summary, "good_request_count", "avg"),
           "met": met, "refused": refused, "goodput_rps": _stat(summary, "goodput", "avg")}
    for tag, short in (("time_to_first_token", "ttft"), ("inter_token_latency", "itl")):
        for q in ("p50", "p90", "p99"):
            row[f"{short}_{q}"] = _stat(summary, tag, q)
    return row


def main() -> int:
    args = parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))    # so the finally blocks run
    out = Path(args.out or BENCH / f"aiperf-{time.strftime('%Y%m%d-%H%M%S')}")
    out.mkdir(parents=True, exist_ok=True)
    trace = out / "slice.jsonl"
    sent, span = write_slice(args, trace)
    rate = f"{sent / span:.2f} req/s" if span > 0 else "all at once"
    print(f"machine: {summary_line()}\nslice: {sent} requests over {span:.1f} s ({rate}), "
          f"lengths ×{args.length_scale:g}, time ×{args.time_scale:g}; SLO TTFT ≤ "
          f"{args.ttft_ms:g} ms, ITL ≤ {args.itl_ms:g} ms", flush=True)
    engines = args.engines.split(",")
    py = hf_dir = None
    if "vllm" in engines:
        py, hf_dir = ensure_vllm_venv(), ensure_hf_dir()
    rows = []
    for name in engines:
        if name == "weir":
            url = f"http://127.0.0.1:{args.weir_port}"
            proc = start_weir(args.weir_port, args.dtype, max_model_len=args.max_model_len)
            ready = f"{url}/ready"
        else:
            url = f"http://127.0.0.1:{args.vllm_port}"
            proc = start_vllm(py, args.vllm_port, hf_dir, args.dtype, False,
                              max_model_len=args.max_model_len)
            ready = f"{url}/health"
        try:
            wait_http(ready, proc)
            run_aiperf(url, args, trace, out / name)
        finally:
            stop(proc)
        rows.append(digest(name, out / name, sent, args))
    lines = ["engine   sent  good  met  refused  goodput/s  TTFT p50/p90/p99 (ms)   "
             "ITL p50/p99 (ms)"]
    for r in rows:
        def f(x):
            return "-" if x is None else f"{x:.0f}"
        lines.append(f"{r['engine']:<8} {r['sent']:>4} {f(r['good']):>5} {r['met']:>4} "
                     f"{r['refused']:>8} "
                     f"{'-' if r['goodput_rps'] is None else format(r['goodput_rps'], '.2f'):>10}"
                     f"  {f(r['ttft_p50'])}/{f(r['ttft_p90'])}/{f(r['ttft_p99'])}"
                     f"   {f(r['itl_p50'])}/{f(r['itl_p99'])}")
    print("\n".join(lines))
    (out / "bench.json").write_text(json.dumps(rows, indent=2) + "\n")
    (out / "bench.txt").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
