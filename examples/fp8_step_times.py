"""Llama-3-8B's step on one H100 (seq 8192) on memcalc's roofline: bf16 and torchao's float8, eager and compiled,
and Transformer Engine's delayed scaling (eager: TE's own fused kernels).

    python examples/fp8_step_times.py
"""

from memcalc.model.gpus import gpu
from memcalc.model.presets import preset
from memcalc.model.tricks import parse_tricks
from memcalc.time.calibration import calibration_for
from memcalc.time.roofline import roofline

H100 = gpu("h100-sxm")
for tricks in ("bf16,flash", "bf16,flash,fp8", "bf16,flash,compile", "bf16,flash,fp8,compile",
               "bf16,flash,fp8:rowwise,compile", "bf16,flash,fp8:te"):  # fmt: skip
    t = roofline(preset("llama3-8b"), 8192, 1, 1, parse_tricks(tricks), H100, calibration_for(H100.key))
    print(f"{t.tricks.label:32} {t.step_seconds * 1e3:7.1f} ms  {t.kernels:6,} kernels  MFU {t.mfu:.1%}")
