"""The machine a number was measured on: CPU model, the vector extensions the executor's
kernels care about, cores, and library versions. Every benchmark and cost profile prints it;
a number without its machine is not comparable."""
from __future__ import annotations

import os
import platform
from pathlib import Path

FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")


def describe() -> dict[str, object]:
    model, flags = platform.machine(), []
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        info = ""
    for line in info.splitlines():
        if line.startswith("model name") and model == platform.machine():
            model = line.split(":", 1)[1].strip()
        elif line.startswith("flags") and not flags:
            have = set(line.split(":", 1)[1].split())
            flags = [f for f in FLAGS if f in have]
    return {"cpu": model, "flags": flags, "cores": len(os.sched_getaffinity(0)),
            "python": platform.python_version()}


def summary_line(info: dict[str, object] | None = None) -> str:
    info = info or describe()
    return f"{info['cpu']} [{' '.join(info['flags'])}] x{info['cores']} cores"
