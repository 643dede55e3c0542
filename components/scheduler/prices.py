"""What moving KV costs against computing it again: the step-cost model's prefill estimate
(``recompute_s``) and the host tier's measured copy bandwidth. The preemptor chooses
recompute or swap on these; the lease book asks whether promoting a host-tier prefix block
pays. Owns the executor's reported block size in bytes and copy bandwidth (0 until it
reports in); the cost model itself belongs to the core, which the loop teaches."""
from __future__ import annotations

import math
from collections.abc import Callable

from components.costs.cost_model import StepCostModel, prefill_shape
from components.scheduler.sequence import Seq


class Prices:
    def __init__(self, cost: StepCostModel, block_size: int) -> None:
        self.cost = cost
        self.block_size = block_size
        self.block_bytes = 0                    # set when the executor reports in
        self.copy_bytes_per_s = 0.0
        self.recompute_s: Callable[[int], float] = \
            lambda tokens: self.cost.predict(prefill_shape(tokens))   # prefill estimate

    def costs(self, seq: Seq) -> tuple[float, float]:
        """Estimated seconds to recompute ``seq``'s computed tokens, and to swap its blocks
        out and back in (bytes / measured host-copy bandwidth, both ways)."""
        blocks = -(-seq.num_computed // self.block_size)
        swap_s = (2 * blocks * self.block_bytes / self.copy_bytes_per_s
                  if self.copy_bytes_per_s > 0 else math.inf)
        return self.recompute_s(seq.num_computed), swap_s

    def promote_pays(self) -> bool:
        """Is copying a host-tier prefix block back cheaper than recomputing its tokens?
        Until both are measured, assume so (a copy is a memcpy; recompute is a forward)."""
        recompute_s = self.recompute_s(self.block_size)
        if self.copy_bytes_per_s <= 0 or recompute_s <= 0:
            return True
        return self.block_bytes / self.copy_bytes_per_s < recompute_s
