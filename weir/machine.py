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


def component_cpu(root_pid: int, include_root: bool = False) -> dict[str, float]:
    """CPU seconds (user + system) so far of each of Weir's processes under ``root_pid``,
    by component (``bus.launch <component>``), from /proc; with ``include_root``, the root
    itself too (as "supervisor"). Empty where /proc cannot tell."""
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[str, float] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(stat.parent.name) == root_pid and include_root:
                name = "supervisor"
            elif int(fields[1]) == root_pid:        # ppid: the components are its children
                argv = (stat.parent / "cmdline").read_bytes().split(b"\0")
                name = (argv[argv.index(b"bus.launch") + 1].decode() if b"bus.launch" in argv
                        else "other")
            else:
                continue
        except (OSError, IndexError, ValueError):
            continue
        out[name] = out.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / tick
    return out
