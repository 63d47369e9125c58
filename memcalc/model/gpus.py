"""Dense peak rates, memory and bandwidth of the GPUs memcalc knows.

Rates are dense tensor-core TFLOP/s from each vendor datasheet (sparse figures are 2x these; FP8 is the
datasheet's FP8 Tensor Core row, halved from its with-sparsity figure: 3,958 -> 1,979 on the H100 SXM);
fp32 is the non-tensor-core rate, which PyTorch uses for fp32 matmuls unless TF32 is switched on
(torch.backends.cuda.matmul.allow_tf32 defaults to False since PyTorch 1.12). It is also the
vector rate memcalc.time.roofline gives elementwise kernels: ATen computes bf16/fp16 elementwise math in
fp32 (at::opmath_type), so the datasheets' 16-bit non-tensor rates do not apply.
memory_mib is the total that nvidia-smi reports for the card, not the marketing "GB".
"""

from __future__ import annotations

from memcalc.errors import InputError
from memcalc.records import record

MIB = 1 << 20
# CUDA context + cuBLAS workspaces: a few hundred MB that PyTorch's allocator never sees
# (pytorch/pytorch#107667: ~300 MB context with lazy loading). Kept out of the fit verdict's
# usable memory; calibrated by `memcalc verify` on a real GPU.
CUDA_RESERVE_BYTES = 512 * MIB
# Host (CPU) memory of one node, which offload fills: a DGX H100 or DGX H200 holds 2 TB for its 8 GPUs
# (NVIDIA DGX H100/H200 datasheets, "System Memory 2TB"). --host-memory changes it.
HOST_MEMORY_BYTES = 2 * 10**12
GPUS_PER_NODE = 8


@record(frozen=True)
class GPU:
    """A GPU's dense peak rates, memory and bandwidth, from its datasheet."""

    key: str
    name: str
    bf16_tflops: float  # dense tensor-core peak
    fp16_tflops: float
    tf32_tflops: float
    fp32_tflops: float  # non-tensor-core
    memory_mib: int  # nvidia-smi memory.total
    bandwidth_gbps: float  # HBM bandwidth, GB/s (decimal)
    source: str
    fp8_tflops: float = 0.0  # dense FP8 tensor-core peak (E4M3/E5M2); 0: no FP8 tensor cores (A100)

    @property
    def memory_bytes(self) -> int:
        return self.memory_mib * MIB

    @property
    def usable_bytes(self) -> int:
        """What PyTorch's allocator can hand out: total less the CUDA context reserve."""
        return self.memory_bytes - CUDA_RESERVE_BYTES

    def peak_flops(self, precision: str) -> float:
        """Dense peak FLOP/s for matmuls in that precision recipe."""
        return getattr(self, PEAK_FIELDS[precision]) * 1e12


PEAK_FIELDS = {"bf16": "bf16_tflops", "fp16": "fp16_tflops", "fp32": "fp32_tflops",  # GPU.peak_flops by precision,
               "fp8-e4m3": "fp8_tflops", "fp8-e5m2": "fp8_tflops"}  # or by a float8 matmul's operands
H100_DATASHEET = "https://resources.nvidia.com/en-us-tensor-core/nvidia-tensor-core-gpu-datasheet"
A100_DATASHEET = "https://www.nvidia.com/en-us/data-center/a100/"  # the specifications table (datasheet r4)
H800_SOURCE = ("DeepSeek-V3 technical report (arXiv:2412.19437) sec. 3.1 and 3.2.2: H800 SXM, the H100's GH100 "
               "compute and 80 GB HBM3, NVLink at 400 GB/s both directions; peak and HBM as the H100 SXM datasheet")
H100_HBM2E_SOURCE = ("pytorch/torchtitan docs/performance.md @ d4c86e3758a84cf23e2e879ab3c995cba9d5e410: Grand Teton, "
                     "96GB HBM2e at 2.4 TB/s per H100, 500 W; footnote 1 of the page @ 3faaa1a0dee68ce028400e3dafd1735d152cb4f8: "
                     "95 GB, its peak between the SXM's and the NVL's; no datasheet: the SXM's 989 TFLOP/s stands in, an upper bound")

GPUS: dict[str, GPU] = {
    g.key: g
    for g in (
        GPU("a100-40gb", "NVIDIA A100 SXM 40GB", 312, 312, 156, 19.5, 40960, 1555, A100_DATASHEET),
        GPU("a100-80gb", "NVIDIA A100 SXM 80GB", 312, 312, 156, 19.5, 81920, 2039, A100_DATASHEET),
        GPU("h100-sxm", "NVIDIA H100 SXM 80GB", 989, 989, 494.5, 67, 81559, 3350, H100_DATASHEET, 1979),
        GPU("h100-pcie", "NVIDIA H100 PCIe 80GB", 756, 756, 378, 51, 81559, 2000, H100_DATASHEET, 1513),
        GPU("h200", "NVIDIA H200 SXM 141GB", 989, 989, 494.5, 67, 143771, 4800,
            "https://www.nvidia.com/en-us/data-center/h200/", 1979),  # fmt: skip
        # The export H100: the SXM's compute, memory and HBM3, NVLink cut to 400 GB/s (links.py)
        GPU("h800", "NVIDIA H800 SXM 80GB", 989, 989, 494.5, 67, 81559, 3350, H800_SOURCE, 1979),
        # Meta's Grand Teton H100 (96 GB HBM2e at 2.4 TB/s, 500 W): no datasheet; the SXM's peak, an upper bound
        GPU("h100-hbm2e", "NVIDIA H100 96GB HBM2e (Grand Teton)", 989, 989, 494.5, 67, 95 * 1024, 2400,
            H100_HBM2E_SOURCE, 1979),  # fmt: skip
    )
}
DEFAULT_GPU = "h100-sxm"


def gpu(key: str) -> GPU:
    name = key.strip().lower()
    if name not in GPUS:
        raise InputError(f"unknown GPU {key!r}; known: {', '.join(GPUS)}")
    return GPUS[name]
