"""MFU and HFU from a measured throughput, under each FLOPs-per-token convention in use.

No two frameworks count the same FLOPs, so a "45% MFU" means little without its convention.
Each convention here is written as its source writes it; `memcalc mfu` prints them side by side.
"""

from __future__ import annotations

from collections.abc import Callable

from memcalc.errors import InputError
from memcalc.exact.kernels import step_flops
from memcalc.model.flops import attention_flops, model_per_token
from memcalc.model.gpus import check_precision
from memcalc.model.params import idle_params, param_counts
from memcalc.model.shape import Model, ModelShape, check_positions
from memcalc.model.tricks import Tricks, check_layer_uniform
from memcalc.records import record


def non_embedding(shape: ModelShape, n_params: int) -> int:
    """N less the token (and position) tables; an untied lm_head still counts: it is a matmul."""
    return n_params - param_counts(shape).embedding


def without_positions(shape: ModelShape, n_params: int) -> int:
    """nanoGPT's get_num_params(non_embedding=True): N less the position table only (wte is the tied lm_head)."""
    positions = shape.max_positions * shape.hidden if shape.positions == "learned" else 0
    return n_params - positions


def attention(shape: ModelShape, seq_len: int) -> int:
    return attention_flops(shape, seq_len)  # 12·L·H·Q·T, PaLM App. B


def korthikanti(shape: ModelShape, seq_len: int, recompute: str) -> tuple[float, float]:
    """Korthikanti et al. 2022 sec. 6.3 as published, per token: 72Lh²(1 + s/6h + v/12hL) model FLOPs;
    hardware 72Lh²(1 + s/3h + v/12hL) with selective recompute, 96Lh²(1 + s/6h + v/16hL) with full."""
    L, h, s, v = shape.n_layers, shape.hidden, seq_len, shape.vocab
    model = 72 * L * h * h * (1 + s / (6 * h) + v / (12 * h * L))
    if recompute == "selective":
        return model, 72 * L * h * h * (1 + s / (3 * h) + v / (12 * h * L))
    if recompute == "full":
        return model, 96 * L * h * h * (1 + s / (6 * h) + v / (16 * h * L))
    return model, model


# A convention returns (model FLOPs, hardware FLOPs) per token for a shape, N, seq and trick set; most
# conventions look at its recompute only (HFU with activation checkpointing), memcalc's at flash too.
Count = Callable[[ModelShape, int, int, Tricks], "tuple[float, float]"]


def six_n(shape: ModelShape, n: int, s: int, tricks: Tricks) -> tuple[float, float]:
    return 6 * n, (8 if tricks.recompute == "full" else 6) * n  # Kaplan et al. 2020, sec. 2.1; one more forward: 8N


def palm(shape: ModelShape, n: int, s: int, tricks: Tricks) -> tuple[float, float]:
    model = 6 * without_positions(shape, n) + attention(shape, s)  # nanoGPT estimate_mfu, PaLM App. B
    return model, model * (4 / 3 if tricks.recompute == "full" else 1)


def causal(shape: ModelShape, n: int, s: int, tricks: Tricks) -> tuple[float, float]:
    model = 6 * n + attention(shape, s) / 2  # Megatron-LM: a causal mask skips half the s² work
    return model, model * (4 / 3 if tricks.recompute == "full" else 1)


def torchtitan(shape: ModelShape, n: int, s: int, tricks: Tricks) -> tuple[float, float]:
    model = 6 * non_embedding(shape, n) + attention(shape, s)  # torchtitan get_num_flop_per_token
    return model, model  # torchtitan excludes recompute from its MFU


def foundry(shape: ModelShape, n: int, s: int, tricks: Tricks) -> tuple[float, float]:
    model = 3 * (2 * n + attention(shape, s) / 3)  # llm-foundry: 3·(2N·T + attention forward) per sequence
    return model, model * (4 / 3 if tricks.recompute == "full" else 1)  # its HFU: 4/3 with activation checkpointing


def published(shape: ModelShape, n: int, s: int, tricks: Tricks) -> tuple[float, float]:
    return korthikanti(shape, s, tricks.recompute)


def ours(shape: ModelShape, n: int, s: int, tricks: Tricks) -> tuple[float, float]:
    f = step_flops(shape, s, tricks)
    return f.model_per_token, f.hardware_per_token  # the shape's own layers; hardware: the kernels, counted


@record(frozen=True)
class Convention:
    """One published way of counting a step's FLOPs for MFU, and its source."""

    key: str
    name: str
    formula: str
    source: str
    count: Count


