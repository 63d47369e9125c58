"""Trick sets: a precision recipe, FlashAttention, and how much of a layer backward recomputes.

Names are the same everywhere (CLI, JSON, verify): fp32, fp16, bf16, fp8, fp8:rowwise, fp8:te, flash, ckpt,
ckpt:N, selective, sac.
  fp8        torchao's float8 training (convert_to_float8_training, as torchtitan's float8 converter applies it):
             every linear of the blocks cast to float8 on the fly, dynamic tensorwise scaling (e4m3, e5m2 for
             gradients), the matmuls on the FP8 tensor cores; fp8:rowwise its rowwise recipe (e4m3 throughout,
             power-of-two scales). The weights, gradients and saved activations stay in the 16-bit recipe.
  fp8:te     Transformer Engine's te.Linear for every linear of the blocks, under fp8_autocast with delayed
             scaling (DelayedScaling, Format.HYBRID: e4m3 forward, e5m2 gradients; the scale from an amax
             history), as Composer's amp_fp8 and llm-foundry's fc_type te run it (memcalc.exact.aten.te):
             each linear saves its input as an fp8 transpose and the weight's fp8 transpose for backward.
  compile    torch.compile of each block, as torchtitan compiles them: Inductor fuses the elementwise kernels
             between matmuls and attention into one each (memcalc.exact.replay.inductor); the step time counts the
             fused kernels, the memory is the eager step's (its partitioner is not replayed)
  ckpt       every block under torch.utils.checkpoint (non-reentrant): it keeps the block's input
  ckpt:N     every Nth block so (torchtitan's per-layer selective AC, selective_ac_option = N: a counter
             from 1 over the blocks, a block checkpointed when count % N == 0); the rest keep everything
  selective  Korthikanti et al.'s: the attention core recomputed
  sac        torchtitan's per-op selective AC (selective_ac_option = "op"): every block checkpointed with
             a policy that keeps the outputs of matmuls and attention, except every second matmul
"""

from __future__ import annotations

from memcalc.errors import InputError
from memcalc.model.jsonfile import brief
from memcalc.records import record

PRECISIONS = ("fp32", "fp16", "bf16")
RECOMPUTES = ("none", "selective", "full", "op")
# torchao.float8's Float8LinearRecipeName (none, tensorwise, rowwise), or Transformer Engine's delayed scaling (te)
FP8_RECIPES = ("", "tensorwise", "rowwise", "te")
TRICK_NAMES = ("fp32", "fp16", "bf16", "fp8", "fp8:rowwise", "fp8:te", "flash", "compile", "ckpt", "ckpt:N",
               "selective", "sac")  # fmt: skip
MAX_CKPT_EVERY = 1024  # ckpt:N beyond any model's depth checkpoints nothing; refused past this


