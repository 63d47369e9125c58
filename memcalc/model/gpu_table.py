"""The cards people train on, each from its vendor's datasheet or whitepaper (the URL beside it).

Figures are dense (no 2:4 sparsity): a datasheet's starred "with sparsity" figure is halved. bf16 and fp16
are the tensor-core rates with fp32 accumulate, which PyTorch's matmuls use; GeForce cards run those at half
their fp16-accumulate rate (Ada whitepaper, appendix table: RTX 4090 "Peak FP16 Tensor TFLOPS with FP32
Accumulate" 165.2, not the 330.3 of fp16 accumulate), data-center cards at the full rate. Volta and Turing
have no bf16 tensor cores (torch.cuda.is_bf16_supported() is False below sm80): bf16_tflops 0, and a bf16 job
is refused on them (memcalc.engine.job). memory_mib: the driver's total, as nvidia-smi's memory.total and
rocm-smi's "VRAM Total Memory" print it on those cards (ECC on where the card has it: an A10 shows 23,028 MiB,
24,564 without); the MI325X's is its datasheet's 256 GB read as GiB (no driver total was found).
Links (intra, inter, host) are memcalc.parallel.links keys.
cuda_total_mib: what torch.cuda.mem_get_info reports as the total, which vLLM budgets from ("total_gpu_memory"
in its startup log, printed in GiB to two decimals: the MiB here are that figure x 1024, rounded), where a log
prints it (CUDA_TOTAL_SOURCES); elsewhere GPU.cuda_total_bytes derives it as memory_mib less CUDA_RESERVE_MIB.
"""

from __future__ import annotations

from dataclasses import replace

from .gpus import GPU

H100_DATASHEET = "https://resources.nvidia.com/en-us-tensor-core/nvidia-tensor-core-gpu-datasheet"
A100_DATASHEET = "https://www.nvidia.com/en-us/data-center/a100/"  # the specifications table (datasheet r4)
H200_PAGE = "https://www.nvidia.com/en-us/data-center/h200/"
H800_SOURCE = ("DeepSeek-V3 technical report (arXiv:2412.19437) sec. 3.1 and 3.2.2: H800 SXM, the H100's GH100 "
               "compute and 80 GB HBM3, NVLink at 400 GB/s both directions; peak and HBM as the H100 SXM datasheet")
H100_HBM2E_SOURCE = ("pytorch/torchtitan docs/performance.md @ d4c86e3758a84cf23e2e879ab3c995cba9d5e410: Grand Teton, "
                     "96GB HBM2e at 2.4 TB/s per H100, 500 W; footnote 1 of the page @ 3faaa1a0dee68ce028400e3dafd1735d152cb4f8: "
                     "95 GB, its peak between the SXM's and the NVL's; no datasheet: the SXM's 989 TFLOP/s stands in, an upper bound")
H20_SOURCE = ("no NVIDIA datasheet is public (the China export part): 96 GB HBM3 at 4.0 TB/s, FP16/BF16 148, TF32 74, "
              "FP32 44, FP8 296 dense, NVLink 900 GB/s, as reported at https://willitrunai.com/es/gpus/h20-96gb")
V100_DATASHEET = ("NVIDIA V100 datasheet (volta-v100-datasheet-update-us-1165301-r5.pdf): "
                  "https://www.nvidia.com/en-us/data-center/v100/")
T4_PAGE = "https://www.nvidia.com/en-us/data-center/tesla-t4/"  # FP16 65 TFLOPS is its mixed FP16/FP32 rate
A10_PAGE = "https://www.nvidia.com/en-us/data-center/products/a10-gpu/"
A10G_SOURCE = ("AWS's GA102 part (EC2 G5), no NVIDIA datasheet: FP16/BF16 tensor 70, TF32 35, FP32 35 TFLOPS, 24 GB "
               "GDDR6 at 600 GB/s, https://www.baseten.co/blog/nvidia-a10-vs-a10g-for-ml-model-inference/")
