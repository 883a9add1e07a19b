"""Where the pool's memory and the copy threads go on a NUMA host (`--numa`).

Promises: `place(setting, topology, allowed_cpus)` decides a `Placement` without I/O
from a `Topology` (the host's nodes, their CPUs and memory, the GPUs' nodes) and the
CPUs the daemon may run on; `read_topology(root)` reads that topology from sysfs
(`root` is "/" in the daemon, a directory tree in the tests). The arena applies the
placement's memory policy to the pool before it is faulted (server/memory/arena.py) and
the copy threads pin themselves to `Placement.thread_cpus` (server/copy_queue.py).

`auto` (the default) serves the GPUs: the pool goes on the node of the host's NVIDIA
GPUs, interleaved over their nodes when they span several (the daemon serves every
engine on the host, and an engine's GPU is not known before it registers); a host
without GPUs uses the nodes of the CPUs the daemon may run on (its cpuset). Shard s of
S (`--shards`) serves consecutive ranks (kvdepot.common.shards), which run on
consecutive GPUs: it takes the s-th S-th of the GPUs in PCI order (CUDA's order on a
host of one GPU model), or of the nodes without GPUs, when they split evenly, so a
two-socket host's two shards each keep their pool and copy threads on their own socket. Only nodes
with CPUs count for `auto`: a node of memory alone (a GPU's HBM exposed as a node, CXL)
is never chosen without being named. One node gets MPOL_PREFERRED, which falls back to
other nodes when it is full rather than failing a page fault; several get
MPOL_INTERLEAVE. `NODE[,NODE]` binds (MPOL_BIND: the operator said where); `interleave`
spreads over every node with CPUs; `off` sets no policy and pins no thread (the
kernel's defaults: first touch, any CPU). Copy threads go round-robin over the pool's
nodes, each pinned to its node's CPUs that the daemon may use. A GPU's own copy threads
(server/copy_queue.CopyQueues) go on that GPU's node whenever the placement is not off
(`Placement.device_threads`, by the PCI address the driver gives): they issue its DMA
and wait for its completions, which the driver signals from that node's PCIe root.

Called once at start on the main thread (startup.open_pool); `parse_setting` also runs
in the settings table (server/config/) so that a bad value is one line, exit 2.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

NODE_DIR = "sys/devices/system/node"
PCI_DIR = "sys/bus/pci/devices"
NVIDIA_VENDOR = "0x10de"
GPU_CLASSES = ("0x0300", "0x0302")  # VGA and 3D controllers (class code's first 4 digits)


@dataclass(frozen=True)
class Node:
    id: int
    cpus: frozenset[int]
    mem_bytes: int  # MemTotal


@dataclass(frozen=True)
class Topology:
    nodes: tuple[Node, ...]
    gpu_nodes: tuple[int, ...] = ()  # one entry per GPU: its node (GPUs without one left out)
    gpu_addresses: tuple[str, ...] = ()  # each of those GPUs' PCI address (pci_address form)

    def node(self, node_id: int) -> Node | None:
        return next((n for n in self.nodes if n.id == node_id), None)

    def nodes_of(self, cpus: Iterable[int]) -> list[int]:
        """The nodes holding any of `cpus` (a process's affinity: the nodes it runs on)."""
        cpus = frozenset(cpus)
        return [n.id for n in self.nodes if n.cpus & cpus]


@dataclass(frozen=True)
class Placement:
    """What the daemon does: a memory policy over `nodes` for the pool and the CPU sets
    its copy threads run on (one per node, in `nodes`' order; empty: not pinned)."""

    policy: str  # "off", "preferred", "bind" or "interleave"
    nodes: tuple[int, ...] = ()
    thread_cpus: tuple[frozenset[int], ...] = ()
    basis: str = "off"  # why, for the log and `kvdepot status`
    host_nodes: int = 0
    thread_nodes: tuple[int, ...] = field(default=())  # the node of each thread_cpus entry
    # Each GPU's node and the CPUs of it the daemon may use, by PCI address (GPUs whose
    # node has none of those CPUs left out); empty when the placement is off.
    gpu_cpus: tuple[tuple[str, int, frozenset[int]], ...] = field(default=())

    def threads(self, count: int) -> list[tuple[int, frozenset[int]] | None]:
        """(node, CPUs) for each of `count` copy threads, round-robin over the nodes;
        None for each when nothing is pinned."""
        if not self.thread_cpus:
            return [None] * count
        pairs = list(zip(self.thread_nodes, self.thread_cpus, strict=True))
        return [pairs[i % len(pairs)] for i in range(count)]

    def cpus(self, count: int) -> list[frozenset[int] | None]:
        """The CPU set of each of `count` copy threads (`threads` without the nodes)."""
        return [t[1] if t else None for t in self.threads(count)]

    def device_threads(
        self, pci_bus_id: str, count: int
    ) -> list[tuple[int, frozenset[int]] | None]:
        """(node, CPUs) for each of `count` copy threads of the GPU at `pci_bus_id` (any
        form `pci_address` reads): its own node's CPUs when the host says where it is,
        else the shared threads' placement (`threads`)."""
        address = pci_address(pci_bus_id)
        for gpu, node, cpus in self.gpu_cpus:
            if gpu == address:
                return [(node, cpus)] * count
        return self.threads(count)

    def describe(self) -> str:
        if self.policy == "off":
            return f"numa off ({self.basis}): the kernel places the pool and the copy threads"
        return (
            f"numa: pool {self.policy} on node(s) {format_list(self.nodes)} ({self.basis}); "
            "copy threads on CPUs "
            + "; ".join(
                f"node {n}: {format_cpulist(c)}"
                for n, c in zip(self.thread_nodes, self.thread_cpus, strict=True)
            )
        )


OFF = Placement("off")


class NumaError(ValueError):
    """A `--numa` value this host cannot honour; str() says what is allowed."""


# --- parsing (sans I/O) -------------------------------------------------------------------


def parse_cpulist(text: str) -> frozenset[int]:
    """sysfs's list format, "0-3,8,10-11" (also a node list); "" is empty."""
    out: set[int] = set()
    for part in text.strip().split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        if not lo.isdigit() or (hi and not hi.isdigit()):
            raise ValueError(f"{text!r} is not a CPU or node list such as 0-3,8")
        out.update(range(int(lo), int(hi or lo) + 1))
    return frozenset(out)


def format_cpulist(cpus: Iterable[int]) -> str:
    """The inverse of parse_cpulist: runs folded into ranges."""
    runs: list[list[int]] = []
    for c in sorted(cpus):
        if runs and c == runs[-1][1] + 1:
            runs[-1][1] = c
        else:
            runs.append([c, c])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def format_list(nodes: Iterable[int]) -> str:
    return ",".join(str(n) for n in nodes)


def pci_address(text: str) -> str:
    """A PCI address in sysfs's form, "0000:3b:00.0", from the driver's ("0000:3B:00.0"
    or "00000000:3B:00.0"); "" when `text` is not one."""
    m = re.fullmatch(
        r"([0-9a-fA-F]{1,8}):([0-9a-fA-F]{1,2}):([0-9a-fA-F]{1,2})\.([0-7])", text.strip()
    )
    if not m:
        return ""
    domain, bus, device, function = (int(g, 16) for g in m.groups())
    return f"{domain:04x}:{bus:02x}:{device:02x}.{function:x}"


def parse_meminfo_total(text: str) -> int:
    """MemTotal of a node's meminfo ("Node 0 MemTotal:  24683792 kB"), in bytes."""
    m = re.search(r"MemTotal:\s+(\d+)\s*kB", text)
    return int(m.group(1)) << 10 if m else 0


def parse_setting(text: str) -> str:
    """`--numa`'s text, checked for form: auto, off, interleave or NODE[,NODE]
    (normalized: lower case, nodes sorted). Whether the nodes exist is `place`'s."""
    value = text.strip().lower()
    if value in ("auto", "off", "interleave"):
        return value
    if re.fullmatch(r"\d+(,\d+)*", value):
        return format_list(sorted({int(n) for n in value.split(",")}))
    raise ValueError(f"{text!r} is not auto, off, interleave or a node list such as 0 or 0,1")


# --- the decision (sans I/O) --------------------------------------------------------------


def check_nodes(setting: str, topo: Topology) -> list[int]:
    """The nodes of a parsed NODE[,NODE] value; NumaError unless each has memory."""
    nodes = [int(n) for n in setting.split(",")]
    missing = [n for n in nodes if not getattr(topo.node(n), "mem_bytes", 0)]
    if missing:
        have = format_list(n.id for n in topo.nodes if n.mem_bytes) or "none"
        raise NumaError(
            f"node {format_list(missing)} has no memory on this host (nodes with memory: {have})"
        )
    return nodes


def _share(items: list[int], shard: int, shards: int) -> tuple[list[int], str]:
    """Shard `shard`'s slice of `items` when they split evenly (else all), and how the
    basis says it."""
    if shards <= 1 or not items or len(items) % shards:
        return items, ""
    per = len(items) // shards
    return items[shard * per : (shard + 1) * per], f", shard {shard} of {shards}'s share"


def place(
    setting: str, topo: Topology, allowed_cpus: Iterable[int], shard: int = 0, shards: int = 1
) -> Placement:
    """The placement for a parsed `--numa` value on `topo`, for a daemon (shard `shard`
    of `shards`) that may run on `allowed_cpus`. Raises NumaError for nodes the host
    does not have."""
    setting = parse_setting(setting)
    allowed = frozenset(allowed_cpus)
    with_cpus = topo.nodes_of(allowed)
    if setting == "off" or not topo.nodes:
        basis = "--numa off" if setting == "off" else "no NUMA nodes in sysfs"
        return Placement("off", basis=basis, host_nodes=len(topo.nodes))
    if setting == "auto":
        gpus, share = _share(list(topo.gpu_nodes), shard, shards)
        gpu = sorted({n for n in gpus if n in with_cpus})
        if gpu:
            nodes = gpu
            basis = f"auto: the node(s) of the host's {len(topo.gpu_nodes)} GPU(s){share}"
        else:
            nodes, share = _share(with_cpus, shard, shards)
            basis = f"auto: the nodes of the daemon's CPUs{share}"
        policy = "preferred" if len(nodes) == 1 else "interleave"
    elif setting == "interleave":
        nodes, basis, policy = with_cpus, "--numa interleave", "interleave"
    else:
        nodes = check_nodes(setting, topo)
        basis, policy = f"--numa {setting}", "bind"
    if not nodes:  # a cpuset outside every node (should not happen): leave it be
        return Placement("off", basis="no node holds the daemon's CPUs", host_nodes=len(topo.nodes))
    # `nodes` come from topo.nodes_of: each is a node of `topo`
    pinned = [(n, topo.node(n).cpus & allowed) for n in nodes]  # type: ignore[union-attr]
    pinned = [(n, c) for n, c in pinned if c]  # a memory-only node gets no threads
    gpu_cpus: list[tuple[str, int, frozenset[int]]] = [
        (address, n, getattr(topo.node(n), "cpus", frozenset()) & allowed)
        for address, n in zip(topo.gpu_addresses, topo.gpu_nodes, strict=False)
    ]
    return Placement(
        policy,
        tuple(nodes),
        tuple(c for _, c in pinned),
        basis,
        len(topo.nodes),
        tuple(n for n, _ in pinned),
        tuple((a, n, c) for a, n, c in gpu_cpus if c),
    )


# --- reading the host ---------------------------------------------------------------------


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except OSError:
        return None


def read_topology(root: Path | str = "/") -> Topology:
    """The nodes under `root`/sys/devices/system/node and the NVIDIA GPUs' nodes under
    `root`/sys/bus/pci/devices. A host without the node directory has no nodes."""
    root = Path(root)
    nodes = []
    node_dir = root / NODE_DIR
    for d in sorted(node_dir.glob("node[0-9]*"), key=lambda p: int(p.name[4:])):
        cpus = _read(d / "cpulist")
        mem = _read(d / "meminfo")
        nodes.append(
            Node(
                int(d.name[4:]),
                parse_cpulist(cpus) if cpus else frozenset(),
                parse_meminfo_total(mem) if mem else 0,
            )
        )
    gpus, addresses = [], []
    for dev in sorted((root / PCI_DIR).glob("*")):
        vendor, cls = _read(dev / "vendor"), _read(dev / "class")
        if vendor is None or cls is None:
            continue
        if vendor.strip() != NVIDIA_VENDOR or not cls.strip().startswith(GPU_CLASSES):
            continue
        node = _read(dev / "numa_node")
        if node is not None and node.strip().lstrip("-").isdigit() and int(node) >= 0:
            gpus.append(int(node))
            addresses.append(pci_address(dev.name))
    return Topology(tuple(nodes), tuple(gpus), tuple(addresses))


def host_placement(
    setting: str, root: Path | str = "/", shard: int = 0, shards: int = 1
) -> Placement:
    """`place` for this host and this process's CPU affinity."""
    if parse_setting(setting) == "off":
        return place("off", Topology(()), ())
    return place(setting, read_topology(root), os.sched_getaffinity(0), shard, shards)
