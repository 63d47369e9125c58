"""The interconnect: links and the fabrics GPUs come with, what the time model assumes, and the
traffic of one collective as one GPU sees it.

Ring algorithms (NCCL; nccl-tests doc/PERFORMANCE.md, "bus bandwidth"): over n ranks each GPU sends
  all-reduce      2(n − 1)/n · B
  reduce-scatter   (n − 1)/n · B   (B: the full, unsharded buffer)
  all-gather       (n − 1)/n · B
and receives as much at the same time, so a collective takes factor · B / (link rate · efficiency), the
efficiency NCCL reached on the cluster's link where it was measured (Link.efficiency), else the one assumed.
Latency (the α of α-β models) is left out: the messages here are megabytes and more.

A group of n ranks `stride` apart spans stride·n consecutive GPUs (rank order tp, cp, dp, pp); inside one
node it runs on NVLink, across nodes on InfiniBand: a ring collective on the NICs of all its ranks in a node
(link_for), point-to-point sends on each GPU's own NIC.
"""

from __future__ import annotations

from dataclasses import replace

from memcalc.errors import InputError
from memcalc.model.gpu_table import (
    A100_DATASHEET,
    GB200_NVL72,
    GPUS,
    H100_DATASHEET,
    H800_SOURCE,
    HGX_B200,
    MI300X_PAGE,
    V100_DATASHEET,
)
from memcalc.model.gpus import GPU
from memcalc.records import record


@record(frozen=True)
class Link:
    """An interconnect and its bandwidth per GPU and direction."""

    key: str
    name: str
    gb_per_s: float  # per GPU, per direction, decimal GB/s
    source: str
    efficiency: float | None = None  # busbw / rate NCCL reaches on it, where the cluster's was measured; None: assumed

    @property
    def bytes_per_s(self) -> float:
        return self.gb_per_s * 1e9

    def reached(self, assume: Assumptions) -> float:
        """Bytes per second a large collective moves on it: its rate at the efficiency measured for it, else
        at the one assumed (Assumptions.efficiency)."""
        return self.bytes_per_s * (assume.efficiency if self.efficiency is None else self.efficiency)


H200_PAGE = "https://www.nvidia.com/en-us/data-center/h200/"
DGX_H100 = "https://docs.nvidia.com/dgx/dgxh100-user-guide/introduction-to-dgxh100.html"
DGX_A100 = "https://docs.nvidia.com/dgx/dgxa100-user-guide/introduction-to-dgxa100.html"
DGX_2 = "https://docs.nvidia.com/dgx/dgx2-user-guide/introduction-to-dgx2.html"
FRONTIER = "https://docs.olcf.ornl.gov/systems/frontier_user_guide.html"  # a node's 4 MI250X (8 GCDs), 4 NICs
PCIE_SPEC = "PCI-SIG base specifications: x16 at 16/32/64 GB/s per direction for Gen3/4/5"

LINKS: dict[str, Link] = {
    k.key: k
    for k in (
        Link("nvlink5", "NVLink 5 via NVSwitch", 900, f"NVLink 1.8 TB/s per GPU, both directions: {HGX_B200}"),
        Link("nvlink4", "NVLink 4 via NVSwitch", 450,
             f"NVLink 900 GB/s per GPU, both directions: {H100_DATASHEET}; {H200_PAGE}"),
        Link("nvlink3", "NVLink 3 via NVSwitch", 300, f"NVLink 600 GB/s per GPU, both directions: {A100_DATASHEET}"),
        Link("nvlink2", "NVLink 2 (DGX-1 mesh, DGX-2 NVSwitch)", 150,
             f"NVLink 300 GB/s per GPU, both directions: {V100_DATASHEET}"),
        Link("nvlink-h800", "NVLink 4 via NVSwitch, H800 (export limit)", 200,
             f"NVLink 400 GB/s per GPU, both directions; 160 GB/s measured (DeepSeek-V3 report sec. 3.2.2): {H800_SOURCE}"),
        Link("xgmi-mi300", "AMD Infinity Fabric, 7 links to the node's 7 peers", 448,
             f"7 links x 128 GB/s both directions (896 GB/s peer bandwidth): {MI300X_PAGE}"),
        Link("xgmi-mi250x", "AMD Infinity Fabric between MI250X GCDs", 50,
             f"50-100 GB/s per direction between GCDs of different MI250X, 200 within one: {FRONTIER}"),
        Link("pcie5", "PCIe Gen5 x16", 64, f"PCIe Gen5 128 GB/s, both directions: {H100_DATASHEET}"),
        Link("pcie4", "PCIe Gen4 x16", 32, f"PCIe Gen4 64 GB/s, both directions: {A100_DATASHEET}"),
        Link("pcie3", "PCIe Gen3 x16", 16, f"PCIe Gen3 32 GB/s, both directions: {V100_DATASHEET}; {PCIE_SPEC}"),
        Link("c2c", "NVLink-C2C to the Grace CPU", 450, f"NVLink-C2C 900 GB/s, both directions: {GB200_NVL72}"),
        Link("if-cpu", "AMD Infinity Fabric to the CPU", 36,
             f"36 GB/s per direction from each GCD to the CPU: {FRONTIER}"),
        Link("ndr", "InfiniBand NDR, 400 Gb/s per GPU", 50,
             f"DGX H100: 8 ConnectX-7 400 Gb/s NICs, one per GPU: {DGX_H100}"),
        Link("hdr", "InfiniBand HDR, 200 Gb/s per GPU", 25,
             f"DGX A100: 8 ConnectX-6 200 Gb/s HDR NICs, one per GPU: {DGX_A100}"),
        Link("edr", "InfiniBand EDR, 100 Gb/s per two GPUs", 6.25,
             f"DGX-2: 8 EDR 100 Gb/s NICs for 16 V100s (DGX-1: 4 for 8): {DGX_2}"),
        Link("slingshot", "HPE Slingshot, 200 Gb/s per two GCDs", 12.5,
             f"Frontier: 4 Slingshot 200 Gb/s (25 GB/s) NICs for a node's 8 GCDs: {FRONTIER}"),
    )
}  # fmt: skip


