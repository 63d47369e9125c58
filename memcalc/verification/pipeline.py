"""One rank of FSDP2 + pipeline parallel (torchtitan's FSDP + PP): memcalc's per-stage prediction (the fsdp2
engine's StageMemory, what estimate --stack fsdp2 --pp P prints) held against one stage's rank measured on the
fake process group (verify/dist_pipeline.py), every byte between them named.

Named by formula (exact): FSDP2's per-tensor padded shards and fused AdamW's step counters against the flat
⌈w·P/G⌉ state; torch.distributed.pipelining's recv buffers (one activation and one output-gradient buffer per
micro-batch, kept for the stage's life, stage.py _setup_forward_recv_info / _setup_backward_recv_info), the stage
inputs' gradients they accumulate (kept until the next step's clear_runtime_states) and the token ids.
Named by part at the step's peak (measured split, as memcalc.verification.distributed.engine_differences does
with the FSDP2 replay's): the gathered parameters and accumulated gradients against the engine's buffers, and the
activations and temporaries against the engine's held activations and logits. FSDP2's hooks with micro-batches
in flight are not replayed on memcalc.exact yet: the peak row's split is the measurement's own.
This module is torch-free.
"""

from __future__ import annotations

from dataclasses import replace

from memcalc.errors import InputError
from memcalc.memory.estimate import Setup
from memcalc.model.layout import Layout
from memcalc.model.params import n_params
from memcalc.model.shape import Model, ModelShape
from memcalc.model.tricks import Tricks
from memcalc.parallel.stage_memory import StageMemory
from memcalc.terms import Term

from .dist_results import RankCheck, RankRow
from .dist_tensors import LocalCounts, ParamTensor, block_tensors, fsdp_numel, norm
from .distributed import FSDP2, Prediction, state_differences

PIPELINING = "torch/distributed/pipelining/stage.py"


def check_pipeline(shape: ModelShape, setup: Setup, tricks: Tricks, layout: Layout, stage: int) -> None:
    """What the FSDP + PP check runs: torchtitan's FSDP2 over dp > 1 on each of pp > 1 stages, 1F1B, tp = cp = 1."""
    if setup.stack.engine != "fsdp2":
        raise InputError("--pp is checked as torchtitan runs FSDP + PP: add --stack fsdp2")
    if layout.tp > 1 or layout.cp > 1 or layout.sp:
        raise InputError("the FSDP + PP check runs tp 1 and cp 1: drop --tp/--sp")
    if layout.dp < 2:
        raise InputError("--stack fsdp2 shards over data-parallel ranks: give --fsdp N with N > 1")
    if shape.tied_embeddings:
        raise InputError("a tied table under pipeline parallel needs a copy on the last stage, which verify's model "
                         "lacks: the FSDP + PP check runs untied tables (llama3, qwen3-8b and larger)")  # fmt: skip
    if tricks.precision == "fp16":
        raise InputError("fp16: torchtitan trains in bf16 or fp32; use bf16 or fp32")
    if tricks.recompute == "op":
        raise InputError("the FSDP + PP check runs none, selective, full or ckpt:N recompute")
    if setup.optimizer != "adamw":
        raise InputError(f"the FSDP + PP check runs torch.optim.AdamW(fused=True), not {setup.optimizer}")
    if isinstance(stage, bool) or not isinstance(stage, int) or not 0 <= stage < layout.pp:
        raise InputError(f"--stage must be a whole number in [0, {layout.pp}), got {stage!r}")


def stage_memory_of(shape: ModelShape, setup: Setup, tricks: Tricks, layout: Layout, stage: int
                    ) -> tuple[StageMemory, tuple[int, ...]]:  # fmt: skip
    """The fsdp2 engine's StageMemory of one stage (memcalc.parallel.stage_memory) and the layers per stage."""
    from memcalc.model.gpus import gpu
    from memcalc.parallel.stage_memory import layout_memory

    memory = layout_memory(Model(shape, n_params(shape), "verify"), setup, gpu("h100-sxm"), tricks, layout)
    return memory.stages[stage], memory.stage_layers


