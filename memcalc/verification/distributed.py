"""Per-rank memory under FSDP2 and DTensor tensor parallelism: memcalc's prediction, the named
differences PyTorch's own implementation adds, and the measured bytes side by side.

What one rank of a (dp × tp) job holds, as memcalc.parallel predicts it and as torch does it:
  weights, grads    ZeRO-3 over dp (Rajbhandari et al. 2019, sec. 5) of the TP shard (Shoeybi et al.
                    2019): ⌈w·P/G⌉. FSDP2's fully_shard shards each tensor's dim 0 with torch.chunk
                    and pads it to a multiple of G, so a rank holds Σ w·⌈d0/G⌉·rest. Without FSDP2,
                    DTensor hands an untied token table's gradient back whole (embedding_grad).
  optimizer state   fp32 master, m, v of the local shard, made by .float() / zeros_like of the
                    unpadded view: Σ 4·chunk(d0, G, rank)·rest each.
  saved by a block  the one-GPU layer of the TP rank's shape (a/t heads, k/t KV heads, f/t MLP),
                    counted op by op by memcalc.exact; with sequence parallelism the norms, dropouts
                    and (full recompute) the checkpointed input hold s/t tokens.
The parameter tensors and what a rank holds of them: memcalc.verification.dist_tensors; the rows and
results reported: memcalc.verification.dist_results.
This module is torch-free: verify/distributed.py measures, this predicts and compares.
"""

from __future__ import annotations

from dataclasses import replace

from memcalc.errors import InputError
from memcalc.memory.estimate import Setup
from memcalc.model.layout import Layout
from memcalc.model.params import n_params
from memcalc.model.shape import ModelShape, check_positions
from memcalc.model.tricks import Tricks, check_layer_uniform
from memcalc.parallel.activations import layer_activations
from memcalc.parallel.checks import check_layout
from memcalc.parallel.params import sharded_state, stage_shape_params
from memcalc.parallel.tp_layer import block_terms
from memcalc.records import record
from memcalc.terms import Term

from .dist_results import TABLE_HEADERS, DistResult, RankCheck, RankRow
from .dist_tensors import LocalCounts, local_counts, param_tensors, rank_coords, tp_dims

# DistResult and TABLE_HEADERS live in dist_results; memcalc.cli and memcalc.report import them from here.
__all__ = [
    "BACKENDS", "DEVICES", "DTENSOR", "FSDP2", "MATRIX", "MAX_GLOO_RANKS", "REPLAY", "Prediction", "check_dist",
    "check_fsdp2", "compare", "default_ranks", "dist_matrix", "padded_vocab", "predictions", "state_differences",
    "DistResult", "TABLE_HEADERS",
]  # fmt: skip

DEVICES = ("meta", "cpu-gloo", "cuda")  # meta: fake process group, fake tensors, one process per rank
BACKENDS = {"meta": "fake", "cpu-gloo": "gloo", "cuda": "nccl"}
MAX_GLOO_RANKS = 8  # real CPU processes on one machine
FSDP2 = "torch.distributed.fsdp.fully_shard (FSDP2)"
DTENSOR = "torch.distributed.tensor.parallel (DTensor)"


# ---- what can be verified ---------------------------------------------------------------------


