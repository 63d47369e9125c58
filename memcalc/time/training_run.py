"""How long a whole training run takes, in days and GPU-hours, and what it costs."""

from __future__ import annotations

from memcalc.errors import InputError
from memcalc.model.tricks import Tricks
from memcalc.records import record

MAX_TOKENS = 1e16  # ten quadrillion: far beyond any corpus trained on


@record(slots=True)
class TrainingRun:
    """A whole training run at one trick set: its length, GPUs and throughput."""

    tricks: Tricks
    tokens: int  # tokens the whole run trains on
    gpus: int
    tokens_per_second: float  # the whole job
    price_per_gpu_hour: float | None  # dollars, if given
    scaling: str  # how the job's throughput was obtained

    @property
    def seconds(self) -> float:
        return self.tokens / self.tokens_per_second

    @property
    def days(self) -> float:
        return self.seconds / 86400

    @property
    def gpu_hours(self) -> float:
        return self.seconds * self.gpus / 3600

    @property
    def cost(self) -> float | None:
        return None if self.price_per_gpu_hour is None else self.gpu_hours * self.price_per_gpu_hour


def training_run(tricks: Tricks, tokens: int, gpus: int, tokens_per_second: float, price: float | None,
                 scaling: str) -> TrainingRun:  # fmt: skip
    if not 0 < tokens <= MAX_TOKENS:
        raise InputError(f"tokens must be in (0, {MAX_TOKENS:.0e}], got {tokens}")
    if price is not None and not price > 0:
        raise InputError(f"price per GPU-hour must be positive, got {price}")
    return TrainingRun(tricks, tokens, gpus, tokens_per_second, price, scaling)


def runs_for_layouts(ests, tokens: int, price: float | None) -> tuple[TrainingRun, ...]:
    """A layout's step time already holds its communication, bubble and offload."""
    scaling = "the layout's step time: compute, bubble and exposed communication"
    return tuple(training_run(e.tricks, tokens, e.gpus, e.time.tokens_per_second, price, scaling) for e in ests)