def peak_stage(shape: ModelShape, setup: Setup, tricks: Tricks, layout: Layout) -> int:
    """The stage estimate --stack fsdp2 --pp P reports as the layout's peak (its per-GPU number): the default
    stage to check."""
    from memcalc.model.gpus import gpu
    from memcalc.parallel.stage_memory import layout_memory

    return layout_memory(Model(shape, n_params(shape), "verify"), setup, gpu("h100-sxm"), tricks, layout).peak.stage


def stage_tensors(shape: ModelShape, layers: tuple[int, ...], stage: int) -> list[ParamTensor]:
    """The parameter tensors of one stage's part (verify/dist_pipeline.py StagePart)."""
    out = []
    if stage == 0:
        out.append(ParamTensor("tok_emb.weight", (shape.vocab, shape.hidden), 0))
        if shape.positions == "learned":
            out.append(ParamTensor("pos_emb.weight", (shape.max_positions, shape.hidden), None))
    start = sum(layers[:stage])
    for i in range(start, start + layers[stage]):
        out += block_tensors(shape, i)
    if stage == len(layers) - 1:
        out += norm(shape, "norm") + [ParamTensor("lm_head.weight", (shape.vocab, shape.hidden), 0)]
    return out


def stage_counts(tensors: list[ParamTensor], g: int) -> LocalCounts:
    """Rank 0 of the shard group: each tensor's first torch.chunk piece, and its padded shard."""
    return LocalCounts(sum(fsdp_numel(t.dims, g, 0, False) for t in tensors),
                       sum(fsdp_numel(t.dims, g, 0, True) for t in tensors))  # fmt: skip


def state_terms(st: StageMemory, tensors: list[ParamTensor], g: int) -> tuple[Term, ...]:
    """The engine's flat sharded state to FSDP2's: padded per-tensor fp32 shards and gradients, AdamW's m and v
    of the unpadded shards, and fused AdamW's float32 step counter per parameter tensor."""
    parts = {p.name: p.bytes for p in st.state.parts}
    counts = stage_counts(tensors, g)
    weights = state_differences(parts["weights"], 4, 1, counts, g, True)
    grads = state_differences(parts["grads"], 4, 1, counts, g, True)
    moments = state_differences(parts["adam_m"] + parts["adam_v"], 4, 2, counts, g, False)
    total = sum(t.value for t in weights + grads + moments)
    out = []
    if total:
        out.append(Term(f"FSDP2's per-tensor dim-0 shards over {g} (padded for the weights and gradients), not the "
                        "flat state", total, "Σ 4·(2·⌈d0/G⌉ + 2·chunk(d0, G, 0))·rest − state", FSDP2))  # fmt: skip
    n = len(tensors)
    out.append(Term(f"fused AdamW's step counter, a float32 tensor per parameter ({n} tensors)", 4 * n,
                    "4·n_tensors", "torch/optim/adam.py _init_group"))  # fmt: skip
    return tuple(out)


