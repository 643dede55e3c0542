"""Offline throughput: one workload through Weir (all seven processes) and through
Hugging Face transformers ``generate``, side by side in one run.

Workload: N requests of P prompt tokens and O output tokens, greedy, ignoring eos.
Prints each engine's output tokens/s (median over repeats) and the ratio.
"""
from __future__ import annotations

import argparse
import gc
import statistics
import sys
import tempfile
import time
from pathlib import Path

import anyio
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.e2e.engine import Engine  # noqa: E402
from weir import AsyncClient  # noqa: E402
from weir.model_fetch import default_model_path  # noqa: E402


def make_prompts(n: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    # stay clear of the special tokens at the start of the vocabulary
    return torch.randint(100, vocab, (n, length), generator=g).tolist()


def bench_hf(prompts: list[list[int]], out_len: int, dtype: torch.dtype, repeats: int) -> list[float]:
    from transformers import AutoModelForCausalLM

    path = default_model_path()
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=dtype).eval()
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


def bench_weir(prompts, out_len: int, dtype: str, repeats: int, budget: int) -> list[float]:
    toml = f"""
[engine]
dtype = "{dtype}"
[scheduler]
max_num_seqs = {max(len(prompts), 1)}
max_num_batched_tokens = {budget}
"""
    with tempfile.TemporaryDirectory(prefix="weir-bench-") as tmp:
        eng = Engine(Path(tmp), toml)
        try:
            anyio.run(_weir_once, eng.endpoint, prompts[:4], 4)      # warm-up
            return [anyio.run(_weir_once, eng.endpoint, prompts, out_len) for _ in range(repeats)]
        finally:
            eng.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--budget", type=int, default=512, help="Weir max_num_batched_tokens")
    args = ap.parse_args()
    prompts = make_prompts(args.requests, args.prompt_len, 49152)
    print(f"workload: {args.requests} requests x {args.prompt_len} prompt / {args.output_len} "
          f"output tokens, greedy, ignore eos, {args.dtype}, {torch.get_num_threads()} threads, "
          f"median of {args.repeats}", flush=True)
    hf = bench_hf(prompts, args.output_len, getattr(torch, args.dtype), args.repeats)
    print(f"hf transformers generate (one batch of {args.requests}): "
          f"{statistics.median(hf):8.1f} output tok/s  runs {[round(r, 1) for r in hf]}", flush=True)
    weir = bench_weir(prompts, args.output_len, args.dtype, args.repeats, args.budget)
    print(f"weir (7 processes, SDK client)        : "
          f"{statistics.median(weir):8.1f} output tok/s  runs {[round(r, 1) for r in weir]}")
    print(f"ratio weir / hf: {statistics.median(weir) / statistics.median(hf):.2f}")


if __name__ == "__main__":
    main()
