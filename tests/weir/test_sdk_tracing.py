"""With the standard OTEL_* variables set and no tracer provider of its own, an SDK
application's requests are traced: its ``weir.submit`` span is exported."""
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
APP = """
import anyio, sys
from weir import AsyncClient, WeirError
async def main():
    async with AsyncClient(sys.argv[1], engine_timeout=0.3) as c:
        try:
            await c.generate("hi", max_tokens=2)
        except WeirError:
            pass
anyio.run(main)
"""


def test_sdk_exports_its_submit_span_when_otel_is_configured(tmp_path):
    spans = tmp_path / "spans.jsonl"
    env = dict(os.environ, PYTHONPATH=str(ROOT), OTEL_TRACES_EXPORTER="jsonl",
               WEIR_TRACE_FILE=str(spans))
    subprocess.run([sys.executable, "-c", APP, f"ipc://{tmp_path}/nobody.sock"], env=env,
                   cwd=ROOT, check=True, timeout=60)
    names = [json.loads(line)["name"] for line in spans.read_text().splitlines()]
    assert names == ["weir.submit"]
