"""A computed quantity with the formula it came from, so --explain can show the working."""

from __future__ import annotations

from memcalc.records import record


@record(slots=True)
class Term:
    """One number, the formula it came from and its source."""

    name: str
    value: int  # bytes or FLOPs, as the caller says
    formula: str  # a template: "2·{s}·{b}·{h}"; {x} names a symbol of the config
    source: str  # paper and equation, or the PyTorch op whose saved tensors it counts

    def symbolic(self) -> str:
        """The formula in symbols: 2·s·b·h."""
        return self.formula.format_map(_Symbols())

    def substituted(self, symbols: dict[str, int]) -> str:
        """The formula with this config's numbers: 2·8192·1·4096."""
        return self.formula.format_map({k: f"{v:,}" if isinstance(v, int) else v for k, v in symbols.items()})


class _Symbols(dict):
    def __missing__(self, key: str) -> str:
        return key