CONVENTIONS = (
    Convention("6n", "6N", "6·N", "Kaplan et al. 2020, sec. 2.1", six_n),
    Convention("palm", "6N + attention (PaLM, nanoGPT)", "6·N_no_pos + 12·L·H·Q·T",
               "Chowdhery et al. 2022, App. B; nanoGPT model.py estimate_mfu", palm),  # fmt: skip
    Convention("causal", "6N + causal attention (Megatron)", "6·N + 6·L·H·Q·T", "Megatron-LM: causal halving", causal),
    Convention("torchtitan", "6N_non-embedding + attention (torchtitan)", "6·(N − embeddings) + 12·L·H·Q·T",
               "torchtitan get_num_flop_per_token", torchtitan),  # fmt: skip
    Convention("foundry", "3·(2N + attention) (llm-foundry)", "3·(2·N + 4·L·H·Q·T)", "llm-foundry speed_monitor",
               foundry),  # fmt: skip
    Convention("korthikanti", "Korthikanti et al. 2022 (as published)", "72·L·h²·(1 + s/6h + v/12hL)",
               "Korthikanti et al. 2022, sec. 6.3", published),  # fmt: skip
    Convention("memcalc", "memcalc (shape's own layers)", "6·L·P_layer + 12·L·H·Q·s + 6·h·v",
               "memcalc.exact.kernels.step_flops: HFU from the kernels as FlopCounterMode counts them", ours),  # fmt: skip
)


@record(slots=True)
class Utilization:
    """One convention's FLOPs per token, and what the measured throughput makes of them."""

    convention: str
    name: str
    formula: str
    source: str
    model_flops_per_token: float
    hardware_flops_per_token: float
    tokens_per_second: float  # per GPU
    peak_flops: float

    @property
    def achieved_tflops(self) -> float:
        return self.model_flops_per_token * self.tokens_per_second / 1e12

    @property
    def mfu(self) -> float:
        return self.model_flops_per_token * self.tokens_per_second / self.peak_flops

    @property
    def hfu(self) -> float:
        return self.hardware_flops_per_token * self.tokens_per_second / self.peak_flops


@record(slots=True)
class MfuReport:
    """A measured throughput's MFU and HFU under every convention."""

    model: Model
    gpu: str
    precision: str
    seq_len: int
    recompute: str
    tokens_per_second: float  # per GPU
    conventions: tuple[Utilization, ...]


def tokens_per_gpu_second(tokens_per_sec: float | None, step_seconds: float | None, global_batch: int | None,
                          seq_len: int, gpus: int | None = None) -> float:  # fmt: skip
    """Per-GPU throughput from --tokens-per-sec, or from a step time and the global batch in sequences
    over `gpus` GPUs (default 1)."""
    if tokens_per_sec is not None:
        if step_seconds is not None or global_batch is not None:
            raise InputError("give --tokens-per-sec, or --step-time with --global-batch, not both")
        if gpus is not None:
            raise InputError("--tokens-per-sec is per GPU already: drop --gpus (it divides --step-time's global batch)")
        return tokens_per_sec
    if step_seconds is None or global_batch is None:
        raise InputError("give --tokens-per-sec (per GPU), or --step-time and --global-batch")
    return global_batch * seq_len / step_seconds / (gpus or 1)


def check_possible(model: Model, gpu, tricks: Tricks, seq_len: int, tokens_per_second: float) -> None:
    """A measured throughput no GPU can reach is a typo, not a result: even the least work a step must do,
    the model FLOPs with causal attention halved, cannot run faster than the dense peak."""
    peak = gpu.peak_flops(tricks.precision)
    least = model_per_token(model.shape, seq_len) - attention(model.shape, seq_len) // 2  # Megatron's causal count
    if least * tokens_per_second > peak:
        raise InputError(f"{tokens_per_second:,.4g} tokens/s per GPU is physically impossible: even the causal model "
                         f"FLOPs ({least:,} per token) would need {least * tokens_per_second / 1e12:,.0f} TFLOP/s, "
                         f"above the {gpu.key}'s dense {tricks.precision} peak of {peak / 1e12:g}")  # fmt: skip


def mfu_report(model: Model, gpu, tricks: Tricks, seq_len: int, tokens_per_second: float) -> MfuReport:
    check_positions(model.shape, seq_len)
    check_layer_uniform(tricks, "the published MFU conventions")
    check_precision(gpu, tricks.precision, tricks.fp8_name)  # no bf16 peak to hold a V100's throughput against
    check_possible(model, gpu, tricks, seq_len, tokens_per_second)
    peak = gpu.peak_flops(tricks.precision)
    rows = []
    n = model.n_params - idle_params(model.shape)  # a mixture of experts: the parameters a token goes through
    for c in CONVENTIONS:
        model_flops, hardware_flops = c.count(model.shape, n, seq_len, tricks)
        rows.append(Utilization(c.key, c.name, c.formula, c.source, model_flops, hardware_flops, tokens_per_second, peak))
    return MfuReport(model, gpu.key, tricks.precision, seq_len, tricks.recompute, tokens_per_second, tuple(rows))