L4_PAGE = "https://www.nvidia.com/en-us/data-center/l4/"
L40S_PAGE = ("https://www.nvidia.com/en-us/data-center/l40s/ (datasheet: BF16/FP16 tensor 362.05 dense, 733 with "
             "sparsity; TF32 183; FP8 733; FP32 91.6)")
AMPERE_GA102 = ("https://www.nvidia.com/content/PDF/nvidia-ampere-ga-102-gpu-architecture-whitepaper-v2.pdf, RTX 3090: "
                "FP16/BF16 tensor with FP32 accumulate 71 dense (142 with FP16 accumulate)")
ADA_WHITEPAPER = ("https://images.nvidia.com/aem-dam/Solutions/geforce/ada/nvidia-ada-gpu-architecture.pdf, RTX 4090: "
                  "FP16/BF16 tensor with FP32 accumulate 165.2 dense (330.3 with FP16 accumulate), FP8 330.3")
BLACKWELL_RTX = ("NVIDIA RTX Blackwell GPU architecture whitepaper (images.nvidia.com, "
                 "nvidia-rtx-blackwell-gpu-architecture.pdf), RTX 5090: NVIDIA's 838.4 FP16 and 1,676.8 FP8 tensor "
                 "TFLOPS are sparse with FP16 accumulate; halved for dense and again for FP32 accumulate, as GeForce "
                 "runs it (the Ada whitepaper's ratio): 209.6, FP8 419.2, TF32 104.8")
H100_NVL = f"{H100_DATASHEET} (H100 NVL column, per GPU: 94 GB HBM3 at 3.9 TB/s; NVLink bridges join pairs)"
HGX_B200 = ("https://www.nvidia.com/en-us/data-center/hgx/ (HGX B200, per GPU: FP8 4.5, BF16 2.25, TF32 1.125 PFLOPS "
            "dense, FP32 75 TFLOPS, 180 GB HBM3e at 8 TB/s, NVLink 5 1.8 TB/s)")
GB200_NVL72 = ("https://www.nvidia.com/en-us/data-center/gb200-nvl72/ (NVL72 totals / 72 GPUs, halved for sparsity: "
               "FP8 5, "
               "BF16 2.5, TF32 1.25 PFLOPS dense, FP32 90 TFLOPS, 186 GB HBM3e at 8 TB/s; NVLink-C2C to the Grace CPU)")
MI250X_PAGE = ("https://www.amd.com/en/products/accelerators/instinct/mi200/mi250x.html, halved: ROCm shows each "
               "of the "
               "package's two GCDs as one device (64 GB, 1.6 TB/s, 191.5 dense BF16 of the package's 383)")
MI300X_PAGE = "https://www.amd.com/en/products/accelerators/instinct/mi300/mi300x.html"
MI325X_PAGE = "https://www.amd.com/en/products/accelerators/instinct/mi300/mi325x.html"

# Published "total_gpu_memory (X GiB)" of vLLM's startup log (V0 worker.py), or PyTorch's out-of-memory message
# ("GPU 0; X GiB total capacity", the total of cudaMemGetInfo that mem_get_info returns), per card
CUDA_TOTAL_SOURCES = {
    "h100-sxm": "79.22 GiB, https://github.com/vllm-project/vllm/pull/10511 (H100 80GB HBM3, Llama-3-8B)",
    "rtx3090": "23.58 GiB, https://github.com/vllm-project/vllm/issues/10517 and /issues/14447",
    "a100-40gb": "39.38 GiB, https://github.com/vllm-project/vllm/issues/16570 (A100 40GB x 4)",
    "a100-80gb": "79.25 GiB total capacity, https://github.com/levihsu/OOTDiffusion/issues/235 (an A100's OOM)",
}
CUDA_TOTALS_MIB = {"h100-sxm": 81121, "rtx3090": 24146, "a100-40gb": 40325, "a100-80gb": 81152}  # x 1024 of the GiB
# The driver's total less mem_get_info's on those four cards: 438, 430, 635 and 768 MiB; their median (the lower
# of the middle two, whole MiB) stands in for a card no log prints (what the driver keeps outside CUDA's reach)
CUDA_RESERVE_MIB = 438

