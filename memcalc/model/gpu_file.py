"""--gpu FILE.json: a card memcalc's table does not have, described with the table's fields.

    {"key": "rtx-a6000", "name": "NVIDIA RTX A6000 48GB", "memory_mib": 49140, "bandwidth_gbps": 768,
     "fp16_tflops": 154.8, "bf16_tflops": 154.8, "tf32_tflops": 77.4, "fp32_tflops": 38.7,
     "source": "https://www.nvidia.com/.../rtx-a6000-datasheet.pdf"}

Required: key, name, memory_mib, bandwidth_gbps, fp16_tflops, fp32_tflops, source. Optional: bf16_tflops,
tf32_tflops, fp8_tflops (left out: the card has none), arch (sm80 unless given: cuBLAS's workspace follows it),
intra, inter, host (memcalc.parallel.links keys; pcie4, hdr, pcie4 unless given). Every rate given must be
positive; a missing field, an unknown one or a wrong type is one InputError line (read by jsonfile's bounded read).
"""

from __future__ import annotations

from .gpus import GPU
from .jsonfile import brief, read_json_object
from memcalc.errors import InputError

REQUIRED = ("key", "name", "memory_mib", "bandwidth_gbps", "fp16_tflops", "fp32_tflops", "source")
OPTIONAL = {"bf16_tflops": 0.0, "tf32_tflops": 0.0, "fp8_tflops": 0.0, "arch": "sm80", "intra": "pcie4",
            "inter": "hdr", "host": "pcie4"}  # fmt: skip
TEXT = ("key", "name", "source", "arch", "intra", "inter", "host")


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
        raise InputError(f"GPU file {path}: missing field {missing[0]!r} (needs {', '.join(REQUIRED)})")
    for k, v in data.items():
        if k in TEXT and not (isinstance(v, str) and v.strip()):
            raise InputError(f"GPU file {path}: {k} must be a non-empty string, got {brief(v)}")
        if k not in TEXT and k != "memory_mib" and not positive(v):
            raise InputError(f"GPU file {path}: {k} must be a positive number, got {brief(v)}")
    if data["key"].strip().lower() in GPUS:
        raise InputError(f"GPU file {path}: key {data['key']!r} is a card in memcalc's table; give yours another key")
    fields = {**OPTIONAL, **data}
    fields["key"] = fields["key"].strip().lower()
    return GPU(**fields)


def positive(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0