def pipeline_terms(shape: ModelShape, seq_len: int, micro_batch: int, m: int, w: int, stage: int, pp: int,
                   input_grads: bool, flash: bool = True) -> tuple[Term, ...]:  # fmt: skip
    """What torch.distributed.pipelining and the batch hold on a stage between steps: the recv buffers, the
    stage inputs' gradients (input_grads: once a backward has run), the token ids, and without flash the causal
    mask buffer verify's model registers on every stage's part."""
    act = micro_batch * seq_len * shape.hidden * w
    first, last = stage == 0, stage == pp - 1
    kinds = (not first) + (not last)
    out = []
    if kinds:
        what = " and ".join(x for x, on in (("activation", not first), ("output-gradient", not last)) if on)
        out.append(Term(f"pipelining's recv buffers: one {what} buffer per micro-batch, (b, s, h) each", kinds * m * act,
                        f"{kinds}·m·b·s·h·{w}", f"{PIPELINING} _setup_forward_recv_info, _setup_backward_recv_info"))  # fmt: skip
    if input_grads and not first:
        out.append(Term("the stage inputs' gradients, accumulated into each recv buffer's .grad until the next step",
                        m * act, f"m·b·s·h·{w}", f"{PIPELINING} clear_runtime_states; _backward.py stage_backward"))  # fmt: skip
    ids = (first + last) * m * micro_batch * seq_len * 8
    if ids:
        out.append(Term("token ids (first stage) and targets (last stage), int64, every micro-batch of the step", ids,
                        "8·m·b·s per end", "verify/dist_pipeline.py stage_inputs"))  # fmt: skip
    if not flash:
        out.append(Term("eager attention's causal mask buffer of the stage's part ((s, s) bool)", seq_len * seq_len,
                        "{s}²", "verify/builder.py Transformer.future"))  # fmt: skip
    return tuple(out)


def layer_saved_bytes(shape: ModelShape, seq_len: int, micro_batch: int, tricks: Tricks) -> int:
    """Bytes one block saves for backward, op by op (memcalc.exact; equal to the measured block under FSDP2,
    tests/test_verify_fsdp2.py)."""
    from memcalc.exact.step import exact_activations  # memcalc.exact: loaded only when a check runs

    return exact_activations(replace(shape, n_layers=2), seq_len, micro_batch, tricks).per_layer_bytes


REST = {  # the measured activations and temporaries less the held ones, by the phase the step peaked in
    "backward": "the rest of the activations and temporaries at the step's peak (in a backward), against the engine's "
                "rebuilt layer and logits: the running backward's gradients and temporaries, each in-flight "
                "micro-batch's stage output kept for its backward, a parameter's gradient not yet on it (lm_head's, the "
                "token table's), less what the running micro-batch has freed",
    "forward": "the rest of the activations and temporaries at the step's peak (in a forward), against the engine's "
               "rebuilt layer and logits: each in-flight micro-batch's stage output and the running op's temporaries",
    "reduce": "the rest at the step's peak (in perform_reduce_grad, no activation left): a unit's fp32 reduce-scatter "
              "input and the accumulated gradients foreach_reduce holds, against the engine's rebuilt layer and logits",
}  # fmt: skip


def peak_terms(st: StageMemory, parts: dict[str, int], state: tuple[Term, ...], layer_exact: int,
               phase: str = "backward") -> tuple[Term, ...]:  # fmt: skip
    """The measured step peak split by part (verify/dist_pipeline.py PARTS) against the engine's charge; the
    activations split into the held layer-micro-batches op by op less the textbook (by formula) and the rest
    (measured). layer_exact: one block's saved bytes, op by op; phase: where the measured step peaked."""
    by_name = {p.name: p.bytes for p in st.state.parts}
    pipeline = parts["pipeline recv buffers"] + parts["stage input gradients"] + parts["token ids and buffers"]
    engine = {t.name: t.value for t in st.buffers}
    gathered = next(v for k, v in engine.items() if "parameters kept gathered" in k)
    accumulated = next(v for k, v in engine.items() if "gradients accumulated" in k)
    terms = list(state)
    terms += [
        Term("sharded gradients at the step's peak: zero_grad(set_to_none) frees them as the step starts; they come "
             "back with the reduce-scatter after the last backward", parts["sharded gradients"] - by_name["grads"], "",
             "torchtitan train step; stage.py perform_reduce_grad"),
        Term("FSDP2's gathered parameters at the step's peak (padded to G·⌈d0/G⌉ rows; a unit not yet gathered) "
             "against the engine's w·P_stage", parts["FSDP2 unsharded parameters"] - gathered, "",
             f"{FSDP2}/_fsdp_param.py init_all_gather_outputs"),
        Term("FSDP2's fp32 accumulated gradients at the step's peak (padded rows; those not yet made) against the "
             "engine's 4·P_stage", parts["FSDP2 accumulated gradients"] - accumulated, "",
             f"{FSDP2}/_fsdp_param.py to_accumulated_grad_if_needed"),
        Term("a micro-batch's gradients in param_dtype, on the unsharded parameters until FSDP2 adds them into the "
             "fp32 accumulation", parts["FSDP2 micro-batch gradients"], "",
             f"{FSDP2}/_fsdp_param.py accumulate_unsharded_grad_if_needed"),
        Term("pipelining's recv buffers, the stage inputs' gradients, the token ids (and the mask buffer) at the "
             "step's peak", pipeline,
             "", PIPELINING),
        Term(f"the held activations op by op (memcalc.exact) less the textbook's: {st.held} layer-micro-batches "
             "in flight (1F1B)", st.held * (layer_exact - st.layer.per_layer_bytes), "held·(exact − textbook) per layer",
             "memcalc.exact; Korthikanti et al. 2022, Table 2; memcalc.parallel.pipeline held_layers"),
        Term(REST[phase], parts["activations and temporaries"] - st.held * layer_exact - st.layer.rebuilt_bytes
             - st.logits_bytes, "", "verify/dist_pipeline.py, measured"),
    ]  # fmt: skip
    return tuple(t for t in terms if t.value)


