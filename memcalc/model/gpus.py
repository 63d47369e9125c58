"""A GPU as memcalc sees it: dense peak rates, memory, bandwidth, architecture and links; the table of the
cards people train on (memcalc.model.gpu_table), a card described in a JSON file (--gpu FILE.json), and a
cap on what the job may use of it (--gpu-memory).

Rates are dense tensor-core TFLOP/s (sparse figures are 2x these), at the accumulate PyTorch's matmuls use:
fp32 accumulate for bf16 and fp16 (cuBLAS's CUBLAS_COMPUTE_32F), which GeForce cards run at half their
fp16-accumulate rate. fp32 is the non-tensor-core rate, which PyTorch uses for fp32 matmuls unless TF32 is
switched on (torch.backends.cuda.matmul.allow_tf32 defaults to False since PyTorch 1.12). It is also the
vector rate memcalc.time.roofline gives elementwise kernels: ATen computes bf16/fp16 elementwise math in
fp32 (at::opmath_type), so the datasheets' 16-bit non-tensor rates do not apply.
memory_mib is the total the driver reports for the card (nvidia-smi, rocm-smi), not the marketing "GB".
What PyTorch holds beyond the tensors (context, workspaces, allocator) is memcalc.model.headroom's.
"""

from __future__ import annotations

import math
from dataclasses import replace

from memcalc.errors import InputError
from memcalc.records import record

from .sizes import parse_bytes

MIB = 1 << 20
# Host (CPU) memory of one node, which offload fills: a DGX H100 or DGX H200 holds 2 TB for its 8 GPUs
# (NVIDIA DGX H100/H200 datasheets, "System Memory 2TB"). --host-memory changes it.
HOST_MEMORY_BYTES = 2 * 10**12
GPUS_PER_NODE = 8
MAX_TFLOPS = 1e6  # a million TFLOP/s on one chip: beyond any card (a GB200 is 2,500 dense bf16)
MAX_MEMORY_MIB = 1 << 24  # 16 TiB on one card
MAX_SMS = 1 << 16  # multiprocessors on one card (a B200 has 148, an MI300X 304 compute units)


@record(frozen=True)
class GPU:
    """A GPU's dense peak rates, memory, bandwidth and links, from its datasheet; with what this job may use
    of its memory (memory_cap_bytes, --gpu-memory) and the headroom asked for (--headroom)."""

    key: str
    name: str
    bf16_tflops: float  # dense tensor-core peak, fp32 accumulate; 0: no bf16 (Volta, Turing)
    fp16_tflops: float
    tf32_tflops: float  # 0: no TF32 (before Ampere)
    fp32_tflops: float  # non-tensor-core
    memory_mib: int  # the driver's total (nvidia-smi memory.total)
    bandwidth_gbps: float  # HBM/GDDR bandwidth, GB/s (decimal)
    source: str
    fp8_tflops: float = 0.0  # dense FP8 tensor-core peak (E4M3/E5M2); 0: no FP8 tensor cores (A100)
    arch: str = "sm90"  # CUDA compute capability (sm90) or ROCm target (gfx942): cuBLAS's workspace follows it
    intra: str = "nvlink4"  # memcalc.parallel.links.LINKS keys: inside a node,
    inter: str = "ndr"  # between nodes,
    host: str = "pcie5"  # and to the host
    memory_cap_bytes: int = 0  # --gpu-memory: at most this much of the card is the job's; 0: all of it
    headroom_spec: str = ""  # --headroom as given ("2GB", "10%"); "": memcalc.model.headroom's default
    expandable_segments: bool = False  # PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (--expandable-segments)
    derived: str = ""  # what a --gpu file left out, and what memcalc derived for it or holds unknown (0)
    cuda_total_mib: int = 0  # torch.cuda.mem_get_info's total as published for the card; 0: none (cuda_total_bytes)
    sms: int = 0  # streaming multiprocessors (compute units on ROCm): multi_processor_count; 0: not known
    colocated_bytes: int = 0  # held beside the step by an engine in its process (TRL's colocated vLLM: --rl grpo)
    colocated: str = ""  # what holds them, for the headroom's line

    def __post_init__(self) -> None:
        check_gpu(self)

    @property
    def memory_bytes(self) -> int:
        """The card's memory, or the --gpu-memory cap below it."""
        card = self.memory_mib * MIB
        return min(card, self.memory_cap_bytes) if self.memory_cap_bytes else card

    @property
    def cuda_total_bytes(self) -> int:
        """What torch.cuda.mem_get_info reports as the card's total (vLLM's total_gpu_memory): the published
        figure, else the driver's total less the median reserve of the cards that have one
        (memcalc.model.gpu_table.CUDA_RESERVE_MIB); under --gpu-memory, the cap where it is lower."""
        from .gpu_table import CUDA_RESERVE_MIB

        card = (self.cuda_total_mib or max(1, self.memory_mib - CUDA_RESERVE_MIB)) * MIB
        return min(card, self.memory_cap_bytes) if self.memory_cap_bytes else card

    @property
    def rocm(self) -> bool:
        return self.arch.startswith("gfx")

    @property
    def capability(self) -> int | None:
        """CUDA's compute capability as its arch writes it (sm90: 90); None on ROCm, or for a --gpu file's arch that
        names none."""
        digits = self.arch.removeprefix("sm")
        return int(digits) if self.arch.startswith("sm") and digits.isdigit() else None

    def peak_flops(self, precision: str) -> float:
        """Dense peak FLOP/s for matmuls in that precision recipe."""
        return getattr(self, PEAK_FIELDS[precision]) * 1e12


