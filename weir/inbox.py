"""A stream's buffer in the SDK: between the one receive task, which must never wait on
any stream, and the stream's reader, who may be slow or gone."""
from __future__ import annotations

import asyncio
import time
from collections import deque
from typing import Any

from schemas.client import Cancelled, Failed, Finished, Rejected

TERMINAL = (Finished, Rejected, Cancelled, Failed)


class Inbox:
    """One stream's buffer between the shared receiver and its reader.

    ``put`` never waits, so one reader cannot hold up the receiver. Policy: up to
    ``capacity`` unread events is normal; past it the stream is *stalled*, and a stream
    stalled for longer than ``stall_timeout`` seconds, or holding 4 x ``capacity`` events,
    is over: ``put`` returns False, its buffer is dropped, and its reader gets
    ``Cancelled(reason="slow_consumer")`` (the caller cancels it in the engine, freeing
    its KV). Nothing is put after a terminal event.

    The reader waits on a bare asyncio future, made only when the buffer is empty (the
    SDK runs on asyncio: its sockets are zmq.asyncio's). An ``anyio.Event`` per wait was
    ~15% of a gateway's CPU at 64 streams."""

    def __init__(self, capacity: int, stall_timeout: float) -> None:
        self.capacity, self.stall_timeout = capacity, stall_timeout
        self.items: deque = deque()
        self.stalled_since: float | None = None
        self.ended = False
        self._waiter: asyncio.Future | None = None

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def put(self, event: Any) -> bool:
        """Buffer ``event``; False if the stream is over its buffer policy (now dropped)."""
        if self.ended:
            return True
        self.items.append(event)
        self.ended = isinstance(event, TERMINAL)
        self._wake()
        if len(self.items) <= self.capacity:
            return True
        now = time.monotonic()
        if self.stalled_since is None:
            self.stalled_since = now
        if now - self.stalled_since <= self.stall_timeout and len(self.items) < 4 * self.capacity:
            return True
        request_id = event.request_id
        self.items.clear()
        self.end(Cancelled(request_id, f"slow_consumer: {self.capacity} events unread for "
                                       f"over {self.stall_timeout:g}s"))
        return False

    def end(self, terminal: Any) -> None:
        """Deliver a terminal event now (ahead of nothing, after what is buffered)."""
        if not self.ended:
            self.items.append(terminal)
            self.ended = True
            self._wake()

    async def get(self) -> Any:
        while not self.items:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        item = self.items.popleft()
        if len(self.items) <= self.capacity:
            self.stalled_since = None
        return item