@record(frozen=True)
class Tricks:
    """A trick set: the precision recipe, FlashAttention, and what backward recomputes."""

    precision: str = "bf16"  # fp32; or fp16/bf16 mixed precision (16-bit compute, fp32 master)
    flash: bool = False  # FlashAttention: the s x s scores are never stored
    recompute: str = "none"  # none; selective (attention core only); full (whole blocks); op (sac)
    ckpt_every: int = 1  # with full: every Nth block is checkpointed (ckpt:N), the others keep everything
    fp8: str = ""  # the blocks' linears in fp8: "" (none), torchao's tensorwise or rowwise, or te (Transformer Engine)
    compile: bool = False  # torch.compile of each block: the step's elementwise kernels fused (time only)

    def __post_init__(self) -> None:
        if self.precision not in PRECISIONS:
            raise InputError(f"unknown precision {self.precision!r}; known: {', '.join(PRECISIONS)}")
        if self.recompute not in RECOMPUTES:
            raise InputError(f"unknown recompute {self.recompute!r}; known: {', '.join(RECOMPUTES)}")
        if self.fp8 not in FP8_RECIPES:
            raise InputError(f"unknown fp8 recipe {self.fp8!r}; known: tensorwise, rowwise, te")
        if self.fp8 and self.precision != "bf16":
            raise InputError(f"{self.fp8_name} casts bf16 linears to float8; combine it with bf16, "
                             f"not {self.precision}")  # fmt: skip
        if self.fp8 == "te" and (self.compile or self.recompute == "op"):
            raise InputError("fp8:te runs Transformer Engine's own CUDA extensions, which torch.compile does not "
                             "trace and a per-op checkpoint policy does not see: combine it with ckpt or selective, "
                             "not compile or sac")  # fmt: skip
        n = self.ckpt_every
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_CKPT_EVERY:
            raise InputError(f"ckpt:N needs a whole N from 1 to {MAX_CKPT_EVERY}, got {n!r}")
        if n > 1 and self.recompute != "full":
            raise InputError(f"checkpointing every {n}th block is ckpt:{n}: recompute full, not {self.recompute}")

    @property
    def mixed(self) -> bool:
        """ckpt:N with N > 1: some blocks checkpointed, the others not, so the blocks are not all alike."""
        return self.ckpt_every > 1

    def checkpointed(self, block: int) -> bool:
        """Whether block `block` (from 0) runs under torch.utils.checkpoint as a whole (ckpt, ckpt:N, sac).
        torchtitan's _apply_layer_sac counts the blocks from 1 and checkpoints when count % N == 0."""
        if self.recompute == "op":
            return True
        return self.recompute == "full" and (block + 1) % self.ckpt_every == 0

    def n_checkpointed(self, n_layers: int) -> int:
        """How many of n_layers blocks are checkpointed as a whole."""
        if self.recompute == "op":
            return n_layers
        return n_layers // self.ckpt_every if self.recompute == "full" else 0

    @property
    def act_bytes(self) -> int:
        """Bytes of one activation element: 4 in fp32, 2 in the 16-bit recipes."""
        return 4 if self.precision == "fp32" else 2

    @property
    def fp8_name(self) -> str:
        """The fp8 recipe's trick name: fp8 (torchao tensorwise), fp8:rowwise, fp8:te; "" without fp8."""
        return "" if not self.fp8 else "fp8" if self.fp8 == "tensorwise" else f"fp8:{self.fp8}"

    @property
    def names(self) -> list[str]:
        names = [self.precision]
        if self.fp8:
            names.append(self.fp8_name)
        if self.flash:
            names.append("flash")
        if self.compile:
            names.append("compile")
        if self.recompute == "full":
            names.append("ckpt" if self.ckpt_every == 1 else f"ckpt:{self.ckpt_every}")
        elif self.recompute == "selective":
            names.append("selective")
        elif self.recompute == "op":
            names.append("sac")
        return names

    @property
    def label(self) -> str:
        return "+".join(self.names)


def parse_tricks(text: str) -> Tricks:
    """'bf16,flash,ckpt:2' -> Tricks. No precision named means bf16, the default recipe."""
    names = [n.strip().lower() for n in text.replace("+", ",").split(",") if n.strip()]
    if not names:
        raise InputError("no tricks given; choose from " + ", ".join(TRICK_NAMES))
    every = [ckpt_every(n) for n in names if n == "ckpt" or n.startswith("ckpt:")]
    fp8 = [{"fp8": "tensorwise", "fp8:tensorwise": "tensorwise"}.get(n, n[4:]) for n in names if n.startswith("fp8")]
    for name in names:
        if name == "fp8:tensorwise":
            continue
        if name not in TRICK_NAMES and not name.startswith("ckpt:"):
            raise InputError(f"unknown trick {name!r}; known: {', '.join(TRICK_NAMES)}")
    precisions = [n for n in names if n in PRECISIONS]
    if len(set(precisions)) > 1:
        raise InputError(f"choose one precision, not {' and '.join(sorted(set(precisions)))}")
    if len(set(every)) > 1:
        named = sorted({n for n in names if n == "ckpt" or n.startswith("ckpt:")})
        raise InputError(f"choose one checkpointing frequency, not {' and '.join(named)}")
    if every and "selective" in names:
        raise InputError("ckpt already recomputes the whole layer; drop selective or ckpt")
    modes = [m for m, named in (("ckpt", every), ("selective", "selective" in names), ("sac", "sac" in names)) if named]
    if len(modes) > 1:
        raise InputError(f"choose one way to recompute, not {' and '.join(modes)}: {RECOMPUTE_TEXT[modes[0]]}; "
                         f"{RECOMPUTE_TEXT[modes[1]]}")  # fmt: skip
    if len(set(fp8)) > 1:
        raise InputError("choose one fp8 recipe: fp8 (torchao tensorwise), fp8:rowwise or fp8:te (Transformer Engine)")
    recompute = "full" if every else "selective" if "selective" in names else "op" if "sac" in names else "none"
    return Tricks(precision=precisions[0] if precisions else "bf16", flash="flash" in names, recompute=recompute,
                  ckpt_every=every[0] if every else 1, fp8=fp8[0] if fp8 else "",
                  compile="compile" in names)  # fmt: skip


