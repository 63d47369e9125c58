"""What the distributed check reports: a row per quantity and rank (predicted | measured | error | pass,
every byte between them named), a rank's rows (RankCheck), and the check of one model and layout
(DistResult, its table as the CLI prints it). verify/distributed.py fills them in.
"""

from __future__ import annotations

from memcalc.model.layout import Layout
from memcalc.model.params import n_params
from memcalc.model.shape import ModelShape
from memcalc.model.tricks import Tricks
from memcalc.records import record
from memcalc.terms import Term

TOLERANCE = 0.001  # a row passes within 0.1% when every byte of the difference is named


@record(slots=True)
class RankRow:
    """One quantity on one rank: predicted | measured | error | pass."""

    quantity: str
    predicted_bytes: int
    measured_bytes: int
    differences: tuple[Term, ...]  # every byte between prediction and measurement, named
    checked: bool  # False: a reference row (the textbook), shown, not judged
    formula: str

    @property
    def error_bytes(self) -> int:
        return self.measured_bytes - self.predicted_bytes

    @property
    def error(self) -> float:
        """Relative error of memcalc's number against the measurement."""
        return self.error_bytes / self.measured_bytes if self.measured_bytes else float(self.error_bytes != 0)

    @property
    def unexplained_bytes(self) -> int:
        return self.error_bytes - sum(d.value for d in self.differences)

    @property
    def exact(self) -> bool:
        """Prediction and named differences add up to the measurement, to the byte."""
        return self.unexplained_bytes == 0

    @property
    def passed(self) -> bool | None:
        """The prediction with its named differences within 0.1% of the measurement (to the byte so
        far, everywhere); None: a reference row, not judged."""
        if not self.checked:
            return None
        return abs(self.unexplained_bytes) <= TOLERANCE * self.measured_bytes


@record(slots=True)
class RankCheck:
    """One rank's rows: its prediction against its measurement."""

    rank: int
    dp_rank: int
    tp_rank: int
    rows: tuple[RankRow, ...]

    @property
    def passed(self) -> bool:
        return all(r.passed is not False for r in self.rows)


@record(slots=True)
class DistResult:
    """The distributed check of one model, setup and layout: one RankCheck per measured rank."""

    model: str
    n_params: int
    seq_len: int
    micro_batch: int
    tricks: Tricks
    layout: Layout
    device: str  # meta (fake process group) | cpu-gloo | cuda
    backend: str  # fake | gloo | nccl
    world: int
    ranks: tuple[RankCheck, ...]
    torch_version: str
    seconds: float
    notes: tuple[str, ...]

    @property
    def passed(self) -> bool:
        return all(r.passed for r in self.ranks)

    def table(self) -> list[list[object]]:
        """rank | quantity | predicted | measured | error | pass | differences: the rows the CLI prints."""
        out = []
        for rc in self.ranks:
            for r in rc.rows:
                verdict = {True: "yes", False: "NO", None: "ref"}[r.passed]
                named = "; ".join(f"{d.name}: {d.value:+,} B" for d in r.differences)
                out.append([rc.rank, r.quantity, r.predicted_bytes, r.measured_bytes, r.error_bytes,
                            f"{100 * r.error:+.4f}%", verdict, named])  # fmt: skip
        return out


TABLE_HEADERS = ["rank", "quantity", "predicted B", "measured B", "error B", "error", "pass", "named differences"]


def model_label(shape: ModelShape) -> str:
    return f"{shape.name} ({n_params(shape):,} parameters, {shape.n_layers} layers)"
