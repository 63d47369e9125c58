"""Pipeline stages as vLLM splits the layers (vllm/distributed/utils.py@5a6541db9bfa77756459722f69e8c89a0b47a14d
get_pp_indices): layers // pp each, and a remainder of r layers one each to the r stages before the last;
the first stage holds the embedding, the last the final norm and the output head (a tied head's copy)."""

from __future__ import annotations

from memcalc.records import record


@record(frozen=True)
class Stage:
    """Pipeline stage `index` of `pp`: layers [start, end)."""

    index: int
    pp: int
    start: int
    end: int

    @property
    def first(self) -> bool:
        return self.index == 0

    @property
    def last(self) -> bool:
        return self.index == self.pp - 1

    def layers(self) -> range:
        """The stage's layer indices (a method: JSON carries start and end)."""
        return range(self.start, self.end)


def pipeline_stages(n_layers: int, pp: int) -> tuple[Stage, ...]:
    """Every stage's layers, as get_pp_indices partitions them (VLLM_PP_LAYER_PARTITION unset)."""
    partitions = [n_layers // pp] * pp
    for i in range(2, n_layers % pp + 2):
        partitions[-i] += 1
    starts = [sum(partitions[:i]) for i in range(pp)]
    return tuple(Stage(i, pp, starts[i], starts[i] + partitions[i]) for i in range(pp))
