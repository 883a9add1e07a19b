"""NUMA placement (`kvdepot serve --numa`, server/memory/numa.py, docs/architecture.md §7).

The decision is checked against sysfs trees written into temporary directories in the
layout the kernel uses (a 2-socket host with 8 GPUs, and others): that is the data
`read_topology` reads on a real host. What the daemon does with it is checked on this
host's one node with the kernel's own answers: the pool's policy in numa_maps after a
real mbind on the real arena, each copy thread's affinity as the thread reads it and as
/proc shows it for a running `kvdepot serve`, and `kvdepot status`'s numa line.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
from pathlib import Path

import pytest

from kvdepot.server.copy_queue import CopyQueue
from kvdepot.server.memory import numa
from kvdepot.server.memory.arena import Arena
from tests.support.daemon import kvdepot_command
from tests.support.faults import DaemonFactory
from tests.support.status_cli import status, status_json

# --- a fake host's sysfs ------------------------------------------------------------------


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def _sysfs(
    root: Path, nodes: dict[int, tuple[str, int]], gpus: dict[str, int], other_pci: int = 2
) -> Path:
    """nodes: id -> (cpulist, MemTotal GiB); gpus: PCI address -> node (-1: none)."""
    for n, (cpus, gib) in nodes.items():
        d = root / numa.NODE_DIR / f"node{n}"
        _write(d / "cpulist", cpus + "\n")
        _write(
            d / "meminfo",
            f"Node {n} MemTotal:       {gib << 20} kB\nNode {n} MemFree:        1024 kB\n",
        )
    pci = root / numa.PCI_DIR
    for bdf, node in gpus.items():
        _write(pci / bdf / "vendor", "0x10de\n")
        _write(pci / bdf / "class", "0x030200\n")  # 3D controller
        _write(pci / bdf / "numa_node", f"{node}\n")
    for i in range(other_pci):  # a NIC and a host bridge: not GPUs
        _write(pci / f"0000:00:0{i}.0" / "vendor", "0x8086\n")
        _write(pci / f"0000:00:0{i}.0" / "class", "0x020000\n" if i else "0x060000\n")
        _write(pci / f"0000:00:0{i}.0" / "numa_node", "0\n")
    return root


# Two sockets of 32 CPUs (16 cores x 2 threads, siblings interleaved as Linux numbers
# them), 4 GPUs on each, and node 2: memory without CPUs (HBM or CXL exposed as a node).
TWO_SOCKETS = {0: ("0-15,32-47", 512), 1: ("16-31,48-63", 512), 2: ("", 96)}
BUSES = (0x18, 0x2A, 0x3A, 0x5D, 0x9A, 0xAB, 0xBA, 0xDB)  # the first four on socket 0
EIGHT_GPUS = {f"0000:{bus:02x}:00.0": 0 if bus < 0x80 else 1 for bus in BUSES}
ALL_CPUS = range(64)
NODE0 = numa.parse_cpulist("0-15,32-47")
NODE1 = numa.parse_cpulist("16-31,48-63")


@pytest.fixture
def host(tmp_path: Path) -> numa.Topology:
    return numa.read_topology(_sysfs(tmp_path, TWO_SOCKETS, EIGHT_GPUS))


def test_sysfs_of_two_sockets_and_eight_gpus(host: numa.Topology) -> None:
    assert [(n.id, n.cpus, n.mem_bytes) for n in host.nodes] == [
        (0, NODE0, 512 << 30),
        (1, NODE1, 512 << 30),
        (2, frozenset(), 96 << 30),
    ]
    assert sorted(host.gpu_nodes) == [0, 0, 0, 0, 1, 1, 1, 1]  # the NIC and bridge are not
    assert host.nodes_of({3, 20}) == [0, 1] and host.nodes_of({40}) == [0]


def test_auto_interleaves_over_the_gpus_nodes_and_spreads_the_threads(
    host: numa.Topology,
) -> None:
    p = numa.place("auto", host, ALL_CPUS)
    assert (p.policy, p.nodes, p.host_nodes) == ("interleave", (0, 1), 3)
    assert "8 GPU" in p.basis
    assert p.threads(4) == [(0, NODE0), (1, NODE1), (0, NODE0), (1, NODE1)]
    assert "node 0: 0-15,32-47; node 1: 16-31,48-63" in p.describe()


def test_each_gpus_copy_threads_go_on_its_own_node(host: numa.Topology) -> None:
    """The pool interleaves over both sockets, but a GPU's own copy threads (its DMA's
    issue and wait) go on its socket, found by the PCI address the driver gives."""
    assert host.gpu_addresses == tuple(sorted(EIGHT_GPUS))
    p = numa.place("auto", host, ALL_CPUS)
    assert p.device_threads("0000:18:00.0", 2) == [(0, NODE0)] * 2
    assert p.device_threads("0000:DB:00.0", 2) == [(1, NODE1)] * 2  # the driver's case
    # A GPU the host does not list: the shared threads' placement.
    assert p.device_threads("0000:77:00.0", 2) == p.threads(2)
    assert p.device_threads("", 1) == p.threads(1)
    # Shard 0 of 2 keeps its pool on socket 0, yet serves a GPU on socket 1 from there.
    assert numa.place("auto", host, ALL_CPUS, 0, 2).device_threads("0000:9a:00.0", 1) == [
        (1, NODE1)
    ]
    # Within a cpuset: only the CPUs the daemon may use; a node with none of them
    # gives its GPUs the shared placement.
    inside = numa.place("auto", host, range(16, 24))
    assert inside.device_threads("0000:9a:00.0", 1) == [(1, frozenset(range(16, 24)))]
    assert inside.device_threads("0000:18:00.0", 1) == inside.threads(1)
    assert numa.place("off", host, ALL_CPUS).device_threads("0000:18:00.0", 2) == [None, None]


def test_auto_gives_each_shard_the_node_of_its_gpus(host: numa.Topology) -> None:
    """Shard s serves consecutive ranks, so consecutive GPUs: on two sockets of four GPUs,
    two shards each keep to one socket; four shards pair up; three do not split evenly."""
    two = [numa.place("auto", host, ALL_CPUS, shard=s, shards=2) for s in (0, 1)]
    assert [(p.policy, p.nodes) for p in two] == [("preferred", (0,)), ("preferred", (1,))]
    assert two[1].threads(2) == [(1, NODE1)] * 2 and "shard 1 of 2" in two[1].basis
    four = [numa.place("auto", host, ALL_CPUS, shard=s, shards=4).nodes for s in range(4)]
    assert four == [(0,), (0,), (1,), (1,)]
    assert numa.place("auto", host, ALL_CPUS, shard=2, shards=3).nodes == (0, 1)
    # Explicit settings are the operator's: every shard takes them as given.
    assert numa.place("1", host, ALL_CPUS, shard=0, shards=2).nodes == (1,)


def test_auto_without_gpus_shards_split_the_cpus_nodes(tmp_path: Path) -> None:
    topo = numa.read_topology(_sysfs(tmp_path, TWO_SOCKETS, {}))
    assert [numa.place("auto", topo, ALL_CPUS, s, 2).nodes for s in (0, 1)] == [(0,), (1,)]


def test_auto_on_one_gpu_node_prefers_it(tmp_path: Path) -> None:
    gpus = {bdf: 1 for bdf in EIGHT_GPUS}
    topo = numa.read_topology(_sysfs(tmp_path, TWO_SOCKETS, gpus))
    p = numa.place("auto", topo, ALL_CPUS)
    assert (p.policy, p.nodes, p.threads(2)) == ("preferred", (1,), [(1, NODE1)] * 2)


def test_auto_without_gpus_follows_the_daemons_cpuset(tmp_path: Path) -> None:
    # e.g. systemd's AllowedCPUs=16-31 or a container's cpuset; a GPU with no node
    # (numa_node -1, as on one-node VMs) counts as no GPU.
    topo = numa.read_topology(_sysfs(tmp_path, TWO_SOCKETS, {"0000:3b:00.0": -1}))
    assert topo.gpu_nodes == ()
    p = numa.place("auto", topo, range(16, 24))
    assert (p.policy, p.nodes, p.threads(1)) == ("preferred", (1,), [(1, frozenset(range(16, 24)))])
    assert numa.place("auto", topo, ALL_CPUS).nodes == (0, 1)


def test_explicit_settings(host: numa.Topology) -> None:
    inter = numa.place("interleave", host, ALL_CPUS)
    assert (inter.policy, inter.nodes) == ("interleave", (0, 1))  # not the CPU-less node
    bind = numa.place("1", host, ALL_CPUS)
    assert (bind.policy, bind.nodes, bind.threads(2)) == ("bind", (1,), [(1, NODE1)] * 2)
    # Memory alone, named by the operator: bound there; the threads are not pinned.
    hbm = numa.place("2", host, ALL_CPUS)
    assert (hbm.policy, hbm.nodes, hbm.threads(2)) == ("bind", (2,), [None, None])
    off = numa.place("off", host, ALL_CPUS)
    assert (off.policy, off.nodes, off.threads(2)) == ("off", (), [None, None])
    with pytest.raises(numa.NumaError, match=r"node 5 has no memory.*nodes with memory: 0,1,2"):
        numa.place("0,5", host, ALL_CPUS)


def test_setting_text() -> None:
    assert [numa.parse_setting(t) for t in (" AUTO", "off", "Interleave", "1,0,1")] == [
        "auto",
        "off",
        "interleave",
        "0,1",
    ]
    for bad in ("", "fast", "0-1", "-1", "0,", "node0"):
        with pytest.raises(ValueError, match="is not auto, off, interleave or a node list"):
            numa.parse_setting(bad)
    assert numa.format_cpulist(numa.parse_cpulist("0-3,8,10-11\n")) == "0-3,8,10-11"
    assert numa.parse_cpulist("") == frozenset()


# --- this host: the kernel's answers ------------------------------------------------------


def _policy_in_numa_maps(address: int, pid: int | str = "self") -> str:
    for line in Path(f"/proc/{pid}/numa_maps").read_text().splitlines():
        start, policy, *_ = line.split()
        if int(start, 16) == address:
            return policy
    raise AssertionError(f"no mapping at {address:#x} in numa_maps")


@pytest.mark.parametrize(
    ("setting", "policy"),
    [("auto", "prefer:0"), ("interleave", "interleave:0"), ("0", "bind:0"), ("off", "default")],
)
def test_the_pool_gets_its_policy_before_its_pages(setting: str, policy: str) -> None:
    arena = Arena(4 << 20, None, numa.host_placement(setting))
    try:
        assert _policy_in_numa_maps(arena.address) == policy
        arena.start_warmup(1 << 20)
        assert arena.wait_warmup(10)
        pages = Path("/proc/self/numa_maps").read_text()
        line = next(x for x in pages.splitlines() if int(x.split()[0], 16) == arena.address)
        assert "N0=1024" in line  # every page faulted, on the one node
    finally:
        arena.close()


def test_copy_threads_pin_themselves() -> None:
    mine = os.sched_getaffinity(0)
    last = frozenset({max(mine)})
    q = CopyQueue(1, [last])
    try:
        assert q.thread_cpus == [last]
        # The copy itself runs there, and the caller's thread is left as it was.
        assert asyncio.run(q.run(lambda: os.sched_getaffinity(0))) == last
        assert os.sched_getaffinity(0) == mine
    finally:
        q.close()
    unpinned = CopyQueue(2)
    try:
        assert unpinned.thread_cpus == [None, None]
        assert asyncio.run(unpinned.run(lambda: os.sched_getaffinity(0))) == mine
    finally:
        unpinned.close()


# --- the daemon ---------------------------------------------------------------------------


def _threads_cpus(pid: int) -> set[str]:
    """Cpus_allowed_list of each of the process's threads, as the kernel shows them."""
    return {
        (task / "status").read_text().split("Cpus_allowed_list:")[1].split()[0]
        for task in Path(f"/proc/{pid}/task").iterdir()
    }


