"""How much of a GPU's datasheet peak real kernels reach: the roofline's named parameters.

A calibration is one JSON file per GPU (memcalc/time/calibrations/<gpu>.json ships the measured ones):

    {"format": "memcalc-calibration/1", "gpu": "h200", "note": "...",
     "parameters": {"matmul": {"value": 0.79, "provenance": "where it comes from"}, ...}}

A parameter the file leaves out takes memcalc's default, whose provenance says so. `memcalc estimate
--calibration PATH` reads another file; `--calibration matmul=0.7,flash=0.4` overrides single values
(`--calibration PATH,matmul=0.7`: both).
`memcalc verify` on a GPU reports predicted beside measured step time, the evidence to refit from.
"""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

from memcalc.errors import InputError
from memcalc.model.jsonfile import brief, read_json_object
from memcalc.records import record

FORMAT = "memcalc-calibration/1"
FOLDER = Path(__file__).parent / "calibrations"
# memcalc's own measurement on one H200 (PyTorch, random data), as calibrations/h200.json records it
H200_MATMUL = "torch.matmul bf16 8192³ at 769–798 TFLOP/s on one H200 (memcalc's measurement, h200.json), 783.5 / 989"
H200_COPY = "device-to-device copy at ~4.3 TB/s on one H200 (memcalc's measurement, h200.json), 4.3 / 4.8"

# name: (default, meaning, provenance of the default)
PARAMETERS: dict[str, tuple[float, str, str]] = {
    "matmul": (0.79, "fraction of the dtype's dense tensor-core peak (fp32: its CUDA-core peak) a cuBLAS matmul sustains",
               "memcalc default, not measured on this GPU: the H200's " + H200_MATMUL),
    "flash": (0.50, "fraction of the 16-bit dense peak the fused flash-attention kernel sustains on the FLOPs it executes",
              "memcalc default: FlashAttention-2 reaches 50-73% of the A100's peak (Dao 2023, arXiv 2307.08691), the low end"),
    "bandwidth": (0.90, "fraction of the datasheet HBM bandwidth a streaming kernel sustains",
                  "memcalc default, not measured on this GPU: the H200's " + H200_COPY),
    "vector": (1.0, "fraction of the FP32 CUDA-core peak elementwise kernels sustain on their arithmetic",
               "memcalc default: the datasheet rate; elementwise kernels are bandwidth-bound here, so it seldom binds"),
    "launch_us": (4.0, "microseconds a kernel takes at least: eager PyTorch's dispatch and launch",
                  "memcalc assumption (a few microseconds per eager op), to be fitted from verify's measured steps"),
    "matmul_dim": (0.0, "a matmul's efficiency falls with its size as d / (d + matmul_dim), d the harmonic mean of its "
                        "dimensions, relative to the 8192³ matmul `matmul` was measured at (0: every shape at `matmul`)",
                   "memcalc default: no shape effect"),
}  # fmt: skip
ANCHOR_DIM = 8192  # the matmul `matmul` is measured at: 8192³ (h200.json)


@record(frozen=True)
class Calibration:
    """The achievable fractions of peak (and the per-kernel floor) the roofline runs at."""

    gpu: str
    matmul: float
    flash: float
    bandwidth: float
    vector: float
    launch_us: float
    matmul_dim: float
    origin: str  # the file read, or "memcalc defaults"
    provenance: tuple[tuple[str, str], ...]  # (parameter, where its value comes from), in PARAMETERS order

    def __post_init__(self) -> None:
        for name in PARAMETERS:
            check_value(name, getattr(self, name))

    @property
    def launch_seconds(self) -> float:
        return self.launch_us * 1e-6

    def source(self, name: str) -> str:
        return dict(self.provenance)[name]

    def matmul_share(self, dim: float) -> float:
        """The fraction of the dense peak a matmul whose dimensions' harmonic mean is dim sustains:
        `matmul` at the measured 8192³, d / (d + matmul_dim) as much relative to it (small, thin and
        TP-split matmuls fill fewer of the GPU's tiles and waves), never above the peak."""
        if not self.matmul_dim:
            return self.matmul
        d, d0 = dim, self.matmul_dim
        return min(1.0, self.matmul * (d / (d + d0)) * ((ANCHOR_DIM + d0) / ANCHOR_DIM))