@record(frozen=True)
class Fabric:
    """The links a GPU type usually comes with: inside a node, between nodes, to its host."""

    intra: Link
    inter: Link
    host: Link


def fabric_of(gpu: GPU) -> Fabric:
    """The links the GPU record names (GPU.intra, .inter, .host). PCIe cards (A10, L4, L40S, GeForce, H100 PCIe
    and NVL) have no NVLink switch: eight in a node talk over PCIe, NVLink bridges join pairs at most. Their
    inter-node link is an assumption (a 200 Gb/s NIC per GPU, as a DGX A100): their servers vary."""
    links = []
    for part in ("intra", "inter", "host"):
        key = getattr(gpu, part)
        if key not in LINKS:
            raise InputError(f"GPU {gpu.key}: unknown {part} link {key!r}; known: {', '.join(LINKS)}")
        links.append(LINKS[key])
    return Fabric(*links)


FABRICS: dict[str, Fabric] = {key: fabric_of(g) for key, g in GPUS.items()}


@record(frozen=True)
class Assumptions:
    """What the time model assumes. An overlap share s hides min(comm, s · window) of a transfer behind
    the compute that can run beside it; what is left is exposed and adds to the step.
    """

    efficiency: float = 0.8  # busbw / link rate NCCL's rings reach on large messages (calibrate: nccl-tests)
    overlap_dp: float = 1.0  # gradients reduced behind backward (DDP buckets, Li et al. 2020), gathers behind forward
    overlap_tp: float = 0.0  # TP collectives sit between dependent matmuls (Megatron-LM without TP comm overlap)
    overlap_pp: float = 0.0  # stage-to-stage sends on the critical path of 1F1B
    overlap_cp: float = 1.0  # ring attention sends the next K/V chunk while computing this one (Liu et al. 2023)
    overlap_offload: float = 1.0  # PCIe copies of gradients/weights behind backward/forward (ZeRO-Offload, sec. 4)
    # CPU Adam: ~4e9 parameters/s on one host (ZeRO-Offload's CPU-Adam on a DGX-2's two 24-core Xeons,
    # Ren et al. 2021, order of magnitude); the node's GPUs share it. Exposed: no delayed parameter update.
    cpu_adam_params_per_s: float = 4e9
    # MoE's all-to-all sits between the router and the experts and between the experts and the combine: on
    # the critical path (DeepSeek-V3's DualPipe hides it behind another micro-batch; not modelled)
    overlap_ep: float = 0.0
    # the inter-node link's rate per GPU and direction, GB/s, where the cluster's is not the GPU type's usual one
    # (FABRICS); None: FABRICS's
    inter_node_gb_per_s: float | None = None
    # busbw / link rate NCCL reaches between nodes where it was measured on the cluster (nccl-tests and the like,
    # large messages, one ring's hop between two nodes); None: efficiency
    inter_node_efficiency: float | None = None


ASSUMPTIONS = Assumptions()


def fabric_for(gpu: GPU, assume: Assumptions) -> Fabric:
    """The links of a GPU (fabric_of), with the inter-node one at the rate and efficiency assumed where given."""
    fabric = fabric_of(gpu)
    rate, efficiency = assume.inter_node_gb_per_s, assume.inter_node_efficiency
    if rate is None and efficiency is None:
        return fabric
    inter = fabric.inter
    if rate is not None:
        inter = Link("inter-node", f"inter-node, {rate:g} GB/s per GPU", rate, "assumed (Assumptions.inter_node_gb_per_s)")
    if efficiency is None:
        return replace(fabric, inter=inter)
    inter = replace(inter, name=f"{inter.name}, NCCL at {efficiency:.0%} of it (measured)", efficiency=efficiency)
    # NVLink's named too, so that link_for weighs a node's NICs against it at what each reaches
    return replace(fabric, intra=replace(fabric.intra, efficiency=assume.efficiency), inter=inter)