def check_measurable(tricks: Tricks) -> None:
    """What memcalc verify can measure: not fp8:te, whose te.Linear needs Transformer Engine's CUDA extensions
    (a build against the local CUDA toolkit, no CPU or meta kernels)."""
    if tricks.fp8 == "te":
        raise InputError(f"{tricks.label}: verify cannot measure fp8:te without Transformer Engine and a CUDA GPU "
                         "(its te.Linear runs no CPU or meta kernels); memcalc estimate replays it")  # fmt: skip


def layer_uniform(tricks: Tricks) -> bool:
    """Whether every block runs the same recompute, with a per-layer formula (not ckpt:N, not sac)."""
    return not (tricks.mixed or tricks.recompute == "op")


def layout_counts(tricks: Tricks, moe: bool) -> bool:
    """Whether a layout's stages can count this trick set block by block: every block alike with a formula
    (layer_uniform), or per-op SAC on dense blocks, counted op by op on the TP shard (memcalc.parallel.
    activations.sac_layer_activations). Not ckpt:N, whose blocks differ; not SAC over MoE blocks."""
    return layer_uniform(tricks) or (tricks.recompute == "op" and not tricks.mixed and not moe)


def check_layer_uniform(tricks: Tricks, what: str) -> None:
    """Refuse ckpt:N and sac where `what` models only ckpt and selective (the parallel layouts' per-layer
    formulas, the published MFU conventions): they are replayed op by op for one GPU."""
    if not layer_uniform(tricks):
        raise InputError(f"{tricks.label}: {what} know ckpt and selective, not {tricks.names[-1]}; ckpt:N and sac "
                         "are replayed for one GPU (memcalc estimate without a layout, memcalc verify)")  # fmt: skip


def trick_warnings(tricks: Tricks) -> list[str]:
    """What a trick set does that its user likely did not mean: every command that takes it computes it and
    says this on stderr (memcalc.cli.inputs.resolve_tricks). Selective recompute drops the attention core's
    activations, 5·a·s²·b of them the s×s scores and softmax (Korthikanti et al. 2022, sec. 5), and
    recomputes the core in backward; FlashAttention stores no s×s matrix in the first place (Dao et al. 2022,
    sec. 3.1), so beside it the recompute buys nothing and still costs its time (the roofline times it, HFU
    counts it)."""
    if tricks.recompute == "selective" and tricks.flash:
        return [f"{tricks.label}: selective recompute saves nothing beside flash (FlashAttention keeps no s×s "
                "scores) and still recomputes the attention core: drop selective, or name ckpt"]  # fmt: skip
    return []


RECOMPUTE_TEXT = {
    "ckpt": "ckpt recomputes whole blocks",
    "selective": "selective recomputes the attention core",
    "sac": "sac recomputes each block but the matmuls and attention it keeps",
}


def ckpt_every(name: str) -> int:
    """'ckpt' -> 1, 'ckpt:3' -> 3 (every third block); anything else after the colon is refused."""
    if name == "ckpt":
        return 1
    n = name.removeprefix("ckpt:")
    if not n.isdigit() or len(n) > len(str(MAX_CKPT_EVERY)) or not 1 <= int(n) <= MAX_CKPT_EVERY:
        raise InputError(f"{brief(name)}: ckpt:N checkpoints every Nth block; N must be a whole number from 1 to "
                         f"{MAX_CKPT_EVERY}")  # fmt: skip
    return int(n)


# What `estimate` shows without --tricks: the progression the field teaches.
PROGRESSION = (
    Tricks("fp32"),
    Tricks("bf16"),
    Tricks("bf16", flash=True),
    Tricks("bf16", flash=True, recompute="full"),
    Tricks("bf16", recompute="selective"),
)