# Multiprocessors per card (torch.cuda.get_device_properties().multi_processor_count, which vLLM's
# num_compute_units reads): the whitepapers' enabled SMs, or CUDA cores / cores per SM on the datasheet
SMS = {"v100-16gb": 80, "v100-32gb": 80,  # Volta whitepaper: Tesla V100, 80 SMs
       "t4": 40,  # Turing whitepaper: T4, 40 SMs (2,560 CUDA cores)
       "a100-40gb": 108, "a100-80gb": 108, "a100-pcie": 108,  # A100 whitepaper: 108 SMs
       "a10": 72, "rtx3090": 82,  # GA102 whitepaper: A10 9,216 and RTX 3090 10,496 CUDA cores, 128 a SM
       "a10g": 72,  # huggingface.co/docs/hugs/hardware: A10G 9,216 CUDA cores, 288 Tensor cores (4 a SM)
       "rtx4090": 128, "l4": 58, "l40s": 142,  # Ada: 16,384, 7,424 and 18,176 CUDA cores, 128 a SM
       "h100-sxm": 132, "h100-pcie": 114, "h100-nvl": 132, "h200": 132, "h800": 132,  # Hopper whitepaper
       "h100-hbm2e": 132,  # an SXM5 H100, as its row's peak
       "h20": 78,  # reported from Geekbench 6 (no datasheet, as H20_SOURCE)
       "b200": 148, "gb200": 148, "rtx5090": 170,  # Blackwell: 148 SMs a GPU; RTX 5090 21,760 CUDA cores
       "mi250x": 110, "mi300x": 304, "mi325x": 304}  # AMD: compute units (MI250X: 220 a package, 110 a GCD)