PEAK_FIELDS = {"bf16": "bf16_tflops", "fp16": "fp16_tflops", "fp32": "fp32_tflops",  # GPU.peak_flops by precision,
               "fp8-e4m3": "fp8_tflops", "fp8-e5m2": "fp8_tflops"}  # or by a float8 matmul's operands
RATES = ("bf16_tflops", "fp16_tflops", "tf32_tflops", "fp32_tflops", "fp8_tflops")
PEAK_RATES = ("bf16_tflops", "fp16_tflops", "fp32_tflops")  # a card has one at least; 0: none, or not known
ROOFLINE_NEEDS = ("fp32_tflops", "bandwidth_gbps")  # the roofline's vector rate and byte rate (time.roofline)


def check_gpu(g: GPU) -> None:
    """One line for each way a GPU record can be wrong (a JSON file's fields arrive here too)."""
    for name in ("key", "name", "source", "arch", "intra", "inter", "host"):
        if not isinstance(getattr(g, name), str) or not getattr(g, name).strip():
            raise InputError(f"GPU {name} must be a non-empty string, got {getattr(g, name)!r}")
    for name in RATES + ("bandwidth_gbps",):
        value = getattr(g, name)
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        if not ok or value < 0 or value > MAX_TFLOPS:
            raise InputError(f"GPU {g.key}: {name} must be a number >= 0 (0: none, or not known), got {value!r}")
    if not any(getattr(g, name) for name in PEAK_RATES):
        raise InputError(f"GPU {g.key}: needs a peak rate: {', '.join(PEAK_RATES[:-1])} or {PEAK_RATES[-1]}")
    if isinstance(g.memory_mib, bool) or not isinstance(g.memory_mib, int) or not 0 < g.memory_mib <= MAX_MEMORY_MIB:
        raise InputError(f"GPU {g.key}: memory_mib must be a whole number of MiB in [1, {MAX_MEMORY_MIB:,}], "
                         f"got {g.memory_mib!r}")  # fmt: skip
    if isinstance(g.cuda_total_mib, bool) or not isinstance(g.cuda_total_mib, int) or \
            not 0 <= g.cuda_total_mib <= g.memory_mib:  # fmt: skip
        raise InputError(f"GPU {g.key}: cuda_total_mib must be a whole number of MiB in [1, memory_mib], got "
                         f"{g.cuda_total_mib!r}")  # fmt: skip
    if isinstance(g.sms, bool) or not isinstance(g.sms, int) or not 0 <= g.sms <= MAX_SMS:
        raise InputError(f"GPU {g.key}: sms must be a whole number of multiprocessors in [1, {MAX_SMS:,}], "
                         f"got {g.sms!r}")  # fmt: skip
    if g.memory_cap_bytes > g.memory_mib * MIB:
        raise InputError(f"--gpu-memory {g.memory_cap_bytes:,} bytes is more than the {g.name} has "
                         f"({g.memory_mib:,} MiB = {g.memory_mib * MIB:,} bytes)")  # fmt: skip


