"""Token sampling: greedy, temperature, top-k, top-p, with per-request seeded determinism.

Sampling inverts the CDF: one uniform ``u`` per row picks the first token whose cumulative
probability reaches ``u`` times the total. That costs one cumsum and a binary search per
row (a few ms for 64 rows over a 49k vocabulary, where a full-vocabulary noise draw cost
~70 ms). For a seeded row ``u`` is a hash of ``(seed, output_index)`` alone, so its draw is
independent of the batch and of preemption.

On the CPU the draw runs natively (kernels/csrc/cpu_sampling.cpp) with the same semantics;
64 rows of SmolLM2's logits at T 0.8, top-p 0.9, whole call, on a 2-core AVX2 EPYC: 6.3 ms
native against 35 ms in torch (T 1, unfiltered: 5.9 against 15). The torch path below is
the fallback and the GPU path.
"""
from __future__ import annotations

import math
import os
from typing import TYPE_CHECKING

import numpy as np
import torch

from kernels import cpu_native, native_lib

if TYPE_CHECKING:
    from schemas.wire import Penalties, SampleLogprobs

_MASK64 = (1 << 64) - 1


# The native CPU sampler (kernels/csrc/cpu_sampling.cpp), or None: no compiler, or
# WEIR_NATIVE_SAMPLING=0.
_native = (cpu_native if os.environ.get("WEIR_NATIVE_SAMPLING", "1") != "0"
           and native_lib.available() else None)
_process_generator: torch.Generator | None = None


def _mix(seed: int, index: int) -> int:
    """SplitMix64-style hash of ``(seed, index)`` to a 63-bit generator seed. Any Python
    int is taken modulo 2^64 first (negative seeds, ``seed + k`` past 2^63), so no seed
    can overflow anything."""
    seed, index = seed & _MASK64, index & _MASK64
    x = (seed * 0x9E3779B97F4A7C15 + index * 0xD1B54A32D192ED03 + 0x632BE59BD9B4E019) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (x ^ (x >> 31)) >> 1


def seed_process_generator(seed: int) -> None:
    """Re-seed the generator used for rows without a seed (tests, reproducible runs)."""
    global _process_generator
    _process_generator = torch.Generator().manual_seed(seed)


def _uniforms(n: int) -> torch.Tensor:
    """One uniform in (0, 1] per row, from the process generator (the unseeded rows')."""
    global _process_generator
    if _process_generator is None:
        _process_generator = torch.Generator()
        _process_generator.seed()
    return 1.0 - torch.rand(n, generator=_process_generator)


def _keys(seeds: list[int | None], output_index: list[int]) -> torch.Tensor:
    """Each row's race key: hashed from (seed, index) for a seeded row, -1 for another."""
    return torch.tensor([-1 if s is None else _mix(s, i) for s, i in zip(seeds, output_index)],
                        dtype=torch.int64)


_M32 = 0xFFFFFFFF


def _mul32(h: torch.Tensor, c: int) -> torch.Tensor:
    """``h * c mod 2^32`` for h in [0, 2^32), in halves that fit an int64 (no overflow)."""
    return (h * (c & 0xFFFF) + (((h * (c >> 16)) & _M32) << 16)) & _M32


