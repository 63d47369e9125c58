"""What `memcalc verify` reports: rows of quantity | textbook | exact | measured | error | pass.

Torch-free: verify/ fills these in; the CLI renders them (table or JSON via dataclasses.asdict).
"""

from __future__ import annotations

from dataclasses import asdict

from memcalc.records import record

DEFAULT_TOL = {"cuda": 0.03, "meta": 0.001, "cpu": 0.001}  # relative; the 3% on CUDA, 0.1% on meta


@record(frozen=True)
class Row:
    """One compared quantity. tolerance None: shown, not judged."""

    quantity: str
    unit: str  # bytes | flops | seconds | tokens/s | TFLOP/s | fraction
    textbook: float | None  # memcalc estimate's number (Korthikanti et al. 2022 and friends)
    exact: float | None  # memcalc.exact's prediction
    measured: float | None
    tolerance: float | None = None
    note: str = ""

    @property
    def error(self) -> float | None:
        """(measured - exact) / exact."""
        if self.exact is None or self.measured is None:
            return None
        if self.exact == 0:
            return 0.0 if self.measured == 0 else float("inf")
        return (self.measured - self.exact) / self.exact

    @property
    def passed(self) -> bool | None:
        if self.tolerance is None or self.error is None:
            return None
        return abs(self.error) <= self.tolerance


@record(frozen=True)
class DevicePhases:
    """torch.cuda's allocator statistics for one step, relative to before the model was built."""

    after_build_bytes: int  # memory_allocated: weights and buffers
    after_first_step_bytes: int  # memory_allocated after the first optimizer step: the model state (+ inputs)
    retained_bytes: int  # memory_allocated after forward less before it
    forward_peak_bytes: int  # max_memory_allocated over forward (reset_peak_memory_stats before)
    backward_peak_bytes: int
    optimizer_peak_bytes: int
    reserved_peak_bytes: int  # max_memory_reserved over the step: what the caching allocator held

    @property
    def step_peak_bytes(self) -> int:
        return max(self.forward_peak_bytes, self.backward_peak_bytes, self.optimizer_peak_bytes)


@record(frozen=True)
class Timing:
    """Step time by CUDA events, median over the timed steps after warm-up."""

    steps: int
    step_seconds: float  # median
    step_seconds_all: tuple[float, ...]
    tokens_per_second: float
    model_tflops: float  # achieved, memcalc.exact's model FLOPs (6·W·tokens + 12·L·a·d·s·tokens) / time
    hardware_tflops: float  # achieved, FlopCounterMode's count (recompute included) / time
    peak_tflops: float | None  # the GPU table's dense peak for the precision; None for an unknown GPU
    mfu: float | None  # model_tflops / peak_tflops
    hfu: float | None
    predicted_seconds: float | None = None  # memcalc.time.roofline's step time for the model as built; None off the table
    calibration: str = ""  # the efficiencies it ran at
    predicted_ops: tuple = ()  # memcalc.time.roofline.OpTime per op: FLOPs, bytes, compute/memory/launch seconds

    @property
    def predicted_error(self) -> float | None:
        """(measured - predicted) / predicted."""
        if self.predicted_seconds is None:
            return None
        return (self.step_seconds - self.predicted_seconds) / self.predicted_seconds


@record(frozen=True)
class VerifyResult:
    """One model, setup and trick set, measured and compared."""

    model: str  # shape name
    origin: str  # how the shape was chosen
    family: str  # gpt | llama
    tricks: str  # label: bf16+flash+ckpt
    device: str  # cuda | meta (cpu: tests only)
    device_reason: str  # why that device
    torch_version: str
    attention: str  # the kernel that ran: eager, flash (SDPA), flash-attn, aten flash op (meta)
    gpu_name: str | None
    seq_len: int
    micro_batch: int
    grad_accum: int
    layers_requested: int
    layers_built: int
    layers_note: str  # "" at full depth; why fewer otherwise
    tolerance: float
    rows: tuple[Row, ...]
    phases: DevicePhases | None  # CUDA (and the CPU stand-in) only
    timing: Timing | None
    error: str | None  # why the run did not finish (out of memory, no flash kernel, ...)
    seconds: float  # wall time of this run
    notes: tuple[str, ...] = ()
    timeline: object = None  # --timeline: the measured step over the predicted (memcalc.verification.timeline.Overlay)
    per_sample: int = 1  # sequences per sample: DPO's pair, 2 (memcalc.memory.setup Setup.per_sample)

    @property
    def passed(self) -> bool:
        return self.error is None and all(r.passed is not False for r in self.rows)

    @property
    def failed(self) -> tuple[Row, ...]:
        return tuple(r for r in self.rows if r.passed is False)


@record(frozen=True)
class CustomResult:
    """verify --step: the user's own model and step, measured, beside the closest stack's prediction.
    Nothing is judged: the user's code is not memcalc's, the rows say by how much the two differ."""

    step: str  # MODULE:FUNCTION
    model: str  # how the prediction's shape was chosen
    stack: str  # the stack predicted for, with its changes
    tricks: str
    device: str
    torch_version: str
    seq_len: int
    micro_batch: int
    rows: tuple[Row, ...]  # exact: memcalc's prediction, measured: the user's step
    peaks_at: tuple[str, ...]  # where the user's forward, backward and optimizer peaks happened
    saved_by_op: tuple[tuple[str, int], ...]  # what the user's forward saved, by creating op, the most first
    prediction_note: str  # why there is no prediction: no model given, or a stack the exact model does not replay


def to_dict(result: VerifyResult | CustomResult) -> dict:
    """dataclasses.asdict, plus what the properties compute: each row's error and pass, the result's."""
    out = asdict(result)
    for row, data in zip(result.rows, out["rows"]):
        data["error"], data["passed"] = row.error, row.passed
    if isinstance(result, CustomResult):
        return out  # the user's step is measured, not judged
    if result.timing is not None:
        out["timing"]["predicted_error"] = result.timing.predicted_error
    if result.timeline is not None:  # where the measurement leaves the prediction
        o = result.timeline
        out["timeline"] |= {"coinciding": o.coinciding, "first_difference": o.first_difference}
        del out["timeline"]["predicted"]["storages"]  # what only --snapshot and --trace read (Timeline.storages)
    out["passed"] = result.passed
    return out