def check_value(name: str, value: object) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if name == "launch_us":
        if not (ok and 0 <= value <= 1000):
            raise InputError(f"calibration launch_us must be in [0, 1000] microseconds, got {brief(value)}")
    elif name == "matmul_dim":
        if not (ok and 0 <= value <= 65536):
            raise InputError(f"calibration matmul_dim must be in [0, 65536] elements, got {brief(value)}")
    elif not (ok and 0 < value <= 1):
        raise InputError(f"calibration {name} must be a fraction in (0, 1], got {brief(value)}")


def defaults(gpu: str) -> Calibration:
    values = {name: d for name, (d, _, _) in PARAMETERS.items()}
    return Calibration(gpu, **values, origin="memcalc defaults",
                       provenance=tuple((n, p) for n, (_, _, p) in PARAMETERS.items()))  # fmt: skip


def from_dict(data: object, origin: str, gpu: str) -> Calibration:
    """A calibration file's contents over memcalc's defaults; anything malformed is an InputError."""
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise InputError(f"{origin}: not a calibration file (needs \"format\": \"{FORMAT}\")")
    if data.get("gpu") not in (gpu, SAME_CHIP.get(gpu)):
        raise InputError(f"{origin} calibrates {brief(data.get('gpu'))}, not {gpu!r}")
    params = data.get("parameters", {})
    if not isinstance(params, dict):
        raise InputError(f"{origin}: \"parameters\" must be an object")
    cal, sources = defaults(gpu), dict(defaults(gpu).provenance)
    values = {}
    for name, entry in params.items():
        if name not in PARAMETERS:
            raise InputError(f"{origin}: unknown parameter {brief(name)}; known: {', '.join(PARAMETERS)}")
        if not isinstance(entry, dict) or "value" not in entry or not entry.get("provenance"):
            raise InputError(f"{origin}: {name} needs a value and its provenance")
        check_value(name, entry["value"])
        values[name], sources[name] = float(entry["value"]), f"{entry['provenance']} [{Path(origin).name}]"
    return replace(cal, **values, origin=origin, provenance=tuple(sources.items()))


def load(path: str | Path, gpu: str) -> Calibration:
    """A calibration file (see memcalc.model.jsonfile: at most 1 MiB is read) over memcalc's defaults."""
    return from_dict(read_json_object(path, "calibration"), str(path), gpu)


# GPUs of another's generation take its shipped calibration: the H800, the HBM2e H100, the H100 NVL and the H20 are
# GH100s (Hopper, sm90) and take h100-sxm.json, the A100 40GB (GA100, SXM) a100-80gb.json; the H100 PCIe and the
# A100 PCIe keep the defaults (lower power, lower clocks). Every other card has no shipped calibration of its
# generation (Ada, Blackwell, Volta, Turing, CDNA): defaults.
SAME_CHIP = {"h800": "h100-sxm", "h100-hbm2e": "h100-sxm", "h100-nvl": "h100-sxm", "h20": "h100-sxm",
             "a100-40gb": "a100-80gb"}


def calibration_for(gpu: str, path: str | None = None, overrides: str | None = None) -> Calibration:
    """The file given, else the one shipped for this GPU (or its chip's), else the defaults; then NAME=X overrides."""
    shipped = FOLDER / f"{SAME_CHIP.get(gpu, gpu)}.json"
    cal = load(path, gpu) if path else load(shipped, gpu) if shipped.exists() else defaults(gpu)
    return override(cal, overrides) if overrides else cal


def override(cal: Calibration, text: str) -> Calibration:
    """'matmul=0.7,bandwidth=0.85' on top of a calibration."""
    values, sources = {}, dict(cal.provenance)
    for item in text.split(","):
        name, sep, value = item.partition("=")
        name = name.strip().lower()
        if not sep or name not in PARAMETERS:
            known = ", ".join(PARAMETERS)
            raise InputError(f"--calibration takes NAME=X[,NAME=X] with NAME one of {known}; got {item!r}")
        try:
            values[name] = float(value)
        except ValueError:
            raise InputError(f"--calibration {name} must be a number, got {brief(value)}") from None
        check_value(name, values[name])
        sources[name] = "--calibration on the command line"
    return replace(cal, **values, provenance=tuple(sources.items()))