def _race_uniforms(keys: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Seeded rows' uniforms in (0, 1) per token (``keys`` [R], ``tokens`` [R, W]): the
    native sampler's race_uniform, bit for bit (kernels/csrc/cpu_sampling.cpp)."""
    key = ((keys ^ (keys >> 32)) & _M32)[:, None].to(tokens.device)
    h = (key + _mul32(tokens, 0x9E3779B1)) & _M32
    h = h ^ (h >> 16)
    h = _mul32(h, 0x85EBCA6B)
    h = h ^ (h >> 13)
    h = _mul32(h, 0xC2B2AE35)
    return _hash_uniform(h ^ (h >> 16))


def _hash_uniform(h: torch.Tensor) -> torch.Tensor:
    """A 32-bit hash's top 23 bits at their midpoint: 2^-24 .. 1 - 2^-24, exact in float32
    (24 bits would round the top one to 1.0, where -log u is 0 and that token's score
    infinite, whatever its probability)."""
    return ((h >> 9).float() + 0.5) * (1.0 / 8388608.0)


def _pick(kept: torch.Tensor, u: torch.Tensor, keys: torch.Tensor,
          tokens: torch.Tensor | None = None) -> torch.Tensor:
    """A position per row of ``kept`` [R, W] (each token's probability, 0 where filtered
    out; ``tokens`` their ids, None: the positions): a seeded row (key >= 0) by the
    exponential race (Gumbel-max: the highest log p - log(-log u), u hashed per token from
    the key, wins; see the native race()), another by the inverse-CDF draw at ``u``."""
    out = torch.empty(kept.shape[0], dtype=torch.long, device=kept.device)
    seeded = keys >= 0
    if bool((~seeded).any()):
        free = (~seeded).nonzero()[:, 0]
        out[free] = _draw(kept[free].cumsum(dim=-1), u[free])
    if bool(seeded.any()):
        at = seeded.nonzero()[:, 0]
        ids = (tokens[at] if tokens is not None else
               torch.arange(kept.shape[1], device=kept.device).expand(len(at), -1))
        race_u = _race_uniforms(keys[at], ids)
        out[at] = (kept[at].log() - (-race_u.log()).log()).argmax(dim=-1)
    return out


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


_CANDIDATES = 1024


def _draw(cdf: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF draw per row: the first index whose cumulative mass reaches u * total."""
    target = (u * cdf[:, -1]).unsqueeze(1)
    return torch.searchsorted(cdf, target).squeeze(1).clamp_(max=cdf.shape[1] - 1)


def _filtered_draw(x: torch.Tensor, p: torch.Tensor, k: torch.Tensor,
                   u: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """Top-k then top-p draw. Works on the top ``_CANDIDATES`` tokens when the filtered set
    provably lies inside them (top-k within it, or that slice already holds top_p of the
    mass); only other rows pay for a full-vocabulary sort."""
    rows, vocab = x.shape
    probs = x.softmax(dim=-1)
    kk = torch.where((k <= 0) | (k > vocab), vocab, k)
    width = min(vocab, max(_CANDIDATES,
                           int(kk[kk < vocab].max()) if bool((kk < vocab).any()) else 0))
    vals, idx = probs.topk(width, dim=-1)
    inside = (kk <= width) | (vals.sum(dim=-1) >= p)
    out = torch.empty(rows, dtype=torch.long)
    if bool(inside.any()):
        sel = inside.nonzero()[:, 0]
        at = _pick(_nucleus(vals[sel], p[sel], kk[sel], vocab), u[sel], keys[sel], idx[sel])
        out[sel] = idx[sel].gather(1, at.unsqueeze(1)).squeeze(1)
    if not bool(inside.all()):
        sel = (~inside).nonzero()[:, 0]
        out[sel] = _pick(_filtered_log_probs(x[sel], p[sel], k[sel]).exp_(), u[sel], keys[sel])
    return out


def _nucleus(sorted_probs: torch.Tensor, p: torch.Tensor, kk: torch.Tensor,
             vocab: int) -> torch.Tensor:
    """The top candidates' probabilities (descending, of the full softmax), 0 where top-k
    and top-p filter them out. Top-p is measured against the top-k survivors' mass, or, with
    no top-k, the whole vocabulary's (1), not just the candidates'."""
    rank = torch.arange(sorted_probs.shape[1])
    kept = sorted_probs.masked_fill(rank[None, :] >= kk[:, None], 0.0)
    total = torch.where(kk[:, None] < vocab, kept.sum(dim=-1, keepdim=True),
                        torch.ones_like(kept[:, :1]))
    before = (kept.cumsum(dim=-1) - kept) / total
    drop = (before >= p[:, None]) & (rank[None, :] > 0) & (p[:, None] < 1.0)
    return kept.masked_fill_(drop, 0.0)


def _top_k(k: int, vocab: int) -> int:
    """``top_k`` as the samplers take it: 0 (off) unless 0 < k < vocab, so any Python int
    (2^63 and past, negative) fits an int64 and means what it says."""
    return k if 0 < k < vocab else 0


class RowPenalties:
    """A sequence's ``Penalties`` as the executor applies them: values validation would
    have refused (not finite, a repetition penalty <= 0) dropped once, never spread into
    a row of NaNs, and the distinct tokens of its prompt kept after the first step (a
    prompt does not change), so a step pays only for the output's tokens.

    ``carried``: the last tokens of the prompt that are output already emitted (a
    migrated stream's continuation, ``SamplingParams.output_offset``): presence and
    frequency count them as the output they are; ``min_tokens`` (already less them)
    counts the new output alone."""

    __slots__ = ("presence", "frequency", "repetition", "bias_ids", "bias", "min_tokens",
                 "stop_ids", "carried", "_prompt", "_out")

    def __init__(self, pen: Penalties, carried: int = 0) -> None:
        self.carried = carried
        self.repetition = pen.repetition if 0 < pen.repetition < math.inf else 1.0
        ok = math.isfinite(pen.frequency + pen.presence)
        self.frequency, self.presence = (pen.frequency, pen.presence) if ok else (0.0, 0.0)
        bias = [(t, b) for t, b in pen.bias if math.isfinite(b)]
        self.bias_ids, self.bias = [t for t, _ in bias], [b for _, b in bias]
        self.min_tokens, self.stop_ids = pen.min_tokens, pen.stop_ids
        self._prompt: torch.Tensor | None = None
        self._out = torch.empty(0, dtype=torch.long)

    def prompt_seen(self, token_ids: list[int], prompt_len: int, vocab: int) -> torch.Tensor:
        """The distinct tokens of the prompt (in the vocabulary), computed once."""
        if self._prompt is None:
            ids = torch.tensor(token_ids[:prompt_len], dtype=torch.long).unique()
            self._prompt = ids[(ids >= 0) & (ids < vocab)]
        return self._prompt

    def output(self, token_ids: list[int], prompt_len: int) -> torch.Tensor:
        """The output's tokens (the carried ones first) as a tensor, extended by the tokens
        since the last call."""
        start = prompt_len - min(self.carried, prompt_len)
        have, n = self._out.numel(), len(token_ids) - start
        if n > have:
            self._out = torch.cat([self._out, torch.tensor(token_ids[start + have:],
                                                           dtype=torch.long)])
        return self._out[:n]


    def ahead(self, token_ids: list[int], prompt_len: int, tokens: list[int]) -> RowPenalties:
        """These penalties for the sequence with ``tokens`` appended (a speculating row's
        drafts before the position it samples), leaving this one's kept output as it is."""
        other = RowPenalties.__new__(RowPenalties)
        for name in self.__slots__:
            setattr(other, name, getattr(self, name))
        other._out = torch.cat([self.output(token_ids, prompt_len),
                                torch.tensor(tokens, dtype=torch.long)])
        return other


def apply_penalties(logits: torch.Tensor,
                    rows: list[tuple[int, list[int], int, RowPenalties]]) -> None:
    """Adjust float32 ``logits`` ``[S, vocab]`` in place, before any sampling (greedy too),
    for each ``(row, token_ids, prompt_len, penalties)``: ``token_ids`` is the sequence so
    far, its first ``prompt_len`` the prompt. In this order: the repetition penalty over
    every distinct token of prompt and output (HF's: a positive logit divided by it, a
    negative one multiplied); then, over the output's tokens, minus ``frequency`` times
    each one's count and minus ``presence`` once (vLLM's and OpenAI's); then plus each
    ``bias``; then, while the output is shorter than ``min_tokens``, ``stop_ids`` to
    -inf (a bias cannot bring them back). Ids outside the vocabulary are skipped, so no row
    can fail the batch. Each of the three is one set of tensor ops over every row at once,
    on flat indices ``row * vocab + token``: 64 rows of 300 tokens, all three on every row,
    cost 20.7 ms one row at a time and ~4 ms so; a batch-64 decode step with them on every
    sequence +3.3 ms over 172 (2-core AVX2 EPYC;
    ``scripts/run bench/step --penalties 64``)."""
    with torch.inference_mode():       # the forward's logits are inference tensors
        x = logits if logits.is_contiguous() else logits.contiguous()
        _apply_penalties(x, rows)
        if x is not logits:
            logits.copy_(x)


def _outputs(rows, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Every output token of ``rows`` (in the vocabulary; repeats kept), as flat indices
    ``row * vocab + token``, and each one's row."""
    outs = [pen.output(ids, pl) for _, ids, pl, pen in rows]
    tok = torch.cat(outs)
    row = torch.tensor([r for r, *_ in rows]).repeat_interleave(
        torch.tensor([o.numel() for o in outs]))
    keep = (tok >= 0) & (tok < vocab)
    return (row * vocab + tok)[keep], row[keep]


def _apply_penalties(logits: torch.Tensor,
                     rows: list[tuple[int, list[int], int, RowPenalties]]) -> None:
    # No unique() (a sort: most of the time when it was here): a token repeated in the
    # index reads the same logit and writes the same value, so assignment is idempotent
    # over repeats, and the frequency penalty is one index_add_ that counts them.
    n_rows, vocab = logits.shape
    flat, dev = logits.view(-1), logits.device
    per_row = lambda pick, sel: torch.tensor([pick(r[3]) for r in sel], dtype=logits.dtype)
    rep = [r for r in rows if r[3].repetition != 1.0]
    if rep:
        keys = torch.cat([_outputs(rep, vocab)[0]] + [pen.prompt_seen(ids, pl, vocab) + r * vocab
                                                      for r, ids, pl, pen in rep]).to(dev)
        factor = torch.ones(n_rows, dtype=logits.dtype)
        factor[[r for r, *_ in rep]] = per_row(lambda p: p.repetition, rep)
        f = factor.to(dev)[keys // vocab]
        v = flat[keys]
        flat[keys] = torch.where(v > 0, v / f, v * f)
    fp = [r for r in rows if r[3].frequency or r[3].presence]
    if fp:
        keys, row = _outputs(fp, vocab)
        keys = keys.to(dev)
        at = [r for r, *_ in fp]
        pres = torch.zeros(n_rows, dtype=logits.dtype)
        pres[at] = per_row(lambda p: p.presence, fp)
        flat[keys] = flat[keys] - pres[row].to(dev)
        freq = torch.zeros(n_rows, dtype=logits.dtype)
        freq[at] = per_row(lambda p: p.frequency, fp)
        flat.index_add_(0, keys, -freq[row].to(dev))
    bias = [r for r in rows if r[3].bias_ids]
    if bias:
        ids = torch.tensor([t for *_, pen in bias for t in pen.bias_ids], dtype=torch.long)
        add = torch.tensor([b for *_, pen in bias for b in pen.bias], dtype=logits.dtype)
        base = torch.tensor([r * vocab for r, *_, pen in bias for _ in pen.bias_ids])
        keep = (ids >= 0) & (ids < vocab)
        flat.index_add_(0, (ids + base)[keep].to(dev), add[keep].to(dev))
    ban = [r for r in rows if r[3].stop_ids and len(r[1]) - r[2] < r[3].min_tokens]
    if ban:
        ids = torch.tensor([t for *_, pen in ban for t in pen.stop_ids], dtype=torch.long)
        base = torch.tensor([r * vocab for r, *_, pen in ban for _ in pen.stop_ids])
        keep = (ids >= 0) & (ids < vocab)
        flat[(ids + base)[keep].to(dev)] = -math.inf


class Logprobs:
    """Logprobs for the rows that asked, in two halves around the sampler: taken from the
    logits before penalties change them (the model's own distribution, vLLM's default),
    finished once the tokens are known. Each row's log-sum-exp and its top k by value
    (log-probabilities differ from logits by that constant), not a whole log-softmax; on
    the CPU natively (kernels/csrc/cpu_sampling.cpp): 64 rows at the top 5, 2-core AVX2
    EPYC, 2.7 ms in all against 7.5 in torch (whose log_softmax + gather + topk took 10)."""

    def __init__(self, logits: torch.Tensor, rows: list[int], tops: list[int],
                 will_change: bool, native: bool = True) -> None:
        """``rows`` of ``logits`` asked for ``tops`` alternatives each; ``will_change``:
        penalties will rewrite some of them in place before sampling."""
        sel = logits if len(rows) == logits.shape[0] else logits[rows]
        self.logits = sel.clone() if will_change and sel is logits else sel
        self.rows, self.tops = rows, tops
        k = max(tops)
        if native and _native is not None and sel.device.type == "cpu" \
                and sel.dtype == torch.float32:
            self.lse, values, indices = _native.logprobs(self.logits, k)
        else:
            self.lse = torch.logsumexp(self.logits, dim=-1)
            values, indices = self.logits.topk(k, dim=-1)
        self.top = (values - self.lse[:, None]).tolist(), indices.tolist()

    def finish(self, tokens: list[int], n: int) -> list[SampleLogprobs | None]:
        """``n`` entries, None but at ``rows``: there, the sampled token's log-probability
        (``tokens`` holds all ``n`` samples) and the top alternatives, most likely first."""
        from schemas.wire import SampleLogprobs  # (msgspec: not in the torch-only path)

        picked = torch.tensor([tokens[r] for r in self.rows], device=self.logits.device)
        lp = (self.logits.gather(1, picked[:, None])[:, 0] - self.lse.to(picked.device)).tolist()
        top_lp, top_ids = self.top
        out: list[SampleLogprobs | None] = [None] * n
        for j, (row, k) in enumerate(zip(self.rows, self.tops)):
            out[row] = SampleLogprobs(lp[j], top_ids[j][:k], top_lp[j][:k])
        return out


def drawing(temperature: torch.Tensor) -> torch.Tensor:
    """Which rows draw (a bool mask) for float32 ``temperature``; the rest are greedy: 0,
    or a temperature too small for its float32 reciprocal (or NaN), the greedy limit."""
    return (temperature > 0) & temperature.reciprocal().isfinite()


def greedy(logits: torch.Tensor, native: bool = True) -> torch.Tensor:
    """Each row's first maximum, [S] long: the native argmax for float32 CPU rows where
    ``native`` (the plan's sampling choice), else torch's."""
    if native and _native is not None and logits.device.type == "cpu" \
            and logits.dtype == torch.float32:
        return _native.argmax(logits)
    return logits.argmax(dim=-1)


def all_greedy(temperature: list[float]) -> bool:
    """Whether :func:`sample` would take every row's argmax (:func:`drawing`'s test in
    numpy: ~10 us where the torch ops took ~0.2 ms in a decode step)."""
    t = np.asarray(temperature, dtype=np.float32)
    with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
        return not bool(((t > 0) & np.isfinite(np.reciprocal(t))).any())


def sample(logits: torch.Tensor, temperature: list[float], top_p: list[float],
           top_k: list[int], seeds: list[int | None], output_index: list[int],
           native: bool = True) -> torch.Tensor:
    """Pick one token per row of ``logits`` ``[S, vocab]``; returns a ``[S]`` long tensor.

    Row ``i`` uses ``temperature[i]`` (0 means greedy argmax), ``top_k[i]`` (0 = off),
    ``top_p[i]`` (1.0 = off) and, when ``seeds[i]`` is not None, noise that depends only
    on ``(seeds[i], output_index[i])`` -- the number of the output token being drawn --
    and each token's id: the exponential race (``_pick``), which a last-bit change of the
    logits moves only where two tokens' scores tie within it.
    Top-k is applied first, then top-p on the renormalised survivors. ``native`` False
    runs the torch path even where the native sampler exists (the kernel plan's choice).
    """
    rows, vocab = logits.shape
    native = native and _native is not None and logits.device.type == "cpu"
    temp = torch.tensor(temperature, dtype=torch.float32)
    # one row's parameters must never fail the batch (admission validates them, but the
    # executor does not rely on it): a temperature too small for its float32 reciprocal
    # (or NaN) is the greedy limit, and top_k is clamped before it becomes an int64
    rand = drawing(temp).nonzero()[:, 0].tolist()
    if len(rand) == rows:          # every row draws: no argmax (12.6 MB read at 64 rows)
        out = torch.empty(rows, dtype=torch.long, device=logits.device)
    else:
        out = greedy(logits, native)
    if not rand:
        return out
    p = torch.tensor([top_p[i] for i in rand], dtype=torch.float32)
    k = torch.tensor([_top_k(top_k[i], vocab) for i in rand], dtype=torch.long)
    u = _uniforms(len(rand))
    keys = _keys([seeds[i] for i in rand], [output_index[i] for i in rand])
    if native:
        # every row drawn (the usual sampled batch): the logits as they are, not a copy
        rows_in = logits.float() if len(rand) == rows else logits[rand].float()
        picked = _native.sample(rows_in, temp[rand], k, p, u, keys)
        out[torch.tensor(rand)] = picked
        return out
    x = logits[rand].float().cpu() / temp[rand, None]
    if bool((p < 1.0).any()) or bool(((k > 0) & (k < vocab)).any()):
        picked = _filtered_draw(x, p, k, u, keys)
    else:
        picked = _pick(x.softmax(dim=-1), u, keys)
    out[torch.tensor(rand, device=out.device)] = picked.to(out.device)
    return out
