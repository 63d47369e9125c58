"""--gpu FILE.json: a card memcalc's table does not have, described with the table's fields.

    {"key": "rtx-a6000", "name": "NVIDIA RTX A6000 48GB", "memory_mib": 49140, "bandwidth_gbps": 768,
     "fp16_tflops": 154.8, "bf16_tflops": 154.8, "tf32_tflops": 77.4, "fp32_tflops": 38.7,
     "source": "https://www.nvidia.com/.../rtx-a6000-datasheet.pdf"}

Required: name, memory_mib, and one peak rate of bf16_tflops, fp16_tflops, fp32_tflops. The rest is optional:
key (the file's name without .json), source (the file's path), bf16_tflops, tf32_tflops, fp8_tflops (left out:
the card has none), fp16_tflops (left out: bf16_tflops where given, FP16_FROM_BF16; else not known),
fp32_tflops and bandwidth_gbps (left out: not known, 0: the roofline needs both, so such a card's step is
timed end to end at --mfu, and fp32 recipes are refused), arch (sm80 unless given: cuBLAS's workspace
follows it), intra, inter, host (memcalc.parallel.links keys; pcie4, hdr, pcie4 unless given), cuda_total_mib
(torch.cuda.mem_get_info's total, which `memcalc serve` budgets from; left out: GPU.cuda_total_bytes's rule),
sms (the multiprocessors, torch.cuda.get_device_properties(0).multi_processor_count: vLLM's Triton top-k/top-p
buffer follows it, memcalc.serve.profile; left out: not known, and serve refuses the releases that need it).
What was left out and what memcalc did for it is GPU.derived, said on stderr. Every rate given must be positive; a missing
field, an unknown one or a wrong type is one InputError line (read by jsonfile's bounded read).
"""

from __future__ import annotations

from pathlib import Path

from .gpus import GPU, PEAK_RATES, ROOFLINE_NEEDS
from .jsonfile import brief, read_json_object
from memcalc.errors import InputError

REQUIRED = ("name", "memory_mib")  # and one of PEAK_RATES
OPTIONAL = {"key": "", "source": "", "bandwidth_gbps": 0.0, "fp16_tflops": 0.0, "fp32_tflops": 0.0,
            "bf16_tflops": 0.0, "tf32_tflops": 0.0, "fp8_tflops": 0.0, "arch": "sm80", "intra": "pcie4",
            "inter": "hdr", "host": "pcie4", "cuda_total_mib": 0, "sms": 0}  # fmt: skip
TEXT = ("key", "name", "source", "arch", "intra", "inter", "host")
# fp16 left out beside bf16: every card of memcalc's table with bf16 tensor cores (Ampere, Ada, Hopper,
# Blackwell, CDNA2/3) has one dense BF16/FP16 figure on its datasheet (memcalc.model.gpu_table), fp32 accumulate
FP16_FROM_BF16 = "fp16_tflops = bf16_tflops (every bf16 card's datasheet gives one figure for both)"


def looks_like_file(spec: str) -> bool:
    """A path rather than a table key: it ends in .json or names a folder."""
    s = spec.strip()
    return s.lower().endswith(".json") or "/" in s or "\\" in s


def load_gpu(path: str) -> GPU:
    """The card the file describes (see the module's docstring)."""
    from .gpu_table import GPUS

    data = read_json_object(path.strip(), "GPU")
    unknown = [k for k in data if k not in REQUIRED and k not in OPTIONAL]
    if unknown:
        raise InputError(f"GPU file {path}: unknown field {brief(unknown[0])}; known: "
                         f"{', '.join(REQUIRED + tuple(OPTIONAL))}")  # fmt: skip
    missing = [k for k in REQUIRED if k not in data]
    if missing:
        raise InputError(f"GPU file {path}: missing field {missing[0]!r} (needs {', '.join(REQUIRED)} and a peak "
                         f"rate)")  # fmt: skip
    if not any(k in data for k in PEAK_RATES):
        raise InputError(f"GPU file {path}: needs a peak rate: {', '.join(PEAK_RATES[:-1])} or {PEAK_RATES[-1]}")
    for k, v in data.items():
        if k in TEXT and not (isinstance(v, str) and v.strip()):
            raise InputError(f"GPU file {path}: {k} must be a non-empty string, got {brief(v)}")
        if k not in TEXT and k != "memory_mib" and not positive(v):
            raise InputError(f"GPU file {path}: {k} must be a positive number, got {brief(v)}")
    key = data.get("key", Path(path.strip()).stem).strip().lower()
    if key in GPUS:
        named = f"key {data['key']!r}" if "key" in data else f"its name {key!r} (the key when none is given)"
        raise InputError(f"GPU file {path}: {named} is a card in memcalc's table; give yours another key")
    fields = {**OPTIONAL, **data, "key": key, "source": data.get("source", path.strip())}
    if "fp16_tflops" not in data and "bf16_tflops" in data:
        fields["fp16_tflops"] = data["bf16_tflops"]
    return GPU(**fields, derived=derived(data))


def derived(data: dict) -> str:
    """What the file left out that matters, and what memcalc does for it ("" when nothing)."""
    said = [FP16_FROM_BF16] if "fp16_tflops" not in data and "bf16_tflops" in data else []
    if "fp16_tflops" not in data and "bf16_tflops" not in data:
        said.append("no fp16_tflops: fp16 refused")
    gaps = [k for k in ROOFLINE_NEEDS if k not in data]
    if gaps:
        said.append(f"no {', '.join(gaps)}: step time by --mfu end to end (0.4 unless given), not the roofline")
    if "fp32_tflops" not in data:
        said.append("fp32 refused")
    return "; ".join(said)


def positive(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0
