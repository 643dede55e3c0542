"""The CPUs and cores a Weir process may keep busy (``kernels.machine.usable_cpus`` and
``usable_cores``): its affinity, its SMT siblings counted once for cores, capped by a cgroup
CPU quota; read from fake cgroup and sysfs trees laid out as Linux mounts them."""
import os
from pathlib import Path

import pytest

from kernels import machine


def _tree(tmp_path: Path, proc: str, files: dict[str, str]) -> tuple[Path, Path]:
    root = tmp_path / "cgroup"
    for name, text in files.items():
        p = root / name
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    root.mkdir(exist_ok=True)
    pc = tmp_path / "proc_cgroup"
    pc.write_text(proc)
    return root, pc


def test_v2_quota_in_the_process_cgroup(tmp_path):
    root, pc = _tree(tmp_path, "0::/kubepods/pod1/ctr\n",
                     {"kubepods/pod1/ctr/cpu.max": "400000 100000\n"})
    assert machine.cpu_quota(root, pc) == 4.0


def test_v2_tightest_along_the_path_and_max_is_none(tmp_path):
    root, pc = _tree(tmp_path, "0::/a/b\n", {"a/cpu.max": "150000 100000\n",
                                             "a/b/cpu.max": "max 100000\n",
                                             "cpu.max": "800000 100000\n"})
    assert machine.cpu_quota(root, pc) == 1.5
    root2, pc2 = _tree(tmp_path / "none", "0::/a\n", {"a/cpu.max": "max 100000\n"})
    assert machine.cpu_quota(root2, pc2) is None


def test_v2_inside_a_container_reads_its_own_root(tmp_path):
    """The path named is the host's; the container's mount is its own cgroup."""
    root, pc = _tree(tmp_path, "0::/system.slice/docker-abc.scope\n",
                     {"cpu.max": "200000 100000\n"})
    assert machine.cpu_quota(root, pc) == 2.0


def test_v1_cfs_quota_under_the_cpu_controller(tmp_path):
    root, pc = _tree(tmp_path, "4:cpu,cpuacct:/docker/abc\n3:memory:/docker/abc\n",
                     {"cpu,cpuacct/docker/abc/cpu.cfs_quota_us": "250000\n",
                      "cpu,cpuacct/docker/abc/cpu.cfs_period_us": "100000\n"})
    assert machine.cpu_quota(root, pc) == 2.5
    root2, pc2 = _tree(tmp_path / "unlimited", "1:cpu:/\n",
                       {"cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n"})
    assert machine.cpu_quota(root2, pc2) is None


def test_unreadable_or_garbled_is_no_quota(tmp_path):
    assert machine.cpu_quota(tmp_path / "absent", tmp_path / "absent_proc") is None
    root, pc = _tree(tmp_path, "garbage\n0::/x\n", {"x/cpu.max": "lots 0\n"})
    assert machine.cpu_quota(root, pc) is None
    root, pc = _tree(tmp_path / "zero", "0::/\n", {"cpu.max": "100000 0\n"})
    assert machine.cpu_quota(root, pc) is None


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="Linux affinity")
def test_usable_cpus_is_the_affinity_capped_by_the_quota_rounded_up(tmp_path):
    affinity = len(os.sched_getaffinity(0))
    none = machine.usable_cpus(tmp_path / "absent", tmp_path / "absent_proc")
    assert none == affinity
    root, pc = _tree(tmp_path, "0::/\n", {"cpu.max": "50000 100000\n"})      # half a CPU
    assert machine.usable_cpus(root, pc) == 1
    root, pc = _tree(tmp_path / "big", "0::/\n", {"cpu.max": "6400000 100000\n"})
    assert machine.usable_cpus(root, pc) == affinity                         # 64 > affinity
    if affinity >= 2:
        root, pc = _tree(tmp_path / "frac", "0::/\n", {"cpu.max": "110000 100000\n"})
        assert machine.usable_cpus(root, pc) == 2                            # 1.1 -> 2


def _topology(tmp_path: Path, cpus: dict[int, tuple[int, int]]) -> Path:
    """cpu -> (package, core id), as /sys/devices/system/cpu/cpuN/topology has them."""
    sys_cpu = tmp_path / "sys_cpu"
    for cpu, (package, core) in cpus.items():
        topo = sys_cpu / f"cpu{cpu}" / "topology"
        topo.mkdir(parents=True)
        (topo / "physical_package_id").write_text(f"{package}\n")
        (topo / "core_id").write_text(f"{core}\n")
    return sys_cpu


def test_usable_cores_counts_smt_siblings_once_and_packages_apart(tmp_path):
    # two packages of two cores, each with two SMT siblings: cpu n and n + 4 share a core
    sys_cpu = _topology(tmp_path, {0: (0, 0), 1: (0, 1), 2: (1, 0), 3: (1, 1),
                                   4: (0, 0), 5: (0, 1), 6: (1, 0), 7: (1, 1)})
    none = (tmp_path / "absent", tmp_path / "absent_proc")

    def cores(cpus):
        return machine.usable_cores(*none, sys_cpu=sys_cpu, cpus=set(cpus))
    assert cores(range(8)) == 4
    assert cores({0, 4}) == 1                      # one core's two siblings
    assert cores({0, 2}) == 2                      # core 0 of each package
    assert cores({0, 1, 4, 5}) == 2                # numactl --cpunodebind=0
    assert cores({0, 9}) == 2                      # cpu 9 has no topology: it counts alone
    root, pc = _tree(tmp_path, "0::/\n", {"cpu.max": "300000 100000\n"})
    assert machine.usable_cores(root, pc, sys_cpu=sys_cpu, cpus=set(range(8))) == 3


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="Linux affinity")
def test_usable_cores_follows_the_affinity_mask():
    """Under ``taskset -c 0`` the process may use one core however many the machine has."""
    before = os.sched_getaffinity(0)
    try:
        os.sched_setaffinity(0, {min(before)})
        assert machine.usable_cpus() == machine.usable_cores() == 1
        assert machine.describe()["cores"] == 1
    finally:
        os.sched_setaffinity(0, before)