def check_dist(shape: ModelShape, setup: Setup, tricks: Tricks, layout: Layout, device: str) -> None:
    """What the distributed check runs: FSDP2 (ZeRO-3) over dp, DTensor TP (+SP) over tp; one line each."""
    if device not in DEVICES:
        raise InputError(f"unknown verify device {device!r}; known: {', '.join(DEVICES)}")
    if tricks.mixed:
        check_layer_uniform(tricks, "distributed verify's checks")
    if layout.pp > 1 or layout.cp > 1:
        raise InputError("distributed verify covers data (FSDP2) and tensor parallelism: pp and cp must be 1")
    if layout.zero not in (0, 3):
        raise InputError(f"distributed verify runs FSDP2 (ZeRO-3), not ZeRO-{layout.zero}: use zero 3 with dp > 1")
    if layout.dp > 1 and layout.zero == 0:
        raise InputError("dp > 1 without sharding (DDP) is not verified: use zero 3 (FSDP2 fully_shard)")
    if layout.hybrid or layout.offload_optimizer or layout.offload_params:
        raise InputError("distributed verify covers full sharding on the GPU: no hybrid shard, no offload")
    if device == "cpu-gloo" and layout.world > MAX_GLOO_RANKS:
        raise InputError(f"cpu-gloo starts one process per rank: at most {MAX_GLOO_RANKS}, got {layout.world}")
    if device == "cpu-gloo" and tricks.flash:
        raise InputError("the CUDA flash-attention op verify runs has no CPU kernel: cpu-gloo runs without flash")
    if tricks.precision == "fp16":
        raise InputError("fp16: verify/recipes.py's loss scaler is not written for sharded (DTensor) gradients; "
                         "use bf16 or fp32")  # fmt: skip
    if setup.optimizer != "adamw":
        raise InputError(f"distributed verify runs AdamW (verify/recipes.py), not {setup.optimizer}")
    if setup.stack.engine == "fsdp2":
        check_fsdp2(shape, layout, device)
    elif setup.stack.impl != "reference" or (tricks.precision != "fp32" and setup.stack.recipe != "master"):
        raise InputError("distributed verify trains with verify/recipes.py's reference recipe (--stack reference: "
                         "--optimizer-impl reference, --recipe master) or as torchtitan does (--stack fsdp2)")  # fmt: skip
    if shape.n_layers < 2:
        raise InputError("distributed verify measures the second block: the model needs at least 2 layers")
    if setup.grad_accum != 1:
        raise InputError("distributed verify runs one micro-batch per step: grad-accum must be 1")
    check_positions(shape, setup.seq_len)
    check_layout(layout, shape, setup.seq_len, tricks, 1, "fsdp2" if setup.stack.engine == "fsdp2" else "none")


def check_fsdp2(shape: ModelShape, layout: Layout, device: str) -> None:
    """--stack fsdp2: torchtitan's FSDP2 over dp > 1 ranks (one rank is not sharded: torchtitan applies no
    fully_shard), counted on the fake process group; reshard 'always' needs lm_head's own forward, which
    verify/builder.py's tied table lacks."""
    if device != "meta":
        raise InputError("--stack fsdp2 counts every phase on fake tensors: --dist-device meta (cpu-gloo and cuda "
                         "run the reference recipe)")  # fmt: skip
    if layout.dp == 1:
        raise InputError("--stack fsdp2 shards over data-parallel ranks: give --fsdp N with N > 1")
    if layout.reshard_after_forward is True and shape.tied_embeddings:
        raise InputError("--reshard with a tied table: verify's model reads the table for the logits after the "
                         "[table, norm] unit's forward, when 'always' has resharded it; drop --reshard")  # fmt: skip


# verify --matrix's trick sets (verify/run.py MATRIX), less those this check refuses (fp16; flash on cpu-gloo)
MATRIX = ("fp32", "bf16", "fp16", "bf16,flash", "bf16,flash,ckpt", "bf16,selective", "bf16,flash,selective", "bf16,ckpt")


def dist_matrix(shape: ModelShape, setup: Setup, layout: Layout, device: str) -> tuple[Tricks, ...]:
    """The trick sets --matrix runs with --fsdp/--tp: every one of MATRIX check_dist takes; none: one line."""
    from memcalc.model.tricks import parse_tricks

    out = []
    for text in MATRIX:
        try:
            check_dist(shape, setup, parse_tricks(text), layout, device)
        except InputError:
            continue
        out.append(parse_tricks(text))
    if not out:
        check_dist(shape, setup, parse_tricks("bf16"), layout, device)  # says why
    return tuple(out)


