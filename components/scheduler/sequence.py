"""A sequence as the scheduler sees it: tokens, progress and leased blocks."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

from schemas.wire import SamplingParams


class Phase(enum.Enum):
    WAITING = "waiting"        # no blocks yet (allocation may be in flight)
    READY = "ready"            # initial blocks granted, not yet scheduled
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