GPUS: dict[str, GPU] = {
    g.key: g
    for g in (
        # Volta (sm70): no bf16, no TF32; DGX-1 / DGX-2 boards, NVLink 2
        GPU("v100-16gb", "NVIDIA V100 SXM2 16GB", 0, 125, 0, 15.7, 16160, 900, V100_DATASHEET, 0, "sm70",
            "nvlink2", "edr", "pcie3"),
        GPU("v100-32gb", "NVIDIA V100 SXM2 32GB", 0, 125, 0, 15.7, 32510, 900, V100_DATASHEET, 0, "sm70",
            "nvlink2", "edr", "pcie3"),
        # Turing (sm75): a PCIe inference card, no bf16
        GPU("t4", "NVIDIA T4 16GB", 0, 65, 0, 8.1, 15360, 320, T4_PAGE, 0, "sm75", "pcie3", "hdr", "pcie3"),
        # Ampere (sm80, sm86)
        GPU("a100-40gb", "NVIDIA A100 SXM 40GB", 312, 312, 156, 19.5, 40960, 1555, A100_DATASHEET, 0, "sm80",
            "nvlink3", "hdr", "pcie4"),
        GPU("a100-80gb", "NVIDIA A100 SXM 80GB", 312, 312, 156, 19.5, 81920, 2039, A100_DATASHEET, 0, "sm80",
            "nvlink3", "hdr", "pcie4"),
        GPU("a100-pcie", "NVIDIA A100 PCIe 80GB", 312, 312, 156, 19.5, 81920, 1935, A100_DATASHEET, 0, "sm80",
            "pcie4", "hdr", "pcie4"),
        GPU("a10", "NVIDIA A10 24GB", 125, 125, 62.5, 31.2, 23028, 600, A10_PAGE, 0, "sm86", "pcie4", "hdr", "pcie4"),
        GPU("a10g", "NVIDIA A10G 24GB (AWS)", 70, 70, 35, 35, 23028, 600, A10G_SOURCE, 0, "sm86", "pcie4", "hdr",
            "pcie4"),
        GPU("rtx3090", "NVIDIA GeForce RTX 3090 24GB", 71, 71, 35.6, 35.6, 24576, 936, AMPERE_GA102, 0, "sm86",
            "pcie4", "hdr", "pcie4"),
        # Ada (sm89): FP8 tensor cores
        GPU("rtx4090", "NVIDIA GeForce RTX 4090 24GB", 165.2, 165.2, 82.6, 82.6, 24564, 1008, ADA_WHITEPAPER, 330.3,
            "sm89", "pcie4", "hdr", "pcie4"),
        GPU("l4", "NVIDIA L4 24GB", 121, 121, 60, 30.3, 23034, 300, L4_PAGE, 242.5, "sm89", "pcie4", "hdr", "pcie4"),
        GPU("l40s", "NVIDIA L40S 48GB", 362.05, 362.05, 183, 91.6, 46068, 864, L40S_PAGE, 733, "sm89", "pcie4", "hdr",
            "pcie4"),
        # Hopper (sm90)
        GPU("h100-sxm", "NVIDIA H100 SXM 80GB", 989, 989, 494.5, 67, 81559, 3350, H100_DATASHEET, 1979),
        GPU("h100-pcie", "NVIDIA H100 PCIe 80GB", 756, 756, 378, 51, 81559, 2000, H100_DATASHEET, 1513, intra="pcie5"),
        GPU("h100-nvl", "NVIDIA H100 NVL 94GB", 835.5, 835.5, 417.5, 60, 95830, 3900, H100_NVL, 1670.5, intra="pcie5"),
        GPU("h200", "NVIDIA H200 SXM 141GB", 989, 989, 494.5, 67, 143771, 4800, H200_PAGE, 1979),
        # The export H100: the SXM's compute, memory and HBM3, NVLink cut to 400 GB/s
        GPU("h800", "NVIDIA H800 SXM 80GB", 989, 989, 494.5, 67, 81559, 3350, H800_SOURCE, 1979, intra="nvlink-h800"),
        # Meta's Grand Teton H100 (96 GB HBM2e at 2.4 TB/s, 500 W): no datasheet; the SXM's peak, an upper bound
        GPU("h100-hbm2e", "NVIDIA H100 96GB HBM2e (Grand Teton)", 989, 989, 494.5, 67, 95 * 1024, 2400,
            H100_HBM2E_SOURCE, 1979),
        # The China export Hopper: a GH100 with its compute cut to 15%, HBM3 and NVLink kept
        GPU("h20", "NVIDIA H20 96GB", 148, 148, 74, 44, 97871, 4000, H20_SOURCE, 296),
        # Blackwell: data center (sm100), GeForce (sm120)
        GPU("b200", "NVIDIA B200 180GB", 2250, 2250, 1125, 75, 183359, 8000, HGX_B200, 4500, "sm100", "nvlink5"),
        GPU("gb200", "NVIDIA GB200 186GB (one GPU)", 2500, 2500, 1250, 90, 189471, 8000,
            GB200_NVL72, 5000, "sm100", "nvlink5", "ndr", "c2c"),
        GPU("rtx5090", "NVIDIA GeForce RTX 5090 32GB", 209.6, 209.6, 104.8, 104.8, 32607, 1792, BLACKWELL_RTX, 419.2,
            "sm120", "pcie5", "hdr", "pcie5"),
        # AMD Instinct (ROCm): bf16 is the dense matrix-core peak
        GPU("mi250x", "AMD Instinct MI250X (one GCD) 64GB", 191.5, 191.5, 0, 23.95, 65520, 1638.4, MI250X_PAGE, 0,
            "gfx90a", "xgmi-mi250x", "slingshot", "if-cpu"),
        GPU("mi300x", "AMD Instinct MI300X 192GB", 1307.4, 1307.4, 653.7, 163.4, 196592, 5300, MI300X_PAGE, 2614.9,
            "gfx942", "xgmi-mi300", "ndr", "pcie5"),
        GPU("mi325x", "AMD Instinct MI325X 256GB", 1307.4, 1307.4, 653.7, 163.4, 262144, 6000, MI325X_PAGE, 2614.9,
            "gfx942", "xgmi-mi300", "ndr", "pcie5"),
    )
}
GPUS = {k: replace(g, cuda_total_mib=CUDA_TOTALS_MIB.get(k, 0), sms=SMS.get(k, 0)) for k, g in GPUS.items()}
DEFAULT_GPU = "h100-sxm"