@record(slots=True)
class Comm:
    """One kind of traffic in a step, as one GPU sees it."""

    name: str
    group: str  # "tp", "cp", "pp", "dp×cp", "host"
    ranks: int
    link: str  # LINKS key
    calls: int  # per step
    bytes: int  # sent by one GPU per step (ring factors applied)
    formula: str
    seconds: float  # at the link's rate × efficiency
    exposed_seconds: float  # what overlap leaves on the critical path


# A ring collective through several nodes crosses between them on every NIC of the group's ranks in a node:
# NCCL lays one channel on each NIC in turn (src/graph/search.cc) and its bus bandwidth is the channels' sum
# (src/graph/tuning.cc, busBw = nChannels · bwInter); all-reduce busbw ~45 GB/s with 4 GPUs per node, ~90 GB/s
# with 8 on the same 4 nodes (NVIDIA/nccl issue #1168).
RING_NICS = "NCCL: a channel per NIC, busBw = nChannels · bwInter (src/graph/tuning.cc); NVIDIA/nccl#1168"


def link_for(fabric: Fabric, span: int, gpus_per_node: int, ranks: int = 1) -> Link:
    """NVLink when the group's span of consecutive ranks fits in a node; else the NICs between nodes. A ring
    collective over `ranks` runs on the NICs of the group's ranks in one node at once (ranks · gpus_per_node
    / span of them, at most NVLink's rate); point-to-point and all-to-all traffic (ranks 1) on each GPU's own."""
    if span <= gpus_per_node:
        return fabric.intra
    per_node = max(1, min(ranks, gpus_per_node * ranks // span))
    if per_node == 1:
        return fabric.inter
    nics = replace(fabric.inter, gb_per_s=per_node * fabric.inter.gb_per_s)
    binding = min((fabric.intra, nics), key=lambda link: link.gb_per_s * (link.efficiency or 1.0))  # at most NVLink's
    return Link(f"{fabric.inter.key}x{per_node}", nics_name(fabric.inter, per_node), binding.gb_per_s,
                f"{fabric.inter.source}; {RING_NICS}", binding.efficiency)


def nics_name(inter: Link, per_node: int) -> str:
    return f"{inter.name}, {per_node} NICs of each node in the ring"


def link_name(fabric: Fabric, key: str) -> str:
    """The name of the link a Comm rides (Comm.link): one of the fabric's, or its NICs k at a time ('ndrx8')."""
    for link in (fabric.intra, fabric.inter, fabric.host):
        if link.key == key:
            return link.name
    base, _, per_node = key.rpartition("x")
    if base != fabric.inter.key or not per_node.isdigit():
        raise ValueError(f"no link {key!r} in this fabric")  # a bug: every Comm rides one of the fabric's links
    return nics_name(fabric.inter, int(per_node))


def exposed(seconds: float, share: float, window: float, tail: float = 0.0) -> float:
    """What is left of a transfer after hiding up to share · window behind compute; at least its last
    `tail` fraction, which runs after the compute it could hide behind has ended."""
    return max(0.0, seconds - share * window, tail * seconds)


def ring(name: str, group: str, ranks: int, link: Link, calls: int, factor: int, message: int, formula: str,
         assume: Assumptions, share: float, window: float, tail: float = 0.0) -> Comm:  # fmt: skip
    """`calls` ring collectives of `message` bytes each: factor 2 for all-reduce, 1 for all-gather or
    reduce-scatter, times (n − 1)/n (NCCL bus bytes). `window`: the compute all the calls can hide behind."""
    sent = calls * factor * (ranks - 1) * message // ranks
    seconds = sent / link.reached(assume)
    return Comm(name, group, ranks, link.key, calls, sent, formula, seconds, exposed(seconds, share, window, tail))


def send(name: str, group: str, ranks: int, link: Link, calls: int, sent: int, formula: str,
         assume: Assumptions, share: float, window: float) -> Comm:  # fmt: skip
    """Point-to-point traffic: `sent` bytes in all, sent while as much is received."""
    seconds = sent / link.reached(assume)
    return Comm(name, group, ranks, link.key, calls, sent, formula, seconds, exposed(seconds, share, window))


@record(slots=True)
class MicroBatch:
    """Seconds one GPU of the slowest stage computes for one micro-batch."""

    forward: float
    backward: float
    recompute: float  # checkpointed forwards rerun in backward
    attention: float  # the attention core, all passes: ring attention's K/V exchange hides behind it
    layers: int  # transformer layers on that stage

    @property
    def seconds(self) -> float:
        return self.forward + self.backward + self.recompute

    @property
    def backward_window(self) -> float:
        """The backward with its recompute: what gradient traffic can hide behind."""
        return self.backward + self.recompute