def test_daemon_places_and_reports(daemon_factory: DaemonFactory) -> None:
    cpus = numa.format_cpulist(os.sched_getaffinity(0))
    d = daemon_factory("--pool-size", "8MiB", "--copy-threads", "2")
    s = d.stats()
    assert (s.numa_policy, list(s.numa_pool_nodes), s.numa_host_nodes) == ("preferred", [0], 1)
    assert list(s.numa_copy_thread_nodes) == [0, 0]
    assert list(s.numa_copy_thread_cpus) == [cpus, cpus]
    assert d.proc is not None
    pool = next(
        x
        for x in Path(f"/proc/{d.proc.pid}/numa_maps").read_text().splitlines()
        if "kvdepot-pool" in x
    )
    assert pool.split()[1] == "prefer:0"
    report = status_json(d.socket_path, "--interval", "0")["numa"]
    assert (
        report["policy"] == "preferred"
        and report["copy_threads"] == [{"node": 0, "cpus": cpus}] * 2
    )
    # No GPU registered: no GPU copy threads (each GPU gets its own at its first).
    assert (list(s.gpu_copy_devices), s.gpu_copy_threads, list(s.gpu_copy_nodes)) == ([], 2, [])
    assert (report["gpu_copy_devices"], report["gpu_copy_threads"]) == ([], 2)
    screen = status("--socket", d.socket_path, "--interval", "0").stdout
    assert "numa        1 node: pool preferred on node 0, 2 copy threads on it" in screen
    assert "GPU copy threads" not in screen


