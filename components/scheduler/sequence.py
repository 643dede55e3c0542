"""A sequence as the scheduler sees it: tokens, progress and leased blocks."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

from schemas.wire import SamplingParams


class Phase(enum.Enum):
    WAITING = "waiting"        # no blocks yet (allocation may be in flight)
    READY = "ready"            # initial blocks granted, not yet scheduled
    SWAPPED = "swapped"        # preempted to the host tier; waits to be swapped back in
    RUNNING = "running"
    DONE = "done"


@dataclass(eq=False)
class Seq:
    seq_id: int
    request_id: str
    tenant: str
    params: SamplingParams
    prompt_len: int
    token_ids: list[int]
    block_hashes: list[int]
    arrival_ns: int
    eos_token_ids: frozenset[int]
    phase: Phase = Phase.WAITING
    num_computed: int = 0
    block_ids: list[int] = field(default_factory=list)
    blocks_sent: int = 0           # how many of block_ids the executor already knows
    pending_blocks: int = 0        # requested from the kv_manager, not yet granted
    alloc_denied: bool = False
    frees_at_request: int = 0      # the core's free count when the first lease was asked
    grow_denied: bool = False
    known_to_executor: bool = False
    cached_tokens: int = 0
    outputs_sent: int = 0          # output tokens already handed to the detokenizer
    preemptions: int = 0
    first_scheduled_ns: int = 0
    first_token_ns: int = 0
    index: int = 0                 # which of the request's n choices
    priority: int = 0              # lower is more important
    tpot_slo_s: float | None = None  # its class's time-per-output-token objective
    public_scope: str = ""
    public_blocks: int = 0
    forked: bool = False           # n > 1: the first sample (and the fork) happened
    has_lease: bool = False        # the kv_manager holds a lease under seq_id
    group: list["Seq"] = field(default_factory=list)   # every choice of the request

    @property
    def n(self) -> int:
        return self.params.n

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output(self) -> int:
        return len(self.token_ids) - self.prompt_len

    @property
    def remaining(self) -> int:
        return len(self.token_ids) - self.num_computed

    def capacity(self, block_size: int) -> int:
        return len(self.block_ids) * block_size