def check_precision(g: GPU, precision: str, fp8: str = "") -> None:
    """Refuse a recipe the card has no tensor cores for: bf16 before Ampere (torch.cuda.is_bf16_supported() is
    False on sm70/sm75: no bf16 matmul units, bf16 arithmetic emulated), fp8 (the recipe's trick name:
    fp8, fp8:rowwise, fp8:te) before Hopper/Ada."""
    if precision == "bf16" and not g.bf16_tflops:
        raise InputError(f"bf16 needs bf16 tensor cores (Ampere or later); the {g.name} has none "
                         "(torch.cuda.is_bf16_supported() is False there): use fp16")  # fmt: skip
    if not g.peak_flops(precision):  # fp16 or fp32 that a --gpu file does not give (every table card has both)
        raise InputError(f"{precision} needs the card's {PEAK_FIELDS[precision]}, which its --gpu file does not "
                         "give: add it to the file, or name another precision")  # fmt: skip
    if fp8 and not g.fp8_tflops:
        raise InputError(f"{fp8} needs FP8 tensor cores (Ada, Hopper or later); the {g.name} has none")


def roofline_gaps(g: GPU) -> list[str]:
    """What the roofline needs of the card and a --gpu file left out (0: not known); [] for a table card."""
    return [name for name in ROOFLINE_NEEDS if not getattr(g, name)]


def half_precision(g: GPU) -> str:
    """The 16-bit recipe the card runs: bf16, or fp16 where it has no bf16 tensor cores (check_precision)."""
    return "bf16" if g.bf16_tflops else "fp16"


def gpu(key: str) -> GPU:
    """A card of the table by its key (case and spaces ignored)."""
    from .gpu_table import GPUS

    name = key.strip().lower()
    if name not in GPUS:
        raise InputError(f"unknown GPU {key!r}; known: {', '.join(GPUS)}; or a JSON file describing one "
                         "(docs/gpus.md)")  # fmt: skip
    return GPUS[name]


def find_gpu(spec: str, memory: str | None = None, headroom: str | None = None, expandable: bool = False) -> GPU:
    """--gpu KEY or --gpu FILE.json, capped at --gpu-memory SIZE, with --headroom and --expandable-segments as
    given."""
    from .gpu_file import load_gpu, looks_like_file
    from .headroom import parse_headroom

    card = load_gpu(spec) if looks_like_file(spec) else gpu(spec)
    if memory is not None:
        card = replace(card, memory_cap_bytes=parse_bytes(memory, "gpu-memory", MAX_MEMORY_MIB * MIB))
        card = replace(card, name=f"{card.name} (--gpu-memory {memory.strip()})")
    if headroom is not None:
        parse_headroom(headroom)  # refused here, once, with its flag's name
        card = replace(card, headroom_spec=headroom.strip())
    return replace(card, expandable_segments=True) if expandable else card

def __getattr__(name: str):
    """The table and its sources (memcalc.model.gpu_table) under their old home's names: GPUS, DEFAULT_GPU, ..."""
    from . import gpu_table

    try:
        return getattr(gpu_table, name)
    except AttributeError:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