def padded_vocab(shape: ModelShape, tp: int) -> ModelShape:
    """The vocabulary padded to a multiple of tp, as Megatron-LM pads it (to 128·tp): every TP rank
    holds ⌈V/t⌉ rows, memcalc's charge. DTensor shards an uneven vocabulary as torch.chunk does, and
    its view of the unevenly sharded logits fails on the last rank."""
    vocab = -(-shape.vocab // tp) * tp
    if vocab == shape.vocab:
        return shape
    return replace(shape, vocab=vocab, name=f"{shape.name} (vocab padded to {vocab:,})")


# ---- predictions --------------------------------------------------------------------------------


@record(slots=True)
class Prediction:
    """memcalc's number for one quantity and the differences PyTorch's implementation adds, named."""

    quantity: str
    predicted_bytes: int
    differences: tuple[Term, ...]
    checked: bool = True  # False: a reference row, shown beside the check, not judged
    formula: str = ""  # where the predicted number comes from

    @property
    def expected_bytes(self) -> int:
        return self.predicted_bytes + sum(d.value for d in self.differences)


def state_differences(part_bytes: int, elem_bytes: int, n_parts: int, counts: LocalCounts, g: int,
                      padded: bool) -> tuple[Term, ...]:  # fmt: skip
    """memcalc's ⌈w·P/G⌉ per part to what FSDP2 allocates: per-tensor chunks, then their padding."""
    w, k = elem_bytes, n_parts
    per_tensor = k * w * counts.shard_elements
    steps = [Term(f"FSDP2 shards each tensor's dim 0 (torch.chunk over {g}), not the flat state",
                  per_tensor - part_bytes, "Σ w·chunk(d0, G, rank)·rest − ⌈w·P/G⌉", FSDP2)]  # fmt: skip
    if padded:
        steps.append(Term(f"FSDP2 pads each tensor's dim 0 to a multiple of {g} (equal all-gather shards)",
                          k * w * counts.padded_elements - per_tensor, "Σ w·(⌈d0/G⌉ − chunk(d0, G, rank))·rest",
                          FSDP2))  # fmt: skip
    return tuple(t for t in steps if t.value)


def state_predictions(shape: ModelShape, tricks: Tricks, layout: Layout, rank: int,
                      engine: str = "none") -> list[Prediction]:  # fmt: skip
    """Weights, grads and optimizer state of one rank: memcalc.parallel's sharded state, then FSDP2's."""
    if engine == "fsdp2":
        return fsdp2_state_predictions(shape, tricks, layout, rank)
    params = stage_shape_params(shape, layout.tp, 1, 0)  # Megatron-style TP shard, pp = 1
    g = layout.shard_group
    state = sharded_state(params, tricks.precision, "adamw", g, layout.zero, False, False)
    parts = {p.name: p for p in state.parts}
    counts = local_counts(shape, layout, rank)
    w = 4 if tricks.precision == "fp32" else 2
    out = []
    for name, padded in (("weights", True), ("grads", True)):
        part = parts[name]
        diffs = state_differences(part.bytes, w, 1, counts, g, padded)
        if name == "grads":
            diffs += embedding_grad(shape, layout, w)
        out.append(Prediction(name, part.bytes, diffs, formula=part.formula.replace("{N}", "P").replace("{G}", "G")))
    fp32_parts = [p for p in state.parts if p.name in ("master", "adam_m", "adam_v")]
    opt = sum(p.bytes for p in fp32_parts) + sum(p.bytes for p in state.parts if p.name == "loss_scale")
    diffs = state_differences(sum(p.bytes for p in fp32_parts), 4, len(fp32_parts), counts, g, False)
    names = " + ".join(p.name for p in state.parts if p.name in ("master", "adam_m", "adam_v", "loss_scale"))
    out.append(Prediction("optimizer state", opt, diffs, formula=names))
    return out


def fsdp2_state_predictions(shape: ModelShape, tricks: Tricks, layout: Layout, rank: int) -> list[Prediction]:
    """The fsdp2 stack's state (memcalc.parallel.engines: fp32 parameters, gradients, m and v, sharded), then
    FSDP2's per-tensor shards and torch.optim.AdamW(fused=True)'s step counters."""
    params = stage_shape_params(shape, layout.tp, 1, 0)
    g = layout.shard_group
    state = sharded_state(params, tricks.precision, "adamw", g, layout.zero, False, False, "autocast")
    parts = {p.name: p for p in state.parts}
    counts = local_counts(shape, layout, rank)
    out = []
    for name in ("weights", "grads"):  # the shards and the reduce-scatter outputs: padded rows, fp32
        part = parts[name]
        diffs = state_differences(part.bytes, 4, 1, counts, g, True)
        out.append(Prediction(name, part.bytes, diffs, formula=part.formula.replace("{N}", "P").replace("{G}", "G")))
    moments = parts["adam_m"].bytes + parts["adam_v"].bytes
    diffs = state_differences(moments, 4, 2, counts, g, False) + (step_counters(shape),)
    out.append(Prediction("optimizer state", moments, diffs, formula="adam_m + adam_v"))
    return out


def step_counters(shape: ModelShape) -> Term:
    """torch.optim.AdamW(fused=True): each parameter's state['step'] is a float32 scalar on its device
    (torch/optim/adam.py _init_group, _get_scalar_dtype(is_fused=True)), 4 bytes per parameter tensor."""
    n = len(param_tensors(shape))
    return Term(f"fused AdamW's step counter, a float32 tensor per parameter ({n} tensors)", 4 * n, "4·n_tensors",
                "torch/optim/adam.py _init_group")  # fmt: skip


def embedding_grad(shape: ModelShape, layout: Layout, w: int) -> tuple[Term, ...]:
    """DTensor's embedding backward has no vocab-sharded strategy (torch/distributed/tensor/_ops/
    _embedding_ops.py: column-wise, batch-wise or replicated only): the token table's gradient comes
    back whole on every TP rank. A tied table also gets the lm head's vocab-sharded gradient, and the
    sum is sharded again; FSDP2 redistributes it to the table's placement before its reduce-scatter."""
    if layout.tp == 1 or layout.shard_group > 1 or shape.tied_embeddings:
        return ()
    rows = shape.vocab - shape.vocab // layout.tp
    return (Term("DTensor's embedding backward returns the token table's gradient whole on every TP rank",
                 w * rows * shape.hidden, "w·(V − V/t)·h", DTENSOR + ", aten.embedding_dense_backward"),)  # fmt: skip


def cpu_norm_stats(shape: ModelShape, seq_len: int, micro_batch: int, tricks: Tricks, layout: Layout,
                   device: str) -> tuple[Term, ...]:  # fmt: skip
    """On CPU, native_layer_norm keeps mean and rstd in the input dtype (fp32 on CUDA and meta)."""
    if device == "cuda" or shape.norm != "layernorm" or tricks.precision == "fp32":
        return ()
    tokens = seq_len // (layout.tp if layout.sp else 1) * micro_batch
    value = -2 * 2 * (4 - 2) * tokens  # two norms, mean and rstd, 2 bytes each instead of 4
    return (Term("CPU LayerNorm keeps mean and rstd in 16 bits, not fp32 (two norms)", value,
                 "−2·2·2·{b}·{s}" + ("/{t}" if layout.sp else ""), "aten.native_layer_norm, CPU kernel"),)  # fmt: skip


def activation_predictions(shape: ModelShape, seq_len: int, micro_batch: int, tricks: Tricks, layout: Layout,
                           device: str) -> list[Prediction]:  # fmt: skip
    exact = block_terms(shape, seq_len, micro_batch, tricks, layout)
    exact_bytes = sum(t.value for t in exact)
    cpu = cpu_norm_stats(shape, seq_len, micro_batch, tricks, layout, device)
    checked = Prediction("saved by one block", exact_bytes, cpu,
                         formula="memcalc.exact of the TP shard" + (", norms and dropouts over s/t" if layout.sp else ""))  # fmt: skip
    if tricks.recompute == "op":  # the textbook has no formula for per-op SAC: the op-by-op count alone
        return [checked]
    textbook = layer_activations(shape, seq_len, micro_batch, tricks, layout.tp, layout.sp).per_layer_bytes
    gap = Term("op by op (memcalc.exact on the TP shard) less the textbook", exact_bytes - textbook,
               "", "memcalc.exact; Korthikanti et al. 2022, Table 2")  # fmt: skip
    reference = Prediction("saved by one block, Korthikanti Table 2", textbook, (gap,) + cpu, checked=False,
                           formula="memcalc.parallel.activations.layer_activations")  # fmt: skip
    return [checked, reference]


def predictions(shape: ModelShape, seq_len: int, micro_batch: int, tricks: Tricks, layout: Layout, rank: int,
                device: str, engine: str = "none") -> list[Prediction]:  # fmt: skip
    """Every row of one rank's check, before measuring; with the fsdp2 stack (tp = 1) each phase's peak too."""
    state = state_predictions(shape, tricks, layout, rank, engine)
    rows = state + activation_predictions(shape, seq_len, micro_batch, tricks, layout, device)
    if engine == "fsdp2" and layout.tp == 1:
        rows += phase_predictions(shape, seq_len, micro_batch, tricks, layout, rank, device)
    return rows


# ---- FSDP2's phases: memcalc.exact.replay.fsdp2's replay, and the fsdp2 engine's charge -------------------

REPLAY = "memcalc.exact.replay.fsdp2: FSDP2's hooks replayed on memcalc.exact"


def phase_predictions(shape: ModelShape, seq_len: int, micro_batch: int, tricks: Tricks, layout: Layout, rank: int,
                      device: str) -> list[Prediction]:  # fmt: skip
    """Live bytes between steps and each phase's peak, as memcalc's FSDP2 replay predicts them (CUDA's
    kernels; on CPU, the fake group's, LayerNorm's statistics are 16-bit: named); then the step's peak as
    the fsdp2 engine's textbook charges it (the textbook column of estimate --stack fsdp2, whose verdict is
    this replay), every byte between it and the replay named."""
    from memcalc.exact.replay.fsdp2 import fsdp2_phases  # the simulator: loaded only when a check runs
    from memcalc.exact.replay.fsdp2_units import Param

    params = [Param(t.name, tp_dims(t, layout.tp, rank % layout.tp)) for t in param_tensors(shape)]
    g, reshard = layout.shard_group, layout.reshard_after_forward
    cuda, _ = fsdp2_phases(shape, seq_len, micro_batch, tricks, g, reshard, rank // layout.tp, params)
    run = cuda
    cpu = device != "cuda" and shape.norm == "layernorm" and tricks.precision != "fp32"
    if cpu:
        run, _ = fsdp2_phases(shape, seq_len, micro_batch, tricks, g, reshard, rank // layout.tp, params, True)

    def row(quantity: str, predicted: int, measured: int) -> Prediction:
        diffs = ()
        if measured != predicted:
            diffs = (Term("CPU LayerNorm keeps mean and rstd in 16 bits, not fp32 (those live at this point)",
                          measured - predicted, "", "aten.native_layer_norm, CPU kernel"),)  # fmt: skip
        return Prediction(quantity, predicted, diffs, formula=REPLAY)

    rows = [row("between steps", cuda.state_bytes, run.state_bytes),
            row("forward peak", cuda.forward_peak_bytes, run.forward_peak_bytes),
            row("backward peak", cuda.backward_peak_bytes, run.backward_peak_bytes),
            row("optimizer peak", cuda.optimizer_peak_bytes, run.optimizer_peak_bytes)]  # fmt: skip
    if tricks.recompute == "op":  # the engine's textbook has no per-layer formula for per-op SAC
        return rows
    engine = engine_peak(shape, seq_len, micro_batch, tricks, layout)
    diffs = engine_differences(engine, run)
    rows.append(Prediction("step peak, the fsdp2 engine", engine.total_bytes, diffs,
                           formula="memcalc.parallel.layout_memory, --stack fsdp2 (estimate's textbook)"))  # fmt: skip
    return rows


def engine_peak(shape: ModelShape, seq_len: int, micro_batch: int, tricks: Tricks, layout: Layout):
    """The fsdp2 engine's one stage (pp = 1) for this shape's own parameters, as the textbook charges it."""
    from memcalc.model.gpus import gpu
    from memcalc.model.shape import Model
    from memcalc.model.stacks import stack_for
    from memcalc.parallel.stage_memory import layout_memory

    setup = Setup(seq_len=seq_len, micro_batch=micro_batch, stack=stack_for("fsdp2"))
    model = Model(shape, n_params(shape), "verify")
    (stage,) = layout_memory(model, setup, gpu("h100-sxm"), tricks, layout).stages
    return stage


def engine_differences(st, run) -> tuple[Term, ...]:
    """The replay's peak against the engine's charge, part by part (memcalc.exact.replay.fsdp2.PARTS)."""
    parts = run.peak_parts
    by_name = {p.name: p.bytes for p in st.state.parts}
    state = by_name["weights"] + by_name["adam_m"] + by_name["adam_v"]
    fsdp_buffers = sum(parts[k] for k in ("FSDP2 unsharded parameters", "FSDP2 all-gather buffers",
                                          "bf16 unsharded gradients", "FSDP2 reduce-scatter inputs"))  # fmt: skip
    at = "at the step's peak (" + ("backward" if run.backward_peak_bytes >= run.forward_peak_bytes else "forward") + ")"
    terms = [
        Term("sharded state: FSDP2's padded per-tensor shards, AdamW's m and v of the unpadded ones, fused "
             "AdamW's step counters", parts["sharded state"] - state, "", FSDP2),
        Term(f"sharded gradients {at}: zero_grad(set_to_none) frees them as the step starts, each unit's comes "
             "back with its reduce-scatter", parts["sharded gradients"] - by_name["grads"], "",
             "torchtitan train step; _fsdp_collectives.py foreach_reduce"),
        Term(f"FSDP2's buffers {at} (unsharded parameters, all-gather and reduce-scatter buffers, bf16 "
             "unsharded gradients) against the engine's", fsdp_buffers - st.buffer_bytes, "", FSDP2),
        Term(f"activations and temporaries {at}, op by op (memcalc.exact), against the textbook's activations "
             "and logits", parts["activations and temporaries"] - st.activation_peak_bytes - st.logits_bytes, "",
             "memcalc.exact; Korthikanti et al. 2022, Table 2"),
        Term("token ids (one (b, s + 1) draw) and eager attention's mask buffer", parts["inputs and buffers"], "",
             "verify/dist_measure.py inputs()"),
    ]  # fmt: skip
    return tuple(t for t in terms if t.value)


# ---- measured: which ranks, and each prediction beside its measurement -----------------------------


def compare(predicted: list[Prediction], measured: dict[str, int], layout: Layout, rank: int) -> RankCheck:
    """Pair each prediction with its measurement (same quantity name)."""
    dp_rank, tp_rank = rank_coords(layout, rank)
    rows = []
    for p in predicted:
        key = next((k for k in ("saved by one block", "step peak") if p.quantity.startswith(k)), p.quantity)
        rows.append(RankRow(p.quantity, p.predicted_bytes, measured[key], p.differences, p.checked, p.formula))
    return RankCheck(rank, dp_rank, tp_rank, tuple(rows))


def default_ranks(layout: Layout, device: str) -> tuple[int, ...]:
    """The fake process group plays the first and the last rank (the uneven shards sit there);
    real backends measure every rank."""
    if device == "meta":
        return tuple(sorted({0, layout.world - 1}))
    return tuple(range(layout.world))
