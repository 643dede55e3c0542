"""The SDK's per-stream buffer: the receiver never waits on it, and a reader that stops
reading is cut off by a stated policy, not by blocking everyone else."""
import anyio

from schemas.client import Cancelled, Finished, TextDelta, Usage
from weir.inbox import Inbox


def _delta(i):
    return TextDelta("r", str(i), (i,))


def test_put_never_blocks_and_get_returns_in_order():
    box = Inbox(capacity=4, stall_timeout=60)
    assert all(box.put(_delta(i)) for i in range(10))     # over capacity, within timeout

    async def read():
        return [(await box.get()).text for _ in range(10)]
    assert anyio.run(read) == [str(i) for i in range(10)]
    assert box.stalled_since is None


def test_four_times_capacity_unread_ends_the_stream_as_slow_consumer():
    box = Inbox(capacity=4, stall_timeout=60)
    results = [box.put(_delta(i)) for i in range(16)]
    assert results == [True] * 15 + [False]
    assert len(box.items) == 1 and isinstance(box.items[0], Cancelled)
    assert box.items[0].reason.startswith("slow_consumer")
    assert box.put(_delta(99)) and len(box.items) == 1          # nothing after the end


def test_stalled_past_the_timeout_ends_the_stream(monkeypatch):
    now = [100.0]
    monkeypatch.setattr("weir.inbox.time.monotonic", lambda: now[0])
    box = Inbox(capacity=2, stall_timeout=5)
    assert box.put(_delta(0)) and box.put(_delta(1)) and box.put(_delta(2))   # stalled at 100
    now[0] = 104.9
    assert box.put(_delta(3))
    now[0] = 105.1
    assert not box.put(_delta(4))


def test_a_reader_that_catches_up_clears_the_stall(monkeypatch):
    now = [0.0]
    monkeypatch.setattr("weir.inbox.time.monotonic", lambda: now[0])
    box = Inbox(capacity=2, stall_timeout=5)
    for i in range(3):
        box.put(_delta(i))
    anyio.run(box.get)
    assert box.stalled_since is None
    now[0] = 50.0
    assert box.put(_delta(3))                                     # a fresh stall, not an old one


def test_a_terminal_is_delivered_and_ends_the_stream():
    box = Inbox(capacity=2, stall_timeout=5)
    box.put(Finished("r", "stop", Usage(1, 1)))
    box.put(_delta(1))
    box.end(Cancelled("r", "x"))
    assert len(box.items) == 1 and isinstance(box.items[0], Finished)


def test_breaking_out_of_a_stream_and_iterating_again_resumes_it():
    """``break`` leaves the request running; a second ``async for`` reads on to its end
    (the first iterator's close must not unregister the stream)."""
    from weir.client import AsyncClient, Stream

    async def main():
        client = AsyncClient("ipc:///nonexistent")
        inbox = client._open("r")
        stream = Stream("r", client, inbox, None)
        for i in range(3):
            inbox.put(_delta(i))
        async for _ in stream:
            break
        await anyio.sleep(0)                   # let the first iterator's aclose run
        assert "r" in client._streams
        inbox.put(Finished("r", "length", Usage(1, 3)))
        rest = [d.text async for d in stream]
        return rest, stream.result, "r" in client._streams

    rest, result, still_open = anyio.run(main)
    assert rest == ["1", "2"] and result.finish_reason == "length" and not still_open


def test_an_abandoned_stream_is_unregistered():
    from schemas.client import Submit
    from weir.client import AsyncClient, Stream

    async def main():
        client = AsyncClient("ipc:///nonexistent")
        sub = Submit("r", prompt="x", idempotency_key="k")     # left running, no cancel sent
        stream = Stream("r", client, client._open("r"), None, sub)
        await stream.abandon()
        return "r" in client._streams

    assert anyio.run(main) is False


def test_a_waiting_reader_wakes_on_put_and_a_cancelled_one_leaves_no_waiter():
    box = Inbox(capacity=4, stall_timeout=60)

    async def main():
        got = []

        async def reader():
            got.append((await box.get()).text)

        async with anyio.create_task_group() as tg:
            tg.start_soon(reader)
            await anyio.wait_all_tasks_blocked()
            assert box._waiter is not None                 # waiting, not polling
            box.put(_delta(7))
        assert got == ["7"]
        with anyio.move_on_after(0.01):                  # a bounded wait that runs out
            await box.get()
        assert box._waiter is None
        box.put(_delta(8))                                 # no stale waiter to trip on
        return (await box.get()).text

    assert anyio.run(main) == "8"
