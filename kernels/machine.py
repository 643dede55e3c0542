"""The machine a number was measured on: CPU model, the vector extensions the executor's
kernels care about, cores, and library versions. Every benchmark and cost profile prints it;
a number without its machine is not comparable."""
from __future__ import annotations

import math
import os
import platform
from pathlib import Path

FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")


def cpu_info() -> tuple[str, set[str]]:
    """The CPU's model name and every flag it reports (the first CPU's, from /proc/cpuinfo);
    the architecture's name and no flags where there is none."""
    model, flags = platform.machine(), None
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        info = ""
    for line in info.splitlines():
        if line.startswith("model name") and model == platform.machine():
            model = line.split(":", 1)[1].strip()
        elif line.startswith("flags") and not flags:
            flags = set(line.split(":", 1)[1].split())
    return model, flags or set()


def describe() -> dict[str, object]:
    model, have = cpu_info()
    return {"cpu": model, "flags": [f for f in FLAGS if f in have], "cores": usable_cores(),
            "python": platform.python_version()}


def _affinity() -> set[int]:
    try:
        return set(os.sched_getaffinity(0))
    except AttributeError:                          # not Linux
        return set(range(os.cpu_count() or 1))


def _capped(n: int, cgroup_root: Path, proc_cgroup: Path) -> int:
    quota = cpu_quota(cgroup_root, proc_cgroup)
    if quota is not None:
        n = min(n, max(1, math.ceil(quota - 1e-9)))
    return max(1, n)


def usable_cpus(cgroup_root: Path = Path("/sys/fs/cgroup"),
                proc_cgroup: Path = Path("/proc/self/cgroup")) -> int:
    """The logical CPUs this process may keep busy: its CPU affinity (``taskset``, a cpuset,
    docker ``--cpuset-cpus``, ``numactl --cpunodebind``), capped by its cgroup's CPU quota
    rounded up (docker ``--cpus``, a Kubernetes CPU limit: the affinity still lists every CPU
    of the node there). At least 1."""
    return _capped(len(_affinity()), cgroup_root, proc_cgroup)


def usable_cores(cgroup_root: Path = Path("/sys/fs/cgroup"),
                 proc_cgroup: Path = Path("/proc/self/cgroup"),
                 sys_cpu: Path = Path("/sys/devices/system/cpu"),
                 cpus: set[int] | None = None) -> int:
    """The physical cores among those CPUs (SMT siblings counted once), capped by the same
    quota: the executor's default thread count. One OpenMP thread per CPU of the node under
    a 4-CPU quota spends the quota in a fraction of each period and then stalls until the
    next; two threads on one core's SMT siblings share its vector and tile units. Where
    the topology cannot be read, every CPU counts as a core."""
    cpus = _affinity() if cpus is None else cpus
    cores: set[tuple[str, ...]] = set()
    for c in cpus:
        topo = sys_cpu / f"cpu{c}" / "topology"
        try:
            cores.add(tuple((topo / name).read_text().strip()
                            for name in ("physical_package_id", "die_id", "core_id")
                            if name != "die_id" or (topo / name).exists()))
        except OSError:
            cores.add(("cpu", str(c)))
    return _capped(len(cores), cgroup_root, proc_cgroup)


def cpu_quota(cgroup_root: Path = Path("/sys/fs/cgroup"),
              proc_cgroup: Path = Path("/proc/self/cgroup")) -> float | None:
    """This process's CPU quota in cores (quota / period), the tightest along its cgroup's
    path up to the root: cgroup v2's ``cpu.max`` ("max" = none), or v1's
    ``cpu.cfs_quota_us`` (-1 = none) over ``cpu.cfs_period_us`` under the cpu controller's
    mount. None where there is none or it cannot be read. In a container the path named in
    ``proc_cgroup`` may be the host's, which the container's mount does not have: the walk
    up reaches the mount's root, the container's own cgroup."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return None
    best: float | None = None
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        if controllers == "":                       # v2: "0::/path"
            dirs, read = [cgroup_root], _quota_v2
        elif "cpu" in controllers.split(","):       # v1: "4:cpu,cpuacct:/path"
            dirs = [cgroup_root / name for name in (controllers, "cpu", "cpu,cpuacct")]
            read = _quota_v1
        else:
            continue
        for mount in dict.fromkeys(dirs):           # each mount once, in order
            rel = Path(path.lstrip("/"))
            for d in [mount / rel, *(mount / p for p in rel.parents)]:
                q = read(d)
                if q is not None and (best is None or q < best):
                    best = q
    return best


def _quota_v2(d: Path) -> float | None:
    try:
        quota, period = (d / "cpu.max").read_text().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError, ZeroDivisionError):
        return None


def _quota_v1(d: Path) -> float | None:
    try:
        quota = int((d / "cpu.cfs_quota_us").read_text())
        period = int((d / "cpu.cfs_period_us").read_text())
        return None if quota <= 0 else quota / period
    except (OSError, ValueError, ZeroDivisionError):
        return None


def summary_line(info: dict[str, object] | None = None) -> str:
    info = info or describe()
    return f"{info['cpu']} [{' '.join(info['flags'])}] x{info['cores']} cores"


def component_cpu(root_pid: int, include_root: bool = False) -> dict[str, float]:
    """CPU seconds (user + system) so far of each of Weir's processes under ``root_pid``,
    by component (``weir.launch <component>``), from /proc; with ``include_root``, the root
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
                name = (argv[argv.index(b"weir.launch") + 1].decode() if b"weir.launch" in argv
                        else "other")
            else:
                continue
        except (OSError, IndexError, ValueError):
            continue
        out[name] = out.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / tick
    return out
