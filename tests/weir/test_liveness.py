"""With no engine at the endpoint, nothing the SDK does waits forever: a request fails
with engine_unreachable after ``engine_timeout``, and status times out."""
import time

import anyio
import pytest

from weir import AsyncClient, RequestFailed, RequestTimeout


def test_no_engine_fails_requests_and_status_in_bounded_time(tmp_path):
    async def main():
        start = time.monotonic()
        async with AsyncClient(f"ipc://{tmp_path}/nobody.sock", engine_timeout=0.5) as c:
            with pytest.raises(RequestFailed) as err:
                await c.generate("hi", max_tokens=2)
            failed_after = time.monotonic() - start
            with pytest.raises(RequestTimeout):
                await c.status(timeout=0.5)
        return err.value.reason, failed_after

    reason, failed_after = anyio.run(main)
    assert reason.startswith("engine_unreachable") and failed_after < 5
