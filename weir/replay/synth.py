"""Prompts for a trace that gives only lengths and prefix-block ids (Mooncake's ``hash_ids``).

A request of ``input_tokens`` tokens with ``hash_ids`` (h0, h1, ...) becomes block(h0) +
block(h1) + ... + filler, cut to exactly ``input_tokens``. A block's content depends only on
(seed, hash id); the trace's ids are already chained on the prefix, so requests that share
leading ids share exactly that prefix in tokens, and the engine's prefix cache sees what the
trace's cache saw. Filler depends on (seed, request index), so it is unique to its request.

NOTE: why the text round trip is exact. Every pool token decodes to a space and a lowercase
ASCII word, and re-encodes alone to that one id. A byte-level BPE pre-tokenizer (the GPT-2
regex; SmolLM2's Digits split does not touch letters) cuts text before each space that
precedes a letter run, so in a run of pool words each " word" is a piece of its own, BPE
merges never cross pieces, and each piece encodes to its id again. ``safe_pool`` checks
that on one string holding every pool token, so a tokenizer that splits otherwise (a
Metaspace/SentencePiece one) fails there rather than sending prompts of the wrong length.
"""
from __future__ import annotations

import random
import re
from collections.abc import Sequence

import msgspec
import numpy as np
from tokenizers import Tokenizer

from components.model import vocab
from components.model.fetch import resolve_model
from weir.replay.types import Scaling, TraceRequest

_MASK = (1 << 64) - 1
_GOLDEN, _M1, _M2 = 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB   # splitmix64
_BLOCK, _FILLER = 1, 2          # the two random streams: per hash id, per request
_WORD = re.compile(r" [a-z]+")
_U27, _U30, _U31 = np.uint64(27), np.uint64(30), np.uint64(31)
_UM1, _UM2 = np.uint64(_M1), np.uint64(_M2)


def scale(requests: list[TraceRequest], scaling: Scaling) -> list[TraceRequest]:
    """The requests fitted to this machine: times × ``scaling.time``, lengths × ``.length``.

    Times: ``arrival_s`` and ``cancel_after_s`` are multiplied (so gaps between arrivals are
    too). ``deadline_ms`` is an SLO and is kept. Lengths: ``input_tokens``, ``output_tokens``
    and ``max_tokens`` become ``round(x * length)`` (Python's round: half to even, the rule
    ``Scaling.scaled_block`` uses), then at least 1; a 0 output or max_tokens stays 0. A
    request with a text ``prompt`` keeps it and its ``input_tokens`` (the text is not
    scaled); its outputs are scaled. ``hash_ids`` are kept: block ids do not change, the
    synthesized block size does (``Scaling.scaled_block``).
    """
    if not scaling.length > 0 or not scaling.time > 0:
        raise ValueError(f"scaling factors must be positive: length={scaling.length}, "
                         f"time={scaling.time}")
    if scaling.block_size < 1:
        raise ValueError(f"block_size must be at least 1, got {scaling.block_size}")

    def length(x: int | None, at_least: int) -> int | None:
        return None if x is None else max(at_least, round(x * scaling.length))

    def output(x: int | None) -> int | None:
        return length(x, 1 if x else 0)

    return [msgspec.structs.replace(
        r,
        arrival_s=r.arrival_s * scaling.time,
        cancel_after_s=None if r.cancel_after_s is None else r.cancel_after_s * scaling.time,
        input_tokens=r.input_tokens if r.prompt is not None else length(r.input_tokens, 1),
        output_tokens=output(r.output_tokens),
        max_tokens=output(r.max_tokens),
    ) for r in requests]