def test_numa_off_leaves_the_kernel_to_it(daemon_factory: DaemonFactory) -> None:
    d = daemon_factory("--pool-size", "8MiB", "--copy-threads", "2", "--numa", "off")
    s = d.stats()
    assert (s.numa_policy, list(s.numa_pool_nodes)) == ("off", [])
    assert list(s.numa_copy_thread_cpus) == ["", ""]
    assert d.proc is not None
    pool = next(
        x
        for x in Path(f"/proc/{d.proc.pid}/numa_maps").read_text().splitlines()
        if "kvdepot-pool" in x
    )
    assert pool.split()[1] == "default"
    # Every thread keeps the process's affinity, as before --numa existed.
    assert _threads_cpus(d.proc.pid) == {numa.format_cpulist(os.sched_getaffinity(d.proc.pid))}
    screen = status("--socket", d.socket_path, "--interval", "0").stdout
    assert "numa        off (--numa off)" in screen


@pytest.mark.parametrize(
    ("value", "says"),
    [("fast", "is not auto, off, interleave or a node list"), ("7", "node 7 has no memory")],
)
def test_a_bad_value_is_one_line_exit_2(value: str, says: str) -> None:
    out = subprocess.run(
        [*kvdepot_command(), "serve", "--numa", value],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    (line,) = out.stderr.strip().splitlines()
    assert line.startswith("kvdepot serve: error: argument --numa:") and says in line, line
