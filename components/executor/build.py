"""A model from its weights in two steps: plan the kernels on this machine
(:func:`components.executor.autotune.plan_kernels`), then build the model on that plan.
The executor's service, the tests and the scripts build their models here."""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch

from components.executor.autotune import plan_kernels
from components.executor.model import LlamaModel
from kernels import AttentionBackend

if TYPE_CHECKING:
    from schemas.model import ModelSpec


def build_model(spec: ModelSpec, weights: dict[str, torch.Tensor],
                dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                backend: AttentionBackend | str = "auto", kv_block_size: int | None = None,
                kernels: dict[str, str] | None = None, tuning_cache: Path | None = None,
                max_tokens: int = 2048, max_seqs: int = 256,
                kv_dtype: torch.dtype | None = None) -> LlamaModel:
    """The model of ``spec`` and ``weights`` on the plan measured here for its shapes and
    ``dtype``: ``kernels`` forces some choices (``{"linear": "onednn", ...}``),
    ``tuning_cache`` keeps the measurement per machine (None: measure, keep nothing),
    ``max_tokens`` and ``max_seqs`` bound the step sizes timed, and ``backend`` given by
    name is the plan's attention ("auto": measured on the CPU). ``kv_dtype``: the KV
    cache's element type when it is not the model's (fp8)."""
    device = torch.device(device)
    plan = plan_kernels(spec, dtype, device, kernels,
                        backend if isinstance(backend, str) else "auto", tuning_cache,
                        max_tokens, max_seqs, kv_block_size, kv_dtype or dtype)
    return LlamaModel(spec, weights, plan=plan, dtype=dtype, device=device, backend=backend,
                      kv_block_size=kv_block_size, kv_dtype=kv_dtype)
