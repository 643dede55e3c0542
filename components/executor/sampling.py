"""Token sampling: greedy, temperature, top-k, top-p, with per-request seeded determinism.

Sampling uses the exponential race: ``argmax_v p_v / E_v`` with ``E_v ~ Exponential(1)``
draws ``v`` with probability ``p_v``. For a seeded row the noise comes from a generator
seeded by ``(seed, output_index)`` alone, so its draw is independent of the batch.
"""
from __future__ import annotations

import torch

_MASK64 = (1 << 64) - 1
_process_generator: torch.Generator | None = None


def _mix(seed: int, index: int) -> int:
    """SplitMix64-style hash of ``(seed, index)`` to a 63-bit generator seed."""
    x = (seed * 0x9E3779B97F4A7C15 + index * 0xD1B54A32D192ED03 + 0x632BE59BD9B4E019) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (x ^ (x >> 31)) >> 1


def seed_process_generator(seed: int) -> None:
    """Re-seed the generator used for rows without a seed (tests, reproducible runs)."""
    global _process_generator
    _process_generator = torch.Generator().manual_seed(seed)


def _exponential_noise(rows: int, vocab: int, seeds: list[int | None],
                       output_index: list[int]) -> torch.Tensor:
    global _process_generator
    if _process_generator is None:
        _process_generator = torch.Generator()
        _process_generator.seed()
    noise = torch.empty(rows, vocab)
    unseeded = [i for i, s in enumerate(seeds) if s is None]
    if unseeded:
        noise[unseeded] = torch.empty(len(unseeded), vocab).exponential_(
            generator=_process_generator)
    for i, s in enumerate(seeds):
        if s is not None:
            g = torch.Generator().manual_seed(_mix(s, output_index[i]))
            noise[i].exponential_(generator=g)
    return noise.clamp_min_(torch.finfo(torch.float32).tiny)


def _filtered_log_probs(logits: torch.Tensor, top_p: torch.Tensor,
                        top_k: torch.Tensor) -> torch.Tensor:
    """Log-probabilities with tokens outside top-k / the top-p nucleus set to -inf."""
    vocab = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1, descending=True, stable=True)
    rank = torch.arange(vocab, device=logits.device)
    k = torch.where((top_k <= 0) | (top_k > vocab), vocab, top_k)
    drop = rank[None, :] >= k[:, None]
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    before = probs.cumsum(dim=-1) - probs
    drop |= (before >= top_p[:, None]) & (rank[None, :] > 0) & (top_p[:, None] < 1.0)
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    filtered = torch.empty_like(logits).scatter_(-1, order, sorted_logits)
    return filtered.log_softmax(dim=-1)


def sample(logits: torch.Tensor, temperature: list[float], top_p: list[float],
           top_k: list[int], seeds: list[int | None], output_index: list[int]) -> torch.Tensor:
    """Pick one token per row of ``logits`` ``[S, vocab]``; returns a ``[S]`` long tensor.

    Row ``i`` uses ``temperature[i]`` (0 means greedy argmax), ``top_k[i]`` (0 = off),
    ``top_p[i]`` (1.0 = off) and, when ``seeds[i]`` is not None, noise that depends only
    on ``(seeds[i], output_index[i])`` -- the number of the output token being drawn.
    Top-k is applied first, then top-p on the renormalised survivors.
    """
    rows, vocab = logits.shape
    out = logits.argmax(dim=-1)
    temp = torch.tensor(temperature, dtype=torch.float32)
    rand = (temp > 0).nonzero()[:, 0].tolist()
    if not rand:
        return out
    x = logits[rand].float().cpu() / temp[rand, None]
    p = torch.tensor([top_p[i] for i in rand], dtype=torch.float32)
    k = torch.tensor([top_k[i] for i in rand], dtype=torch.long)
    if bool((p < 1.0).any()) or bool(((k > 0) & (k < vocab)).any()):
        log_probs = _filtered_log_probs(x, p, k)
    else:
        log_probs = x.log_softmax(dim=-1)
    noise = _exponential_noise(len(rand), vocab, [seeds[i] for i in rand],
                               [output_index[i] for i in rand])
    picked = (log_probs - noise.log()).argmax(dim=-1)
    out[torch.tensor(rand, device=out.device)] = picked.to(out.device)
    return out
