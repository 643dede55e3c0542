"""Configuration: frozen msgspec Structs, loadable from TOML, validated once.

A config is built once (from defaults, a TOML file and CLI overrides), checked
by ``__post_init__`` with a clear ``ConfigError``, and never changed after.
Derived values (socket addresses, block counts) are properties, not fields.

One file past 400 lines on purpose: the sections check each other in
``WeirConfig.__post_init__``, and a field's type, default and check are read in one place
(docs/configuration.md is its guide).
"""
from __future__ import annotations

import os
from functools import cached_property
from pathlib import Path
from typing import Any, Literal

import msgspec

COMPONENTS = ("tokenizer", "admission", "scheduler", "kv_manager", "executor", "detokenizer",
              "streamer")
DEFAULT_CLIENT_ENDPOINT = "tcp://127.0.0.1:7450"


class ConfigError(ValueError):
    pass


def _require(cond: bool, msg: str) -> None:
    if not cond:
        raise ConfigError(msg)


class Topology(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Where every socket lives. ``ipc`` puts them under ``run_dir``; ``tcp`` gives each
    component ``base_port + index`` on its host (``hosts`` maps component → hostname)."""

    transport: Literal["ipc", "tcp"] = "ipc"
    run_dir: str = ""
    client_endpoint: str = DEFAULT_CLIENT_ENDPOINT
    bind_host: str = "127.0.0.1"
    base_port: int = 7460
    hosts: dict[str, str] = {}
    supervisor_host: str = "127.0.0.1"
    # where the kv_manager publishes prefix-cache events, when a router outside this
    # engine reads them (e.g. "tcp://0.0.0.0:7470" in a replica whose bus is ipc); empty:
    # derived like every other address
    kv_events_endpoint: str = ""

    def __post_init__(self) -> None:
        _require(self.transport != "ipc" or bool(self.run_dir),
                 "topology.run_dir is required for ipc transport")
        _require(1024 <= self.base_port <= 65000, "topology.base_port must be in 1024..65000")
        unknown = set(self.hosts) - set(COMPONENTS) - {"supervisor"}
        _require(not unknown, f"topology.hosts names unknown components: {sorted(unknown)}")

    def _address(self, name: str, index: int, bind: bool, host_key: str | None = None) -> str:
        if self.transport == "ipc":
            return f"ipc://{Path(self.run_dir) / name}.sock"
        if bind:
            host = self.bind_host
        elif (host_key or name) == "supervisor":
            host = self.hosts.get("supervisor", self.supervisor_host)
        else:
            host = self.hosts.get(host_key or name, "127.0.0.1")
        return f"tcp://{host}:{self.base_port + index}"

    def inbox(self, component: str, bind: bool = False) -> str:
        """The PULL address of a component's inbox."""
        return self._address(component, COMPONENTS.index(component), bind)

    @property
    def client_connect(self) -> str:
        """The client endpoint as a client dials it (a wildcard bind host becomes the
        streamer's host)."""
        ep = self.client_endpoint
        for wildcard in ("0.0.0.0", "*"):
            if f"//{wildcard}:" in ep:
                return ep.replace(wildcard, self.hosts.get("streamer", "127.0.0.1"))
        return ep

    def heartbeats(self, bind: bool = False) -> str:
        """The supervisor's PULL address for component heartbeats."""
        return self._address("supervisor", len(COMPONENTS), bind)

    def kv_events(self, bind: bool = False) -> str:
        """The kv_manager's PUB address for prefix-cache events (stored / removed blocks)."""
        if self.kv_events_endpoint:
            return self.kv_events_endpoint
        return self._address("kv_events", len(COMPONENTS) + 2, bind, host_key="kv_manager")

    def control(self, bind: bool = False) -> str:
        """The supervisor's PUB address for control messages (drain, stop, restarts)."""
        return self._address("control", len(COMPONENTS) + 1, bind, host_key="supervisor")


class KernelsConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Forced kernel choices ("auto": the fastest measured here; kernels/tuning.py)."""
    # linear layers: native small-batch bf16 kernel (AVX512-BF16, steps <= 256 tokens; larger
    # steps take oneDNN), the same packed bf16 weights through AMX tile multiplies (CPUs with
    # AMX-BF16; any step size), oneDNN-packed weights (AMX where the CPU has it), plain torch, or
    # (a bf16 model) fp32 weights with the activations cast up, for CPUs without AVX-512,
    # through torch or oneDNN's packed fp32 layout
    linear: Literal["auto", "native", "amx", "onednn", "torch", "fp32", "fp32_onednn"] = "auto"
    # add+RMSNorm, RoPE, SiLU x up: native (CPU), triton (GPU) or torch
    elementwise: Literal["auto", "native", "triton", "torch"] = "auto"
    sampling: Literal["auto", "native", "torch"] = "auto"      # argmax and the seeded draw
    # a prompt's first chunk (no cached context) on the cpu attention backend: its paged
    # kernel, or torch's fused causal attention (SDPA) over the step's own keys and values
    fresh_prompts: Literal["auto", "native", "sdpa"] = "auto"
    # the cpu attention backend's paged kernel: vector (AVX-512 / AVX2 dot products) or amx
    # (q.k and P.V on the tile unit; bf16 on CPUs with AMX)
    attention_tiles: Literal["auto", "vector", "amx"] = "auto"
    # the decoder layers: one native call where every kernel of a step is native (the
    # same kernels, bit for bit, without Python between them), or the Python loop always
    layer_loop: Literal["auto", "native", "python"] = "auto"
    cache: bool = True          # keep the measured plan per machine; false: measure each start


class EngineConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    model: str = ""
    dtype: Literal["float32", "bfloat16"] = "float32"
    max_model_len: int = 2048
    attention_backend: Literal["auto", "cpu", "torch", "triton", "flash_attn"] = "auto"
    num_threads: int = 0       # 0: the cores this process may use (kernels.machine.usable_cores)
    device: Literal["auto", "cpu", "cuda"] = "auto"     # auto: the first GPU if there is one
    cuda_graphs: bool = True                            # capture decode steps on CUDA
    # which kernels run on the CPU: "auto" = measured on this machine at startup (cached per
    # machine under ~/.cache/weir/tuning), or a forced choice for reproducible runs
    kernels: KernelsConfig = KernelsConfig()
    cuda_graph_max_batch: int = 256                     # largest captured bucket
    # prefill, mixed and verify steps on CUDA: the dense parts captured piecewise per
    # token-count bucket, attention eager between them (needs cuda_graphs)
    cuda_graph_prefill: bool = True
    # their buckets, ascending; empty: 16, 32, 64, 128, 256, then every 256 up to the
    # scheduler's max_num_batched_tokens
    cuda_graph_token_buckets: tuple[int, ...] = ()
    # the deterministic serving mode (docs/design/determinism.md): "requested" runs a
    # request batch-invariantly when it asks (``deterministic: true``) or its class says
    # so, and every other request as fast as it can; "all" runs every request so; "off"
    # refuses a request that asks (invalid_request), and a class that says so is a
    # config error
    deterministic: Literal["off", "requested", "all"] = "requested"

    def __post_init__(self) -> None:
        _require(self.max_model_len >= 16, "engine.max_model_len must be >= 16")
        _require(self.num_threads >= 0, "engine.num_threads must be >= 0")
        _require(1 <= self.cuda_graph_max_batch <= 1024,
                 "engine.cuda_graph_max_batch must be in [1, 1024]")
        b = self.cuda_graph_token_buckets
        _require(all(1 <= x <= 65536 for x in b) and list(b) == sorted(set(b)),
                 "engine.cuda_graph_token_buckets must ascend, each in [1, 65536]")


class SchedulerConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 2048
    lookahead_tokens: int = 16
    step_log: str = ""        # append one JSON line per step (its shape, measured time): the
                              # input of `weir calibrate`
    fairness: Literal["vtc", "fcfs"] = "vtc"   # order of new work: by tenant's weighted
                              # service (virtual token counters), or arrival
    chunking: Literal["slack", "fixed"] = "slack"   # slack: while streams decode, cap the
                              # step's prefill so it keeps their TPOT SLO (chunking.py)
    urgency_preemption: bool = True   # a blocked request about to miss its TTFT deadline may
                              # preempt a lower class when that costs less (preemption.py)
    async_depth: int = 0      # steps in flight at the executor: 2 plans step N+1 while step N
                              # runs (overlap, loop.py); 1 waits for each result before planning;
                              # 0 = auto: 2 when the executor's threads leave a core free
    # a deterministic prompt is computed in chunks of exactly this many tokens (its last
    # one shorter), aligned at position 0 whatever the load: the boundaries fall at its
    # multiples (chunking.py). Taken down to a multiple of kv.block_size, and to at most
    # max_num_batched_tokens (``WeirConfig.deterministic_chunk``)
    deterministic_chunk: int = 512
    # a deterministic step's time over the same step's in the fast plan, until the
    # scheduler has timed deterministic steps itself (cost_model.py, StepCostModel.
    # deterministic_factor); what the executor measures at startup replaces it
    deterministic_cost_factor: float = 1.5

    def __post_init__(self) -> None:
        _require(self.max_num_seqs >= 1, "scheduler.max_num_seqs must be >= 1")
        _require(self.deterministic_chunk >= 16, "scheduler.deterministic_chunk must be >= 16")
        _require(1.0 <= self.deterministic_cost_factor <= 100.0,
                 "scheduler.deterministic_cost_factor must be in [1, 100]")
        _require(self.max_num_batched_tokens >= self.max_num_seqs
                 or self.max_num_batched_tokens >= 16,
                 "scheduler.max_num_batched_tokens is too small")
        _require(self.lookahead_tokens >= 1, "scheduler.lookahead_tokens must be >= 1")
        _require(0 <= self.async_depth <= 2, "scheduler.async_depth must be 0 (auto), 1 or 2")


class PublicPrefix(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A named public system prompt whose KV blocks may be shared across tenants.

    A chat request whose first message is ``system_prompt`` (exactly) gets the full blocks
    of that message in the cache scope ``public:<name>``; everything after stays in the
    tenant's own scope. ``tenants`` limits who shares it (empty: every tenant). Chosen by the
    server from the authenticated tenant; a client cannot name a scope."""

    name: str
    system_prompt: str
    tenants: tuple[str, ...] = ()


class KvConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    block_size: int = 16
    num_blocks: int = 2048
    # the pool in GiB instead (0: num_blocks sets it): the blocks that fit, by the model's
    # shape and the cache's element type (components.model.kv_sizing), so fp8 holds twice the tokens
    memory_gib: float = 0.0
    grow_blocks: int = 2
    enable_prefix_cache: bool = True
    num_cpu_blocks: int = 1024        # the executor's host-memory tier (swap + demoted prefixes)
    cpu_memory_gib: float = 0.0       # the host tier in GiB instead (0: num_cpu_blocks)
    # fault the CPU pool's pages in at startup (~0.2 s a GB): steps then pay no first-touch
    # page faults, and the executor holds the whole pool from the start (as vLLM does)
    prefault: bool = True
    watermark: float = 0.01           # fraction of blocks a new sequence's first lease leaves free
    preemption_mode: Literal["auto", "recompute", "swap"] = "auto"   # auto: cheaper by estimate
    public_prefixes: tuple[PublicPrefix, ...] = ()
    # the cache's element type: "auto" is the model's; fp8 (opt-in) stores each key and value
    # element in one byte (half the bytes a decode step reads, twice the tokens per GB), at
    # fp8's precision: E4M3 ("fp8" = "fp8_e4m3", as vLLM) or E5M2 (kernels/kv_cache.py)
    dtype: Literal["auto", "fp8", "fp8_e4m3", "fp8_e5m2"] = "auto"

    def __post_init__(self) -> None:
        _require(self.block_size in (8, 16, 32, 64, 128) or (self.block_size % 256 == 0
                                                              and self.block_size <= 1024),
                 "kv.block_size must be 8..128 (a power of 2) or a multiple of 256 up to 1024 "
                 "(flash-attn's paged KV)")
        _require(self.num_blocks >= 2, "kv.num_blocks must be >= 2")
        _require(0 <= self.memory_gib < float("inf"), "kv.memory_gib must be >= 0 and finite")
        _require(0 <= self.cpu_memory_gib < float("inf"),
                 "kv.cpu_memory_gib must be >= 0 and finite")
        _require(self.grow_blocks >= 1, "kv.grow_blocks must be >= 1")
        _require(self.num_cpu_blocks >= 0, "kv.num_cpu_blocks must be >= 0")
        _require(0 <= self.watermark < 0.5, "kv.watermark must be in [0, 0.5)")
        _require(self.preemption_mode != "swap" or self.num_cpu_blocks > 0,
                 "kv.preemption_mode 'swap' needs kv.num_cpu_blocks > 0")
        names = [p.name for p in self.public_prefixes]
        _require(len(set(names)) == len(names), "kv.public_prefixes has duplicate names")

    @property
    def watermark_blocks(self) -> int:
        return int(self.num_blocks * self.watermark)


class ServiceClass(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A service class: its objectives and how admission treats its requests."""

    name: str
    priority: int = 0                  # lower is more important (preemption takes the highest)
    ttft_slo_ms: float | None = None   # the deadline of a request that names none
    tpot_slo_ms: float | None = None
    max_queue_ms: float = 0.0          # how long admission may hold one (0: never queued)
    aging_per_s: float = 0.0           # priority units a queued request gains per second
    may_degrade: bool = False          # admission may lower max_tokens to fit a budget
    min_max_tokens: int = 1            # ... never below this
    max_tokens: int | None = None      # the cap for a request asking more (or none)
    # a request of this class whose TTFT deadline (its own, else ttft_slo_ms) passes before
    # its first token: "drop" ends it deadline_expired wherever it is (admission's queue,
    # the scheduler's, mid-prefill: its client has given up, the engine should too), "keep"
    # serves it late (batch work, whose value outlives the deadline). Deadline policy only.
    late: Literal["drop", "keep"] = "drop"
    # an end-to-end bound from arrival (None: none): past it a request of this class ends
    # wherever it is, finish reason "deadline" with its output so far if it has streamed
    # tokens, else deadline_expired. A request's own e2e_deadline_ms may only tighten it.
    # Either policy; opt-in (the shipped classes have none)
    e2e_slo_ms: float | None = None
    # its requests run in the deterministic serving mode whether they ask or not (eval
    # tenants: the same request gives the same bits, whoever else is in the batch); needs
    # engine.deterministic other than "off"
    deterministic: bool = False

    def __post_init__(self) -> None:
        _require(bool(self.name), "admission.classes: a class needs a name")
        _require(self.e2e_slo_ms is None or self.e2e_slo_ms > 0,
                 f"class {self.name}: e2e_slo_ms must be > 0")
        _require(self.max_queue_ms >= 0 and self.aging_per_s >= 0,
                 f"class {self.name}: max_queue_ms and aging_per_s must be >= 0")
        _require(self.min_max_tokens >= 1, f"class {self.name}: min_max_tokens must be >= 1")
        _require(self.max_tokens is None or self.max_tokens >= self.min_max_tokens,
                 f"class {self.name}: max_tokens must be >= min_max_tokens")


DEFAULT_CLASS = ServiceClass("default")      # what a config that names no classes runs

# The SLO-first classes, what a config that names none runs (with ``policy = "deadline"``,
# the default): a request that names no class and no deadline runs as its tenant's
# default, the first, ``interactive``.
# - interactive: a first token within 3 s and then a token every 300 ms at worst (the
#   targets the trace comparisons are scored at: aiperf's goodput with TTFT <= 3 s and
#   ITL <= 300 ms); never queued in admission (a request that cannot start in time is
#   refused at once with Retry-After, not answered late), and dropped if its first token
#   has not come by its deadline.
# - batch: no latency target; waits up to a minute in admission's queue, gaining one
#   priority unit a minute there, may be degraded (max_tokens lowered) to fit, and is
#   served however late. A client asks for it with service_class "batch" (X-Weir-Class).
# The 3 s / 300 ms targets are the ones the issue measured vLLM-CPU and Weir at (aiperf).
# Neither bounds the whole request (e2e_slo_ms None): a long answer's length is the
# client's choice (max_tokens), and nothing measured calls for cutting it; a class or a
# request (Submit.e2e_deadline_ms) opts in.
SLO_CLASSES = (
    ServiceClass("interactive", priority=0, ttft_slo_ms=3000.0, tpot_slo_ms=300.0,
                 late="drop"),
    ServiceClass("batch", priority=1, max_queue_ms=60_000.0, aging_per_s=1 / 60,
                 may_degrade=True, late="keep"),
)


class TenantConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    name: str
    max_outstanding: int = 256         # requests admitted and not yet released
    weight: float = 1.0                # share of service against other tenants
    classes: tuple[str, ...] = ()      # classes it may use (empty: every class)
    default_class: str = ""            # empty: its first allowed class
    token_rate: float = 0.0            # token bucket, tokens/s (prompt + expected output); 0: off
    token_burst: float = 0.0           # the bucket's size (0: one second of token_rate)
    kv_blocks: int = 0                 # KV blocks its admitted requests may reserve (0: any)
    max_running: int = 0               # sequences admitted at once, n > 1 counting n (0: any)
    max_queued: int = 64               # requests held in admission's queue

    def __post_init__(self) -> None:
        _require(self.weight > 0, f"tenant {self.name}: weight must be > 0")
        _require(self.token_rate >= 0 and self.token_burst >= 0,
                 f"tenant {self.name}: token_rate and token_burst must be >= 0")
        _require(self.kv_blocks >= 0 and self.max_running >= 0 and self.max_queued >= 0,
                 f"tenant {self.name}: kv_blocks, max_running and max_queued must be >= 0")


class AdmissionConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, dict=True):
    """``dict=True`` only so the tenant and class tables are indexed once per config
    (``tenant``, ``tenants_by_name``, ``service_classes``: cached; the fields stay
    frozen)."""

    # see components/admission/policy.py; "fcfs" (accept whatever the caps allow) is the
    # baseline the replay and simulator compare against
    policy: Literal["fcfs", "deadline"] = "deadline"
    max_outstanding: int = 512
    max_queued: int = 256              # requests held in admission's queue, all tenants
    output_percentile: float = 90.0    # expected output: this percentile of recent outputs
    kv_safety: float = 0.1             # margin on the expected output's KV reservation
    ttft_headroom: float = 0.2         # accept only if the predicted TTFT is within the
                                       # deadline less this fraction (prediction error)
    classes: tuple[ServiceClass, ...] = SLO_CLASSES   # [] : one class, "default", no SLO
    tenants: tuple[TenantConfig, ...] = (TenantConfig("default"),)
    # the decode horizon (components/admission/live.py): admit a decoding sequence only
    # while the decode step predicted with it stays within the tightest running class's
    # TPOT SLO less tpot_headroom, and none while a running class's measured TPOT is over
    # its SLO; false: only the KV and TTFT checks
    decode_horizon: bool = True
    tpot_headroom: float = 0.2

    def __post_init__(self) -> None:
        _require(self.max_outstanding >= 1, "admission.max_outstanding must be >= 1")
        _require(0 <= self.tpot_headroom < 1, "admission.tpot_headroom must be in [0, 1)")
        _require(self.max_queued >= 0, "admission.max_queued must be >= 0")
        _require(0 < self.output_percentile <= 100, "admission.output_percentile in (0, 100]")
        _require(self.kv_safety >= 0, "admission.kv_safety must be >= 0")
        _require(0 <= self.ttft_headroom < 1, "admission.ttft_headroom must be in [0, 1)")
        names = [t.name for t in self.tenants]
        _require(len(set(names)) == len(names), "admission.tenants has duplicate names")
        classes = [c.name for c in self.classes]
        _require(len(set(classes)) == len(classes), "admission.classes has duplicate names")
        known = set(classes) or {DEFAULT_CLASS.name}
        for t in self.tenants:
            bad = [c for c in (*t.classes, t.default_class) if c and c not in known]
            _require(not bad, f"tenant {t.name}: unknown class {bad[0] if bad else ''!r}")
            _require(not (t.classes and t.default_class) or t.default_class in t.classes,
                     f"tenant {t.name}: default_class is not one of its classes")

    def describe(self) -> str:
        """The policy and the classes in force, one line (the startup log, ``weir status``):
        what a client gets without reading the config reference."""
        parts = []
        for c in self.service_classes().values():
            terms = [f"TTFT {c.ttft_slo_ms:g} ms" if c.ttft_slo_ms else "",
                     f"TPOT {c.tpot_slo_ms:g} ms" if c.tpot_slo_ms else "",
                     f"queues {c.max_queue_ms / 1e3:g} s" if c.max_queue_ms else "no queue",
                     "degradable" if c.may_degrade else "",
                     f"{c.late}s late work" if c.ttft_slo_ms else "",
                     f"ends at {c.e2e_slo_ms:g} ms" if c.e2e_slo_ms else ""]
            parts.append(f"{c.name} ({', '.join(t for t in terms if t)})")
        defaults = sorted({self.allowed_classes(t)[0] for t in self.tenants})
        return (f"{self.policy}; classes {'; '.join(parts)}; "
                f"default class {', '.join(defaults)}")

    def service_classes(self) -> dict[str, ServiceClass]:
        """The classes by name (a config that names none: one, ``default``). Do not
        change the mapping: it is built once per config and shared."""
        return self._classes_by_name

    @cached_property
    def _classes_by_name(self) -> dict[str, ServiceClass]:
        return {c.name: c for c in self.classes} or {DEFAULT_CLASS.name: DEFAULT_CLASS}

    def tenant(self, name: str) -> TenantConfig | None:
        """The configured tenant of this name, or None: the one index of
        ``tenants`` (built on first use)."""
        return self.tenants_by_name.get(name)

    @cached_property
    def tenants_by_name(self) -> dict[str, TenantConfig]:
        """The tenants by name, built once per config (do not change it)."""
        return {t.name: t for t in self.tenants}

    def allowed_classes(self, tenant: TenantConfig) -> list[str]:
        """The tenant's classes, its default first."""
        allowed = list(tenant.classes or self.service_classes())
        default = tenant.default_class or allowed[0]
        return [default] + [c for c in allowed if c != default]


class StreamerConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    client_timeout_s: float = 2.0     # a client silent this long is gone: its requests cancelled
    drain_timeout_s: float = 30.0     # then what still runs fails with drain_timeout
    max_clients_requests: int = 4096
    idempotency_ttl_s: float = 600.0  # how long a finished idempotent result is kept
    # finished idempotent results together, in MiB of their recorded events (the oldest go
    # first past it), and the most one result may hold to be kept at all (an 8k-token echo
    # with top-20 logprobs records ~25 MB: past the cap, its retry runs again)
    idempotency_max_mib: float = 256.0
    idempotency_entry_max_mib: float = 8.0

    def __post_init__(self) -> None:
        _require(self.client_timeout_s > 0, "streamer.client_timeout_s must be > 0")
        _require(self.drain_timeout_s > 0, "streamer.drain_timeout_s must be > 0")
        _require(self.idempotency_ttl_s >= 0, "streamer.idempotency_ttl_s must be >= 0")
        _require(0 <= self.idempotency_entry_max_mib <= self.idempotency_max_mib,
                 "streamer.idempotency_entry_max_mib must be in [0, idempotency_max_mib]")


class ApiKey(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """An API key, stored only as its SHA-256 hex digest (``weir hash-key KEY`` prints it).
    It names a tenant on HTTP and on the ZeroMQ endpoint alike. ``role = "operator"``
    also sees every tenant's usage (status, /metrics)."""

    sha256: str
    tenant: str
    role: Literal["tenant", "operator"] = "tenant"

    def __post_init__(self) -> None:
        _require(len(self.sha256) == 64 and all(c in "0123456789abcdef" for c in self.sha256),
                 "gateway.api_keys[].sha256 must be a lowercase hex SHA-256 digest")


class GatewayConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The OpenAI-compatible HTTP gateway. With no ``api_keys`` everyone is ``default``."""

    enabled: bool = True
    host: str = "127.0.0.1"
    port: int = 8000
    served_model_name: str = ""
    api_keys: tuple[ApiKey, ...] = ()
    max_body_bytes: int = 4 << 20             # larger request bodies get 413
    read_timeout_s: float = 10.0              # from a request's first byte: headers, then body
    # A connection that has sent nothing is closed after first_byte_timeout_s (a client
    # opens one to send a request at once; TLS ends in front of the gateway), or after
    # keepalive_timeout_s when it is kept alive between requests (uvicorn's 5 s, what it had)
    first_byte_timeout_s: float = 2.0
    keepalive_timeout_s: float = 5.0
    stream_stall_timeout_s: float = 30.0      # a client not reading an SSE stream: cancelled
    max_connections: int = 2048               # at it idle connections are shed, then 503
    # Connections one client address may hold (loopback exempt; 0: no cap): past it the new
    # one is closed. 256 is twice what the engine runs at once (scheduler.max_num_seqs), so
    # one client gains nothing past it, and it takes 8 addresses to fill max_connections
    max_connections_per_peer: int = 256
    send_buffer_bytes: int = 262144           # kernel send buffer per connection (0: autotune)

    def __post_init__(self) -> None:
        _require(0 < self.port < 65536, "gateway.port must be a TCP port")
        _require(self.max_body_bytes >= 1024, "gateway.max_body_bytes must be >= 1024")
        _require(min(self.read_timeout_s, self.stream_stall_timeout_s,
                     self.first_byte_timeout_s, self.keepalive_timeout_s) > 0,
                 "gateway timeouts must be > 0")
        _require(self.max_connections >= 1, "gateway.max_connections must be >= 1")
        _require(self.max_connections_per_peer >= 0,
                 "gateway.max_connections_per_peer must be >= 0 (0: no cap)")


class TelemetryConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Traces of every request and every scheduler/admission decision.

    ``exporter``: "none", "otlp" (HTTP/protobuf to ``otlp_endpoint``) or "jsonl" (one span
    per line appended to ``jsonl_path``). The standard ``OTEL_TRACES_EXPORTER``,
    ``OTEL_EXPORTER_OTLP_(TRACES_)ENDPOINT`` and ``OTEL_TRACES_SAMPLER_ARG`` variables
    override these. Prompt and completion text are never recorded unless ``record_content``.
    """

    exporter: Literal["none", "otlp", "jsonl"] = "none"
    otlp_endpoint: str = "http://127.0.0.1:4318/v1/traces"
    jsonl_path: str = ""
    sample_ratio: float = 1.0
    record_content: bool = False
    # the recorded request log (components/admission/request_log.py): one line of lengths
    # and ids per request admission saw, what `weir qualify` replays a candidate on. A
    # path relative to topology.run_dir (none there: off), or absolute; "" turns it off.
    # Past request_log_max_mib the file is renamed NAME.1 and a new one begun. On by
    # default: one small write per request (docs/perf-log.md has its cost)
    request_log: str = "requests.jsonl"
    request_log_max_mib: float = 64.0

    def __post_init__(self) -> None:
        _require(0.0 <= self.sample_ratio <= 1.0, "telemetry.sample_ratio must be in [0, 1]")
        _require(self.request_log_max_mib > 0, "telemetry.request_log_max_mib must be > 0")
        _require(self.exporter != "jsonl" or bool(self.jsonl_path),
                 "telemetry.jsonl_path is required for the jsonl exporter")


class SupervisorConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    heartbeat_interval_s: float = 0.1     # how often a component looks for news to report
    heartbeat_timeout_s: float = 10.0
    # An unchanged heartbeat (same state, stats, tenants) is sent only this often: an idle
    # engine's eight processes woke ~90 times a second to say nothing new (11% of a core)
    heartbeat_keepalive_s: float = 1.0
    restart: Literal["always", "on-failure", "never"] = "on-failure"
    max_restarts: int = 3
    startup_timeout_s: float = 120.0
    # Niceness per component. The executor's OpenMP threads use every core, and one of
    # them being descheduled stalls each parallel region, so the per-token work of the
    # text-path components yields to it (the scheduler stays at 0: it sits between steps).
    # Measured (bench_serving, rate inf, bf16): 247 -> 264 output tok/s at 5. At 15 the
    # gateway's heartbeats starved and the streamer cancelled its requests: keep it small.
    nice: dict[str, int] = msgspec.field(default_factory=lambda: {
        "tokenizer": 5, "admission": 5, "detokenizer": 5, "streamer": 5, "gateway": 5})

    def __post_init__(self) -> None:
        _require(all(0 <= v <= 19 for v in self.nice.values()),
                 "supervisor.nice values must be in 0..19")
        _require(0 < self.heartbeat_interval_s <= self.heartbeat_keepalive_s,
                 "supervisor.heartbeat_keepalive_s must be >= heartbeat_interval_s > 0")
        _require(self.heartbeat_keepalive_s * 3 <= self.heartbeat_timeout_s,
                 "supervisor.heartbeat_timeout_s must be at least 3x heartbeat_keepalive_s "
                 "(an idle component beats only every keepalive)")


class SecurityConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """CURVE on the bus (``bus/curve.py``): with ``curve``, every tcp socket is
    authenticated and encrypted with the keys in ``curve_keys_dir`` (``weir keys generate
    DIR``); ipc stays plain. ``client_curve`` covers the client endpoint too: "auto" unless
    it is bound on loopback, "on" or "off"."""

    curve: bool = False
    curve_keys_dir: str = ""
    client_curve: Literal["auto", "on", "off"] = "auto"

    def __post_init__(self) -> None:
        _require(not self.curve or os.path.isabs(self.curve_keys_dir),
                 "security.curve_keys_dir (an absolute path) is required when security.curve "
                 "is on")


class BusConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The ZeroMQ bus between components. ``max_message_mib`` bounds one message on every
    internal socket (ZeroMQ's MAXMSGSIZE, ``bus/socket.py``): past it a frame is dropped
    unread and its sender's connection reset, so a peer on the bus (reachable over tcp
    when CURVE is off) cannot make a process hold an arbitrary frame. The client endpoints
    have a bound of their own, what a legal request can be
    (``schemas/frames.py``).

    The bound must lie above every legal message. The largest is the detokenizer's
    EventBatch: one step's events, and a request's first delta carries its prompt logprobs.
    Measured: an 8191-token echo at top-20 (SmolLM2's tokens, 6.8 bytes each on average)
    is 3.4 MiB in one delta (16.4 MiB were every token the vocabulary's longest, 81 bytes).
    A step that ends the prefill of 128 such prompts at once (max_num_seqs' default) sends
    440 MiB. Next come the KV events snapshot (~50 bytes per cached block: 20 MB for a
    400k-block pool) and a StepPlan's block tables (a few MB). Hence 512 MiB: raise it
    for longer contexts with many sequences asking for prompt logprobs at once."""

    max_message_mib: int = 512

    def __post_init__(self) -> None:
        _require(1 <= self.max_message_mib <= 4096, "bus.max_message_mib must be in 1..4096")

    @property
    def max_message_bytes(self) -> int:
        return self.max_message_mib << 20


def valid_pool(name: str) -> bool:
    """A pool's name: 1 to 64 of lowercase letters, digits, '-' and '_' (it is a stats key
    and a Kubernetes label value)."""
    return 0 < len(name) <= 64 and all(c.isdigit() or "a" <= c <= "z" or c in "-_"
                                       for c in name)


class ReplicaSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One Weir engine behind the router: its client endpoint, the address its
    kv_manager publishes prefix-cache events on (``topology.kv_events_endpoint`` there),
    and its pool (a label: a canary by pool, ``[rollout] pool``, puts a candidate on the
    replicas of one pool; components/router/pool_canary.py)."""

    name: str
    endpoint: str
    kv_events: str = ""                 # empty: no prefix index for it (load only)
    pool: str = "default"

    def __post_init__(self) -> None:
        _require(bool(self.name) and "/" not in self.name,
                 "router.replicas: a name is required, without '/'")
        _require(valid_pool(self.pool),
                 f"router.replicas[{self.name}].pool must be 1-64 of a-z, 0-9, '-' and '_'")
        _require(self.endpoint.startswith(("tcp://", "ipc://")),
                 f"router.replicas[{self.name}].endpoint must be tcp:// or ipc://")


class RouterWeights(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """How the router blends locality and load (components/router/scoring.py). A replica's
    score is in seconds of time to first token: ``prefix`` × the prefill its cached prefix
    saves − ``queue`` × its predicted queue delay − each pressure fraction (0..1) × its
    weight, which is in seconds: what a full pool, a pool full of active sequences, or a
    replica taken entirely by this tenant is worth against queue delay."""

    prefix: float = 1.0
    queue: float = 1.0
    kv_used: float = 0.05
    active_kv: float = 0.05
    tenant: float = 0.1
    cpu_tier: float = 0.5               # a prefix block on a host-memory tier counts this much

    def __post_init__(self) -> None:
        _require(all(w >= 0 for w in msgspec.structs.astuple(self)),
                 "router.weights must be >= 0")
        _require(self.cpu_tier <= 1, "router.weights.cpu_tier must be <= 1")


class RouterConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """``weir route``: one client endpoint (``topology.client_endpoint``) in front of
    several engines."""

    replicas: tuple[ReplicaSpec, ...] = ()
    policy: Literal["cache_aware", "least_loaded", "round_robin"] = "cache_aware"
    weights: RouterWeights = RouterWeights()
    heartbeat_interval_s: float = 0.25  # heartbeats to each replica (its liveness answer)
    heartbeat_timeout_s: float = 2.0    # silent this long: out, its requests failed
    load_interval_s: float = 0.25       # how often each replica's load report is asked
    # a replica whose predicted TTFT exceeds the deadline (or, without one, this) is
    # overloaded: it gets new work only when every replica is
    overload_ttft_s: float = 2.0
    kv_high: float = 0.95               # ... or whose pool is this full
    # a rejection for load (overloaded, deadline_unmeetable, queue_full, draining) is
    # retried on the next replica, at most this many times: admission's `route`
    reroute_attempts: int = 2
    session_ttl_s: float = 900.0        # an idle session forgets its replica
    max_sessions: int = 100_000
    default_prefill_tokens_per_s: float = 2000.0   # until a replica has measured its own
    # fleet-wide budgets (components/router/budgets.py): each tenant's max_outstanding and
    # token_rate/token_burst, enforced by the router across every replica before it places
    # a request; a tenant not named has none here (its replicas' admission still applies)
    tenants: tuple[TenantConfig, ...] = ()
    # the fleet queue (components/router/fleetq.py): a fresh request no replica can take
    # now (every eligible one overloaded) is held at the router and released least-served
    # tenant first (VTC, weights from ``tenants``) as capacity returns; at most
    # ``fleet_queue_max`` held (and each tenant's ``max_queued``), none past its deadline
    # or ``fleet_queue_max_wait_s``. Off: such a request goes to the least bad replica.
    # The least served tenant's requests pass it (fleetq.FleetQueue.passes): holding them
    # only added the wait for a release (docs/perf-log.md, 2026-12-05)
    fleet_queue: bool = True
    fleet_queue_max: int = 1024
    fleet_queue_max_wait_s: float = 30.0
    # Where replicas come from besides ``replicas`` and ``weir replicas add``: "static"
    # (nowhere else), or "dns": every ``discovery_interval_s`` the router resolves
    # ``discovery_name`` (a headless Service: one A record per pod), names each address by
    # its PTR record's first label (the pod, weir-replica-N), routes to each on
    # ``discovery_port`` (KV events on ``discovery_kv_events_port``, 0: none) once it
    # answers heartbeats, and retires one absent ``discovery_misses`` polls in a row
    # (components/router/discovery.py)
    discovery: Literal["static", "dns"] = "static"
    discovery_name: str = ""
    discovery_port: int = 7450
    discovery_kv_events_port: int = 7470
    discovery_interval_s: float = 2.0
    discovery_misses: int = 3
    # one name per pool under discovery "dns": pool -> the headless Service that resolves
    # to that pool's replicas (each found there is labelled with the pool; ``discovery_name``
    # is the pool "default"'s and may then be empty)
    discovery_pools: dict[str, str] = {}
    # where the router keeps its live config versions (weir config; components/router/
    # live_config.py) so that a restarted router goes on with them: "" is
    # router_config_history.jsonl in topology.run_dir (kept across a restart of the router
    # process; a pod mounts a volume and names a file on it)
    config_history: str = ""

    def __post_init__(self) -> None:
        tenants = [t.name for t in self.tenants]
        _require(len(set(tenants)) == len(tenants), "router.tenants has duplicate names")
        names = [r.name for r in self.replicas]
        _require(len(set(names)) == len(names), "router.replicas: names must be unique")
        _require(all(valid_pool(p) and n for p, n in self.discovery_pools.items()),
                 "router.discovery_pools: pool -> a DNS name, each pool 1-64 of a-z, 0-9, "
                 "'-' and '_'")
        _require(self.discovery == "static" or bool(self.discovery_name)
                 or bool(self.discovery_pools),
                 "router.discovery = \"dns\" needs router.discovery_name (the headless "
                 "Service's DNS name)")
        _require(0 < self.discovery_port < 65536 and 0 <= self.discovery_kv_events_port < 65536,
                 "router.discovery ports must be in 1..65535 (kv events: 0 for none)")
        _require(self.discovery_interval_s > 0 and self.discovery_misses >= 1,
                 "router.discovery_interval_s must be > 0 and discovery_misses >= 1")
        _require(self.heartbeat_interval_s > 0 and self.load_interval_s > 0,
                 "router intervals must be > 0")
        _require(self.heartbeat_timeout_s > self.heartbeat_interval_s,
                 "router.heartbeat_timeout_s must exceed heartbeat_interval_s")
        _require(0 < self.kv_high <= 1, "router.kv_high must be in (0, 1]")
        _require(self.reroute_attempts >= 0, "router.reroute_attempts must be >= 0")
        _require(self.fleet_queue_max >= 1 and self.fleet_queue_max_wait_s > 0,
                 "router.fleet_queue_max must be >= 1 and fleet_queue_max_wait_s > 0")
        _require(self.default_prefill_tokens_per_s > 0,
                 "router.default_prefill_tokens_per_s must be > 0")


class SpeculativeConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Speculative decoding, decided per step by the scheduler (components/scheduler/
    speculation.py): each running sequence gets k draft tokens, 0..``max_k``, where the
    expected accepted tokens per second of step time beat plain decoding for the batch.

    ``method``: "off"; "ngram" (prompt lookup: the continuation of the longest recent
    match of the sequence's last ``ngram_max``..``ngram_min`` tokens in its own prompt and
    output; no second model); "draft" (a smaller model with the same tokenizer, run in the
    executor on its own KV tensors indexed by the target's block tables). ``draft_model``:
    its path or name ("" = the served model); ``draft_layers``: run only its first N layers
    and its head (0: all). ``acceptance_prior``: per-token acceptance assumed for a class
    before any of its drafts are verified; ``class_priors`` sets it per class."""

    # on by default: under the scheduler's control it lowered TPOT p50 2.1-2.3x at low load
    # on copy-heavy prompts and did not cost throughput at rate inf (docs/perf-log.md)
    method: Literal["off", "ngram", "draft"] = "ngram"
    max_k: int = 4
    # "scheduler": k per sequence per step by the rule above; "fixed": every decode row
    # drafts max_k, whatever the load (vLLM's and SGLang's static flag; for comparison)
    control: Literal["scheduler", "fixed"] = "scheduler"
    ngram_min: int = 2
    ngram_max: int = 4
    draft_model: str = ""
    draft_dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    draft_layers: int = 0
    acceptance_prior: float = 0.5
    class_priors: dict[str, float] = {}

    def __post_init__(self) -> None:
        _require(0 <= self.max_k <= 16, "speculative.max_k must be in [0, 16]")
        _require(1 <= self.ngram_min <= self.ngram_max <= 16,
                 "speculative.ngram_min and ngram_max must satisfy 1 <= min <= max <= 16")
        _require(self.draft_layers >= 0, "speculative.draft_layers must be >= 0")
        _require(all(0.0 <= a < 1.0 for a in (self.acceptance_prior,
                                              *self.class_priors.values())),
                 "speculative acceptance priors must be in [0, 1)")

    @property
    def on(self) -> bool:
        return self.method != "off" and self.max_k > 0


class RolloutConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """How a candidate config is judged before and while it replaces the running one. A
    candidate carries its own ``[rollout]``: the bars it must clear.

    Qualification (``weir qualify``, weir/replay/qualify.py): the candidate and the config
    it would replace run through the simulator on recorded traffic, each request judged in
    the class the current config gives it; every limit is checked, ``None`` turns one off:

    - ``max_goodput_drop``: goodput (share of arrived requests within their SLO) may fall
      at most this far below the current's (absolute, 0.02 = two points);
    - ``max_class_miss_increase``: in each class, the share of requests that missed their
      SLO (rejected ones included) may rise at most this far above the current's;
    - ``max_class_miss_rate``: class -> the most of that class that may miss ("*": any
      class not named);
    - ``max_starvation_increase_s``: in each class, the longest wait (arrival to first
      scheduled, or to its end for one never scheduled) may grow at most this much;
      ``max_starvation_s``: the longest wait in any class, at most this;
    - ``max_fairness_gap_increase``: the largest service gap between backlogged tenants
      (VTC's measure, weighted tokens) may grow at most this fraction over the current's;
      ``max_fairness_gap``: at most this many weighted tokens;
    - ``max_cost_increase``: busy time (seconds with a step in flight) may grow at most
      this fraction over the current's.

    Shadow and canary (``components/admission/rollout.py``, the streamer's
    ``watchdog.py``): ``mode`` "off" applies the candidate at once; "shadow" keeps the
    policy in force and has admission decide every request by the candidate too, beside
    it, recording what it would have done (nothing enforced); "canary" has the candidate's
    admission decide for the tenants whose name hashes under ``share``
    (``components/tenancy/canary.py``: sticky) while the watchdog compares them with the
    rest over the last ``window_s``: a class's deadline-miss rate, the longest wait to a
    first token, the rejection rate, decisions flipping for one tenant and class, and the
    tokens computed per good token. Past any ``max_*`` (once each side has
    ``min_requests`` in the window) it rolls the candidate back; after
    ``promote_after_s`` with none crossed and ``min_requests`` canary requests ended, it
    promotes it. Either is a new version by the actor ``watchdog``. A candidate's
    scheduler and speculative sections take effect at its promotion (the scheduler runs
    one batch: it has no per-tenant policy to canary)."""

    # -- qualification on recorded traffic (weir qualify)
    max_goodput_drop: float | None = 0.02
    max_class_miss_increase: float | None = 0.05
    max_class_miss_rate: dict[str, float] = {}
    max_starvation_increase_s: float | None = 2.0
    max_starvation_s: float | None = None
    max_fairness_gap_increase: float | None = 0.5
    max_fairness_gap: float | None = None
    max_cost_increase: float | None = 0.10

    # -- shadow decisions and canaries (the engine's admission and the watchdog)
    mode: Literal["off", "shadow", "canary"] = "off"
    share: float = 0.1
    window_s: float = 30.0
    min_requests: int = 10
    max_miss_rate_increase: float = 0.10      # a class's misses ÷ ended, canary less baseline
    max_reject_rate_increase: float = 0.20    # rejections ÷ decisions, canary less baseline
    max_wait_increase_s: float = 5.0          # a class's longest wait, canary less baseline
    max_flip_rate_increase: float = 0.25      # admit/reject flips ÷ decisions, the same
    max_cost_ratio: float = 1.5               # computed ÷ good tokens, canary over baseline
    promote_after_s: float = 300.0
    # a canary by replica pool: "" (the engine's canary, by tenant share), or the pool whose
    # replicas a router puts the candidate on while its other pools keep the running config
    # (applied to the router: components/router/pool_canary.py)
    pool: str = ""

    def __post_init__(self) -> None:
        _require(0 < self.share <= 1, "rollout.share must be in (0, 1]")
        _require(self.pool == "" or (valid_pool(self.pool) and self.mode == "canary"),
                 "rollout.pool names a replica pool (1-64 of a-z, 0-9, '-' and '_') and "
                 "goes with mode = \"canary\"")
        _require(self.window_s > 0 and self.promote_after_s > 0,
                 "rollout.window_s and rollout.promote_after_s must be > 0")
        _require(self.min_requests >= 1, "rollout.min_requests must be >= 1")
        _require(min(self.max_miss_rate_increase, self.max_reject_rate_increase,
                     self.max_wait_increase_s, self.max_flip_rate_increase) >= 0
                 and self.max_cost_ratio >= 1,
                 "rollout.max_* increases must be >= 0 and max_cost_ratio >= 1")
        limits = {"max_goodput_drop": self.max_goodput_drop,
                  "max_class_miss_increase": self.max_class_miss_increase,
                  "max_starvation_increase_s": self.max_starvation_increase_s,
                  "max_starvation_s": self.max_starvation_s,
                  "max_fairness_gap_increase": self.max_fairness_gap_increase,
                  "max_fairness_gap": self.max_fairness_gap,
                  "max_cost_increase": self.max_cost_increase}
        for name, value in limits.items():
            _require(value is None or value >= 0, f"rollout.{name} must be >= 0")
        _require(all(0.0 <= v <= 1.0 for v in self.max_class_miss_rate.values()),
                 "rollout.max_class_miss_rate values must be in [0, 1]")


class WeirConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    topology: Topology
    engine: EngineConfig = EngineConfig()
    scheduler: SchedulerConfig = SchedulerConfig()
    kv: KvConfig = KvConfig()
    admission: AdmissionConfig = AdmissionConfig()
    streamer: StreamerConfig = StreamerConfig()
    supervisor: SupervisorConfig = SupervisorConfig()
    gateway: GatewayConfig = GatewayConfig()
    telemetry: TelemetryConfig = TelemetryConfig()
    security: SecurityConfig = SecurityConfig()
    router: RouterConfig = RouterConfig()
    speculative: SpeculativeConfig = SpeculativeConfig()
    rollout: RolloutConfig = RolloutConfig()
    bus: BusConfig = BusConfig()
    log_level: Literal["debug", "info", "warning", "error"] = "info"

    def __post_init__(self) -> None:
        # a pool given in GiB is checked where its blocks are known
        # (components.model.kv_sizing.sized)
        _require(self.kv.memory_gib > 0
                 or self.engine.max_model_len <= self.kv.num_blocks * self.kv.block_size,
                 "engine.max_model_len exceeds the KV pool (kv.num_blocks * kv.block_size)")
        det = [c.name for c in self.admission.classes if c.deterministic]
        _require(not det or self.engine.deterministic != "off",
                 f"admission.classes {', '.join(det)} set deterministic = true, but "
                 f"engine.deterministic is \"off\"")


def deterministic_chunk(sched: SchedulerConfig, block_size: int) -> int:
    """The chunk a deterministic prompt is computed in: ``scheduler.deterministic_chunk``
    taken down to a multiple of the KV block size (so a prefix-cache hit can end on a
    boundary) and to the step's token budget, and at least one block."""
    fits = min(sched.deterministic_chunk, sched.max_num_batched_tokens)
    return max(fits // block_size, 1) * block_size


def load_config(path: str | os.PathLike[str] | None = None,
                **overrides: dict[str, Any]) -> WeirConfig:
    """Build a config from defaults, an optional TOML file, then section overrides.

    ``overrides`` maps a section name to a dict of fields, e.g. ``engine={"dtype": "bfloat16"}``.
    """
    raw: dict[str, Any] = {}
    if path is not None:
        try:
            raw = msgspec.toml.decode(Path(path).read_bytes())
        except (OSError, msgspec.DecodeError) as exc:
            raise ConfigError(f"cannot read config {path}: {exc}") from exc
    for section, values in overrides.items():
        if isinstance(values, dict):
            raw.setdefault(section, {}).update({k: v for k, v in values.items() if v is not None})
        elif values is not None:
            raw[section] = values
    raw.setdefault("topology", {})
    try:
        return msgspec.convert(raw, WeirConfig)
    except msgspec.ValidationError as exc:
        raise ConfigError(f"invalid config: {exc}") from exc