class TokenSynth:
    """Token ids for trace requests: exactly ``input_tokens`` of them, drawn from ``pool``.

    Draws are a counter-based splitmix64 hash of (seed, stream, position), so the same
    (pool, block_tokens, seed) gives the same ids in every process, platform and numpy
    version. Block contents are memoized by hash id; the memo's lists share the pool's int
    objects, so it costs 8 bytes a token.
    """

    def __init__(self, pool: Sequence[int], block_tokens: int, seed: int) -> None:
        if block_tokens < 1:
            raise ValueError(f"block_tokens must be at least 1, got {block_tokens}")
        if len(pool) < 2:
            raise ValueError(f"the token pool needs at least 2 ids, got {len(pool)}")
        self.block_tokens = block_tokens
        self.seed = seed
        self._pool = np.array([int(t) for t in pool], dtype=object)
        self._pool_len = np.uint64(len(pool))
        self._block_base = np.uint64(_stream_base(seed, _BLOCK))
        self._filler_base = _stream_base(seed, _FILLER)
        self._block_steps = _steps(block_tokens)
        self._blocks: dict[int, list[int]] = {}

    def tokens(self, req: TraceRequest) -> list[int]:
        """``req.input_tokens`` ids: one block per hash id, then request-unique filler.

        Fewer tokens than the hash ids cover cut the last block short (as in Mooncake, whose
        last block is partial); none, or ``input_tokens`` of 0, give all filler or nothing.
        """
        n = req.input_tokens
        if n is None or n < 0:
            raise ValueError(f"request {req.index} ({req.source}): input_tokens must be a "
                             f"count >= 0, got {n!r}")
        blocks = self._blocks
        ids = req.hash_ids[:-(-n // self.block_tokens)]    # blocks holding at least one token
        missing = [h for h in dict.fromkeys(ids) if h not in blocks]
        if missing:
            keys = _mix(np.array([h & _MASK for h in missing], dtype=np.uint64) ^ self._block_base)
            blocks.update(zip(missing, self._draw(keys, self._block_steps)))
        out: list[int] = []
        for h in ids:
            out += blocks[h]
        if (extra := n - len(out)) > 0:
            key = np.array([_mix64(self._filler_base ^ (req.index & _MASK))], dtype=np.uint64)
            out += self._draw(key, _steps(extra))[0]
        del out[n:]
        return out

    def _draw(self, keys: np.ndarray, steps: np.ndarray) -> list[list[int]]:
        """One row of pool ids per stream key, one id per step."""
        return self._pool[_mix(keys[:, None] + steps) % self._pool_len].tolist()


def safe_pool(tokenizer: Tokenizer) -> list[int]:
    """Ids safe to concatenate: each decodes to " " + a lowercase ASCII word, re-encodes alone
    to exactly that id, and is no added (special or user) token. Raises ValueError when the
    tokenizer has none, or when a string of them does not encode back to the same ids."""
    added = set(tokenizer.get_added_tokens_decoder())
    ids = [i for i in range(tokenizer.get_vocab_size(with_added_tokens=True)) if i not in added]
    texts = tokenizer.decode_batch([[i] for i in ids], skip_special_tokens=False)
    words = [(i, t) for i, t in zip(ids, texts) if _WORD.fullmatch(t)]
    encoded = tokenizer.encode_batch([t for _, t in words], add_special_tokens=False)
    pool = [i for (i, _), enc in zip(words, encoded) if enc.ids == [i]]
    if len(pool) < 2:
        raise ValueError("the tokenizer has no tokens of the form ' word' that encode alone")
    mixed = random.Random(0).sample(pool, len(pool))
    if tokenizer.encode(tokenizer.decode(mixed), add_special_tokens=False).ids != mixed:
        raise ValueError("this tokenizer does not encode a run of ' word' tokens word by word "
                         "(not a byte-level BPE that splits on spaces?); prompts cannot be "
                         "synthesized token-exactly")
    return pool


def load_tokenizer(model: str | None = None) -> Tokenizer:
    """The served model's tokenizer, built as the engine builds it: ``model`` is a .gguf file
    or a Hugging Face directory; None or "" is the default model (SmolLM2-135M-Instruct)."""
    return vocab.load_tokenizer(resolve_model(model or "")).tokenizer


class PromptSynth:
    """Prompts as token ids and as text, where the text encodes back to exactly those ids
    (``tokenizer.encode(text, add_special_tokens=False).ids == token_ids(req)``).

    The ids are the text's own; when serving, the engine may add BOS or a chat template."""

    def __init__(self, tokenizer: Tokenizer, synth: TokenSynth) -> None:
        self.tokenizer = tokenizer
        self.synth = synth

    @classmethod
    def for_scaling(cls, tokenizer: Tokenizer, scaling: Scaling) -> PromptSynth:
        """Blocks of ``scaling.scaled_block`` tokens from the tokenizer's safe pool."""
        return cls(tokenizer, TokenSynth(safe_pool(tokenizer), scaling.scaled_block, scaling.seed))

    def token_ids(self, req: TraceRequest) -> list[int]:
        if req.prompt is not None:
            return self.tokenizer.encode(req.prompt, add_special_tokens=False).ids
        return self.synth.tokens(req)

    def text(self, req: TraceRequest) -> str:
        if req.prompt is not None:
            return req.prompt
        return self.tokenizer.decode(self.synth.tokens(req), skip_special_tokens=True)


def _mix64(z: int) -> int:
    """splitmix64's finalizer on a Python int (a bijection of 64-bit values)."""
    z = ((z ^ (z >> 30)) * _M1) & _MASK
    z = ((z ^ (z >> 27)) * _M2) & _MASK
    return z ^ (z >> 31)


def _mix(z: np.ndarray) -> np.ndarray:
    """_mix64 elementwise on uint64 (array arithmetic wraps mod 2**64)."""
    z = (z ^ (z >> _U30)) * _UM1
    z = (z ^ (z >> _U27)) * _UM2
    return z ^ (z >> _U31)


def _steps(length: int) -> np.ndarray:
    return np.arange(1, length + 1, dtype=np.uint64) * np.uint64(_GOLDEN)


def _stream_base(seed: int, stream: int) -> int:
    return _mix64((_mix64(seed & _MASK) + stream * _GOLDEN) & _MASK)
