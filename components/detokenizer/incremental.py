"""Stream text out of generated token ids, with stop strings, without re-decoding the whole
sequence."""
from __future__ import annotations

from collections.abc import Iterable, Sequence

import msgspec
from tokenizers import Tokenizer

_REPLACEMENT = "\ufffd"


class DetokOutput(msgspec.Struct, frozen=True):
    """New text safe to show now; stopped once a stop string matched (text ends before it)."""

    text: str
    stopped: bool = False


class IncrementalDetokenizer:
    """Turns one request's generated token ids into text, incrementally.

    Only a small window of recent tokens is decoded per push: tokens whose text was already
    emitted stay as left context (so decoders that depend on it, e.g. leading-space handling,
    see it) and are dropped at the next complete character. Text that ends in an incomplete
    UTF-8 sequence is held until it completes, and text that could be the start of a stop
    string is held until it cannot be. Before ``min_tokens`` ids have been pushed no stop
    string matches (vLLM's min_tokens), and text is released as it comes.

    ``carried``: the tail of output an earlier placement already streamed (a migrated
    stream's continuation carries it in its prompt). It starts the window as text already
    emitted, as the earlier placement's detokenizer held it: its complete characters
    emitted, a character its last tokens left incomplete still open, and (once stop strings
    match) its longest suffix that could begin a stop string held, released with the text
    that shows it is none, or cut at the stop it begins. So the continuation's first text
    is exactly the text that follows, never any of the carried text again. (One case is
    not rebuilt: where the first placement reached ``min_tokens`` in the carried output,
    it searched for stops only from the push that reached it; the held suffix here is
    taken over the whole carried text.)
    """

    def __init__(self, tokenizer: Tokenizer, special_ids: Iterable[int],
                 skip_special_tokens: bool = True, stop: Sequence[str] = (),
                 min_tokens: int = 0, carried: Sequence[int] = ()):
        self._tokenizer = tokenizer
        self._skip_ids = frozenset(special_ids) if skip_special_tokens else frozenset()
        self._skip_special = skip_special_tokens
        self._stops = tuple(s for s in stop if s)
        self._window: list[int] = []
        self._read = 0
        self._emitted = 0
        self._held = ""
        self._matched_stop: str | None = None
        self._finished = False
        self._min_tokens, self._pushed = min_tokens, 0
        if carried:
            self._carry([t for t in carried if t not in self._skip_ids])

    def _carry(self, ids: list[int]) -> None:
        if not ids:
            return
        self._window = ids
        text = self._decode(ids)
        safe = len(text.rstrip(_REPLACEMENT)) if text.endswith(_REPLACEMENT) else len(text)
        self._emitted = safe
        self._read = len(ids) if safe == len(text) else 0
        if self._stops and self._min_tokens == 0:
            keep = self._partial_stop_len(text[:safe])
            self._held = text[safe - keep:safe] if keep else ""

    @property
    def stopped(self) -> bool:
        return self._matched_stop is not None

    @property
    def matched_stop(self) -> str | None:
        """The stop string that ended the stream, if any."""
        return self._matched_stop

    def push(self, token_ids: Sequence[int]) -> DetokOutput:
        """Add newly generated ids; return the text they make safe to emit."""
        if self._finished:
            raise RuntimeError("push() after flush()")
        if self.stopped:
            return DetokOutput("", True)
        self._pushed += len(token_ids)
        new = [t for t in token_ids if t not in self._skip_ids]
        if not new:
            return DetokOutput("", False)
        self._window.extend(new)
        text = self._decode(self._window)
        complete = not text.endswith(_REPLACEMENT)
        safe = len(text) if complete else len(text.rstrip(_REPLACEMENT))
        chunk = text[self._emitted:safe]
        self._emitted = max(self._emitted, safe)
        if complete:
            self._window = self._window[self._read:]
            self._read = len(self._window)
            self._emitted = len(self._decode(self._window))
        return self._release(chunk, final=False)

    def flush(self) -> str:
        """Emit whatever is still held at the end of the stream (incomplete UTF-8 becomes
        U+FFFD)."""
        if self._finished or self.stopped:
            self._finished = True
            return ""
        chunk = self._decode(self._window)[self._emitted:] if self._window else ""
        self._finished = True
        self._window = []
        return self._release(chunk, final=True).text

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special)

    def _release(self, chunk: str, final: bool) -> DetokOutput:
        if not self._stops or self._pushed < self._min_tokens:    # nothing held till then
            return DetokOutput(chunk, False)
        buf = self._held + chunk
        hits = [(i, s) for s in self._stops if (i := buf.find(s)) >= 0]
        if hits:
            index, self._matched_stop = min(hits, key=lambda h: h[0])
            self._held = ""
            return DetokOutput(buf[:index], True)
        keep = 0 if final else self._partial_stop_len(buf)
        self._held = buf[len(buf) - keep:] if keep else ""
        return DetokOutput(buf[:len(buf) - keep], False)

    def _partial_stop_len(self, buf: str) -> int:
        """Length of the longest suffix of buf that is a proper prefix of some stop string."""
        best = 0
        for stop in self._stops:
            for k in range(min(len(stop) - 1, len(buf)), best, -1):
                if buf.endswith(stop[:k]):
                    best = k
                    break
        return best
