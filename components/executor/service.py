"""The executor process: model weights, the paged KV tensors and the step runner."""
from __future__ import annotations

import asyncio
import ctypes
import os
import time
from concurrent.futures import ThreadPoolExecutor

import structlog
import torch
from opentelemetry import trace
from opentelemetry.trace import Status, StatusCode

from bus import tracing
from bus.component import Component
from components.executor import determinism
from components.executor.build import build_model
from components.executor.constraints import Grammars
from components.executor.drafting import build_drafter
from components.executor.loader import load_model
from components.executor.runner import ModelRunner
from components.executor.step_costs import step_costs
from components.model.fetch import cache_dir, resolve_model
from components.model.identity import MODEL_SHA256, model_sha256
from components.model.structured import ll_tokenizer
from components.model.vocab import load_tokenizer
from kernels.kv_cache import cache_dtype, populate
from kernels.machine import usable_cores, usable_cpus
from schemas.wire import ExecutorMsg, ExecutorReady, StepPlan, StepResult

log = structlog.get_logger("executor")
_TRACER = trace.get_tracer("weir.executor")


def rss_bytes() -> int:
    """This process's resident memory (Linux; 0 elsewhere)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def trim_heap() -> int:
    """Hand the C heap's free pages back to the OS (glibc's ``malloc_trim``) and return the
    bytes of resident memory that went (0 where the C library has none). Building frees
    the dequantized weights and the packing's temporaries, and the heap keeps those pages
    resident otherwise: SmolLM2's executor held 2.0 GB (fp32) / 1.3 GB (bf16) after its
    build, 1.45 / 0.80 GB after this (40 ms)."""
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return 0
    before = rss_bytes()
    trim(0)
    return max(before - rss_bytes(), 0)


class ExecutorService(Component):
    name = "executor"

    async def setup(self) -> None:
        # Every torch call runs on this one thread, never on the event loop's: OpenMP keeps a
        # thread team per calling thread, and a second team (e.g. the main thread's, left
        # from loading) competes with the stepping one. Measured on 2 cores, batch-64 bf16
        # decode: 130 ms/step stepping on a worker after loading on the main thread, 96 ms
        # with everything on one thread.
        self.torch_thread = ThreadPoolExecutor(1, thread_name_prefix="weir-torch")
        await self.on_torch_thread(self._build)
        eng, kv = self.config.engine, self.config.kv
        log.info("model_loaded", model=self.spec.name, dtype=eng.dtype, device=str(self.device),
                 kv_dtype=str(self.runner.kv.dtype).removeprefix("torch."),
                 backend=self.runner.model.backend.name, layers=self.spec.num_layers,
                 kv_blocks=kv.num_blocks, host_kv_blocks=kv.num_cpu_blocks,
                 block_bytes=self.runner.block_bytes,
                 copy_gb_per_s=round(self.bandwidth / 1e9, 2), seconds=self.load_s,
                 rss_mb=rss_bytes() >> 20, trimmed_mb=self.trimmed >> 20)
        plan = self.runner.model.plan
        log.info("kernels_chosen", how=plan.source, measuring_s=plan.seconds, key=plan.key,
                 deterministic_plan=self.deterministic_plan, **plan.summary())
        self.inbox_sock = self.inbox(ExecutorMsg)
        self.to_scheduler = self.push_to("scheduler")
        await self.to_scheduler.send(ExecutorReady(self.runner.block_bytes, self.bandwidth,
                                                   kv.num_cpu_blocks, self.step_costs))
        self.steps = 0
        self.busy_ns = 0

    async def on_torch_thread(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self.torch_thread, fn, *args)

    def _build(self) -> None:
        eng, kv = self.config.engine, self.config.kv
        torch.set_num_threads(eng.num_threads or usable_cores())
        t0 = time.perf_counter()
        path = resolve_model(eng.model)
        self.model_sha256 = model_sha256(path, cache_dir() / "model_sha256.json")
        spec, weights = load_model(path)
        if eng.max_model_len > spec.max_position:
            raise ValueError(f"engine.max_model_len {eng.max_model_len} exceeds the model's "
                             f"context of {spec.max_position}")
        dtype = getattr(torch, eng.dtype)
        if eng.device == "cuda" and not torch.cuda.is_available():
            raise ValueError("engine.device is 'cuda' but no CUDA device is available")
        device = torch.device("cuda" if eng.device == "cuda" or (
            eng.device == "auto" and torch.cuda.is_available()) else "cpu")
        # structured output's vocabulary, built on its own thread while the weights are
        # prepared (not under the first constrained request's step); languages compile
        # beside the forward pass where it leaves cores free
        grammars = Grammars(lambda: ll_tokenizer(load_tokenizer(path), spec.vocab_size),
                            overlap=device.type == "cuda"
                            or torch.get_num_threads() < usable_cpus())
        k = eng.kernels

        def build(spec, weights, dtype=dtype):
            return build_model(spec, weights, dtype=dtype, device=device,
                               backend=eng.attention_backend, kv_block_size=kv.block_size,
                               kernels={"linear": k.linear, "elementwise": k.elementwise,
                                        "sampling": k.sampling,
                                        "fresh_prompts": k.fresh_prompts,
                                        "attention_tiles": k.attention_tiles,
                                        "layer_loop": k.layer_loop},
                               tuning_cache=cache_dir() if k.cache else None,
                               max_tokens=self.config.scheduler.max_num_batched_tokens,
                               max_seqs=self.config.scheduler.max_num_seqs,
                               kv_dtype=cache_dtype(kv.dtype, dtype))

        model = build(spec, weights)
        sp = self.config.speculative
        # the served model as its own draft reuses its weights (before they are freed)
        own = (spec, weights) if sp.method == "draft" and not sp.draft_model else None
        del weights
        kv_cache = model.new_kv_cache(kv.num_blocks, kv.block_size)
        drafter = build_drafter(
            sp, target_spec=spec,
            load_weights=lambda: own or load_model(resolve_model(sp.draft_model)),
            build=lambda s, w: build(s, w, dtype if sp.draft_dtype == "auto"
                                     else getattr(torch, sp.draft_dtype)),
            kv_cache=lambda m: m.new_kv_cache(kv.num_blocks, kv.block_size))
        own = None
        if drafter is not None:
            log.info("speculative_decoding", method=sp.method, max_k=sp.max_k,
                     control=sp.control, draft_layers=sp.draft_layers or None)
        if kv.prefault and device.type == "cpu":
            # first-touch page faults otherwise land inside steps, one per new 4 KB of each
            # layer's block: served bf16 at rate inf on 2 AMX cores, decode steps of 64 took
            # 66-67 ms with the pool faulted in and 72-73 ms without
            t1 = time.perf_counter()
            how = populate(kv_cache.data)
            log.info("kv_pool_faulted_in", how=how, mb=kv_cache.data.numel()
                     * kv_cache.data.element_size() >> 20, s=round(time.perf_counter() - t1, 3))
        graphs = None
        if device.type == "cuda" and eng.cuda_graphs and getattr(model.backend, "graph_safe",
                                                                  False):
            from components.executor.cuda_graphs import DecodeGraphs
            try:
                graphs = DecodeGraphs(model, kv_cache, max_model_len=eng.max_model_len,
                                      max_batch=min(eng.cuda_graph_max_batch,
                                                    self.config.scheduler.max_num_seqs))
                log.info("cuda_graphs_captured", backend=model.backend.name, **graphs.capture())
            except Exception:
                log.exception("cuda_graph_capture_failed; decode runs eagerly")
                graphs = None
        pieces = None
        if device.type == "cuda" and eng.cuda_graphs and eng.cuda_graph_prefill \
                and getattr(model, "rope_kv", False):
            from components.executor.piecewise_graphs import PiecewiseGraphs
            try:
                pieces = PiecewiseGraphs(model, kv_cache,
                                         max_tokens=self.config.scheduler.max_num_batched_tokens,
                                         buckets=eng.cuda_graph_token_buckets or None)
                log.info("piecewise_graphs_captured", **pieces.capture())
            except Exception:
                log.exception("piecewise_graph_capture_failed; prefill runs eagerly")
                pieces = None
        self.runner = ModelRunner(model, kv_cache, kv.num_cpu_blocks, graphs, grammars,
                                  drafter, pieces)
        # what a deterministic request's bits are pinned to (determinism.plan_id)
        self.deterministic_plan = determinism.plan_id(model.plan, model.dtype, model.kv_dtype,
                                                      model.device)
        # measured once, before any KV exists: it overwrites the first blocks of both tiers
        self.bandwidth = self.runner.measure_copy_bandwidth()
        self.spec, self.device = spec, device
        # ready once the vocabulary is: its build holds the GIL, which the first steps need
        if (failed := grammars.settle()) is not None:
            log.error("structured_output_unavailable", error=repr(failed)[:200])
        # the steps the scheduler's cost model starts from: before any KV exists, as the
        # bandwidth, and after the vocabulary (once per machine: cached)
        sched = self.config.scheduler
        self.step_costs, how, seconds = step_costs(
            self.runner, model, sched.max_num_batched_tokens, eng.max_model_len,
            sched.max_num_seqs, cache_dir() if k.cache else None)
        log.info("step_costs", how=how, seconds=seconds, steps=len(self.step_costs),
                 ms={f"{s.seqs}x{s.tokens}@{s.context}": round(s.seconds * 1e3, 2)
                     for s in self.step_costs})
        self.trimmed = trim_heap()
        self.load_s = round(time.perf_counter() - t0, 2)

    async def run(self) -> None:
        while True:
            msg = await self.inbox_sock.recv()
            match msg.body:
                case StepPlan() as plan:
                    span = _TRACER.start_span("executor.step",
                                              context=tracing.context_from(msg.envelope.traceparent),
                                              attributes={"weir.step.id": plan.step_id,
                                                          "weir.step.num_seqs": len(plan.steps),
                                                          "weir.step.new_seqs": len(plan.new_seqs)})
                    try:
                        result = await self.on_torch_thread(self.runner.step, plan)
                    except Exception:
                        # e.g. a plan from before a restart naming sequences we never saw;
                        # the scheduler fails the step's requests and resets.
                        log.exception("step_failed", step_id=plan.step_id)
                        self.runner.seqs.clear()
                        await self.to_scheduler.send(StepResult(plan.step_id, [], [], 0, True))
                        span.set_status(Status(StatusCode.ERROR, "step failed"))
                        span.end()
                        continue
                    span.set_attribute("weir.step.forward_ms", round(result.elapsed_ns / 1e6, 3))
                    span.end()
                    self.steps += 1
                    self.busy_ns += result.elapsed_ns
                    await self.to_scheduler.send(result)

    async def peer_restarted(self, name: str) -> None:
        if name == "scheduler":                   # a new scheduler needs the copy costs
            await self.on_torch_thread(self.runner.seqs.clear)     # and has none of these
            await self.to_scheduler.send(ExecutorReady(
                self.runner.block_bytes, self.bandwidth, self.config.kv.num_cpu_blocks,
                self.step_costs))

    def info(self) -> dict[str, str]:
        return {**{f"kernel.{k}": v for k, v in self.runner.model.plan.summary().items()},
                "kernel.threads": str(torch.get_num_threads()),   # what the plan was timed on
                "kernel.deterministic_plan": self.deterministic_plan,
                "kv.dtype": str(self.runner.kv.dtype).removeprefix("torch."),
                MODEL_SHA256: self.model_sha256}

    def stats(self) -> dict[str, float]:
        return {"steps": self.steps, "busy_s": round(self.busy_ns / 1e9, 3),
                "sequences": len(self.runner.seqs), "copied_blocks": self.runner.copied_blocks,
                "graph_steps": self.runner.graph_steps,
                "piecewise_steps": self.runner.piecewise_steps,
                "spec.drafted": self.runner.drafted, "spec.accepted": self.runner.accepted,
                "spec.draft_s": round(self.runner.draft_ns / 1e9, 3),
                "structured.rows": self.runner.constrained_rows,
                "structured.mask_s": round(self.runner.mask_ns / 1e9, 3),
                "structured.compile_wait_s": round(self.runner.grammar_wait_ns / 1e9, 3)}
