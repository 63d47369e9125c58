"""Trick sets: a precision recipe, FlashAttention, and how much of a layer backward recomputes.

Names are the same everywhere (CLI, JSON, verify): fp32, fp16, bf16, flash, ckpt, selective.
"""

from __future__ import annotations

from dataclasses import dataclass

from memcalc.errors import InputError

PRECISIONS = ("fp32", "fp16", "bf16")
RECOMPUTES = ("none", "selective", "full")
TRICK_NAMES = ("fp32", "fp16", "bf16", "flash", "ckpt", "selective")


@dataclass(frozen=True)
class Tricks:
    precision: str = "bf16"  # fp32; or fp16/bf16 mixed precision (16-bit compute, fp32 master)
    flash: bool = False  # FlashAttention: the s x s scores are never stored
    recompute: str = "none"  # none; selective (attention core only); full (whole layer)

    def __post_init__(self) -> None:
        if self.precision not in PRECISIONS:
            raise InputError(f"unknown precision {self.precision!r}; known: {', '.join(PRECISIONS)}")
        if self.recompute not in RECOMPUTES:
            raise InputError(f"unknown recompute {self.recompute!r}; known: {', '.join(RECOMPUTES)}")
        if self.flash and self.precision == "fp32":
            raise InputError("flash needs 16-bit activations: combine it with bf16 or fp16")

    @property
    def act_bytes(self) -> int:
        """Bytes of one activation element: 4 in fp32, 2 in the 16-bit recipes."""
        return 4 if self.precision == "fp32" else 2

    @property
    def names(self) -> list[str]:
        names = [self.precision]
        if self.flash:
            names.append("flash")
        if self.recompute == "full":
            names.append("ckpt")
        elif self.recompute == "selective":
            names.append("selective")
        return names

    @property
    def label(self) -> str:
        return "+".join(self.names)


def parse_tricks(text: str) -> Tricks:
    """'bf16,flash,ckpt' -> Tricks. No precision named means bf16, the default recipe."""
    names = [n.strip().lower() for n in text.replace("+", ",").split(",") if n.strip()]
    if not names:
        raise InputError("no tricks given; choose from " + ", ".join(TRICK_NAMES))
    for name in names:
        if name not in TRICK_NAMES:
            raise InputError(f"unknown trick {name!r}; known: {', '.join(TRICK_NAMES)}")
    precisions = [n for n in names if n in PRECISIONS]
    if len(set(precisions)) > 1:
        raise InputError(f"choose one precision, not {' and '.join(sorted(set(precisions)))}")
    if "ckpt" in names and "selective" in names:
        raise InputError("ckpt already recomputes the whole layer; drop selective or ckpt")
    recompute = "full" if "ckpt" in names else "selective" if "selective" in names else "none"
    return Tricks(precision=precisions[0] if precisions else "bf16", flash="flash" in names, recompute=recompute)


# What `estimate` shows without --tricks: the progression the field teaches.
PROGRESSION = (
    Tricks("fp32"),
    Tricks("bf16"),
    Tricks("bf16", flash=True),
    Tricks("bf16", flash=True, recompute="full"),
    Tricks("bf16", recompute="selective"),
)