def stage_check(shape: ModelShape, setup: Setup, tricks: Tricks, layout: Layout, stage: int,
                measured: dict[str, object]) -> RankCheck:  # fmt: skip
    """The rows of one stage's rank: the sharded state, live bytes between steps and at the optimizer step (named
    by formula, judged), the step's peak against the engine's (split by the measured part, shown, not judged:
    a split taken from the measurement cannot fail), the forward, backward and reduce peaks shown."""
    st, layers = stage_memory_of(shape, setup, tricks, layout, stage)
    g = layout.shard_group
    tensors = stage_tensors(shape, layers, stage)
    w = 4 if tricks.precision == "fp32" else 2
    state = state_terms(st, tensors, g)
    kept = pipeline_terms(shape, setup.seq_len, setup.micro_batch, setup.grad_accum, w, stage, layout.pp, True,
                          tricks.flash)  # fmt: skip
    total = st.state.total_bytes
    formula = f"memcalc.parallel.layout_memory, --stack fsdp2 --pp {layout.pp}: stage {stage} ({layers[stage]} layers)"
    preds = [
        Prediction("sharded state", total, state, formula=formula + ", state"),
        Prediction("between steps", total, state + kept, formula=formula + ", state"),
        Prediction("optimizer peak", total, state + kept, formula=formula + ", state (fused AdamW: in place)"),
        Prediction("step peak, the fsdp2 engine", st.total_bytes,
                   peak_terms(st, measured["peak parts"], state,
                              layer_saved_bytes(shape, setup.seq_len, setup.micro_batch, tricks),
                              str(measured["step peak at"]).split(":")[0]),
                   checked=False,  # its split is the measurement's own (no replay of FSDP2 + PP yet): shown, not judged
                   formula=formula + " (estimate's number)"),
        Prediction("forward peak", st.total_bytes, (), checked=False, formula="shown beside the engine's peak"),
        Prediction("backward peak", st.total_bytes, (), checked=False, formula="shown beside the engine's peak"),
        Prediction("gradient reduce peak", st.total_bytes, (), checked=False,
                   formula="perform_reduce_grad, after the last backward; shown beside the engine's peak"),
    ]  # fmt: skip
    values = dict(measured)
    values["sharded state"] = measured["weights"] + measured["grads"] + measured["optimizer state"]
    values["step peak, the fsdp2 engine"] = measured["step peak"]
    values["gradient reduce peak"] = measured["reduce peak"]
    rows = tuple(RankRow(p.quantity, p.predicted_bytes, values[p.quantity], p.differences, p.checked, p.formula)
                 for p in preds)  # fmt: skip
    return RankCheck(stage * layout.dp, 0, 0, rows)
