"""Engine stacks: what FSDP2 (as torchtitan runs it), Megatron-LM and DeepSpeed ZeRO hold on one GPU.

memcalc.model.layout splits a model over tp · pp · cp · dp GPUs; an engine decides, on top of that:
  which ZeRO stages it runs, and which of them combine with pipeline parallel
  its model state: the stack's recipe (memcalc.memory.state), and what offload moves to the host
  its transient buffers: gathered parameters, unsharded gradients, reduce buckets
  how pipeline stages split the layers, and the dtype its gradients are reduced in

Read from the engines' code at these commits (each formula below names its file):
  NVIDIA/Megatron-LM@d98e8a64ddf34856e74b24714e3bedb2f5a39553
  microsoft/DeepSpeed@38327e07f6cd39b63418f60cedd1651b0be3e7c3
  pytorch/torchtitan@b5bcd76c66d0acb1a08b176d9639425bc55e0b2a
  torch 2.13, torch/distributed/fsdp/_fully_shard (FSDP2 itself)
"""

from __future__ import annotations

from dataclasses import replace
from functools import lru_cache

from memcalc.errors import InputError
from memcalc.memory.state import ModelState
from memcalc.model.shape import ModelShape
from memcalc.records import record
from memcalc.terms import Term

MEGATRON = "NVIDIA/Megatron-LM@d98e8a64ddf34856e74b24714e3bedb2f5a39553"
DEEPSPEED = "microsoft/DeepSpeed@38327e07f6cd39b63418f60cedd1651b0be3e7c3"
TORCHTITAN = "pytorch/torchtitan@b5bcd76c66d0acb1a08b176d9639425bc55e0b2a"
FSDP2 = "torch 2.13 torch/distributed/fsdp/_fully_shard"


@record(frozen=True)
class Engine:
    """A library that splits a model over GPUs, and the ZeRO stages it runs."""

    key: str
    name: str
    zero: tuple[int, ...]  # ZeRO stages it runs
    zero_with_pp: tuple[int, ...]  # of those, the ones it runs with pipeline parallel
    weighted_split: bool  # split pipeline stages counting the embedding and the head as a layer each
    why_not: str  # the one line for a ZeRO stage it does not run
    source: str


ENGINES: dict[str, Engine] = {
    e.key: e
    for e in (
        Engine("none", "memcalc's generic ZeRO", (0, 1, 2, 3), (0, 1), False,
               "ZeRO-{z} with pipeline parallel is unsupported (DeepSpeed's pipeline engine refuses stages 2 "
               "and 3): use ZeRO-1, Megatron's distributed optimizer, or --stack fsdp2 for FSDP with PP",
               "Rajbhandari et al. 2019, sec. 5"),  # fmt: skip
        Engine("fsdp2", "FSDP2 as torchtitan runs it", (0, 3), (0, 3), True,
               "FSDP2 shards parameters, gradients and optimizer state (ZeRO-3), not ZeRO-{z}: give --zero 3 "
               "(with --hybrid for HSDP)",
               f"{TORCHTITAN} torchtitan/distributed/fsdp.py apply_fsdp_to_decoder"),  # fmt: skip
        Engine("megatron", "Megatron-LM", (0, 1), (0, 1), False,
               "Megatron-LM runs DDP (ZeRO 0) or its distributed optimizer (ZeRO-1), not ZeRO-{z}: "
               "--stack deepspeed or fsdp2 shard more",
               f"{MEGATRON} megatron/core/distributed, megatron/core/optimizer/distrib_optimizer.py"),  # fmt: skip
        Engine("deepspeed", "DeepSpeed ZeRO", (0, 1, 2, 3), (0, 1), False,
               "ZeRO-{z} with pipeline parallel is unsupported (DeepSpeed's PipelineEngine asserts ZeRO stage "
               "< 2): use ZeRO-1",
               f"{DEEPSPEED} deepspeed/runtime/pipe/engine.py"),  # fmt: skip
    )
}


def check_engine(layout, key: str) -> None:
    """The ZeRO stage, offload and pipeline an engine runs; one InputError line for what it does not."""
    e = ENGINES[key]
    z = layout.zero
    if z not in e.zero or (layout.pp > 1 and z not in e.zero_with_pp):
        raise InputError(e.why_not.format(z=z))
    if key == "fsdp2" and layout.offload_optimizer and not layout.offload_params:
        raise InputError("FSDP2's CPUOffloadPolicy moves the sharded parameters, gradients and optimizer state "
                         "together: add --offload-params")  # fmt: skip
    if key == "megatron" and layout.offload_params:
        raise InputError("Megatron-LM does not offload parameters (its optimizer CPU offload moves the fp32 "
                         "master and Adam state): drop --offload-params")  # fmt: skip
    if layout.reshard_after_forward is not None and (key != "fsdp2" or layout.shard_ranks == 1):
        # torchtitan's fully_shard(reshard_after_forward=...), applied only when dp_shard · cp > 1
        where = "one data-parallel rank, which FSDP2 does not shard" if key == "fsdp2" else \
            f"not on {'reference, torch or hf' if key == 'none' else key}"  # fmt: skip
        raise InputError("--reshard/--no-reshard set FSDP2's reshard_after_forward (--stack fsdp2 over several "
                         f"data-parallel GPUs), {where}: drop it")  # fmt: skip


def engine_layout(layout, key: str):
    """The layout as the engine runs it: FSDP2 over several dp × cp ranks is ZeRO-3 unless told (torchtitan
    applies fully_shard when dp_shard · cp > 1, torchtitan/config/configs.py mixed_precision_param)."""
    if key == "fsdp2" and layout.zero == 0 and layout.shard_ranks > 1:
        return replace(layout, zero=3)
    return layout


def grad_reduce_bytes(key: str, precision: str) -> int:
    """Bytes of one gradient element on the wire.

    FSDP2: MixedPrecisionPolicy(reduce_dtype=fp32) (torchtitan/config/configs.py mixed_precision_reduce), the
    reduce-scatter input is fp32 (_fsdp_collectives.py foreach_reduce). Megatron-LM: bf16 reduces the fp32
    main_grad buffer (megatron/training/arguments.py accumulate_allreduce_grads_in_fp32). DeepSpeed ZeRO and
    memcalc's generic layouts: the 16-bit gradients (deepspeed/runtime/engine.py get_data_types: with ZeRO the
    gradient accumulation dtype is the model's)."""
    if precision == "fp32" or key == "fsdp2" or (key == "megatron" and precision == "bf16"):
        return 4
    return 2


# ---- DeepSpeed ZeRO -----------------------------------------------------------------------------


@record(frozen=True)
class DeepSpeedConfig:
    """deepspeed/runtime/zero/config.py DeepSpeedZeroConfig defaults (elements, not bytes)."""

    reduce_bucket_size: int = 500_000_000  # reduce_bucket_size: Field(pp_int(5e8))
    allgather_bucket_size: int = 500_000_000  # allgather_bucket_size: Field(pp_int(5e8))
    overlap_comm: bool | None = None  # None: True for stage 3 only (overlap_comm_valid)
    prefetch_bucket_size: int = 50_000_000  # stage3_prefetch_bucket_size: Field(pp_int(5e7))
    max_live_parameters: int = 1_000_000_000  # stage3_max_live_parameters: Field(pp_int(1e9))
    param_persistence_threshold: int = 100_000  # stage3_param_persistence_threshold: Field(pp_int(1e5))
    sub_group_size: int = 1_000_000_000  # sub_group_size: Field(pp_int(1e9))

    def overlaps(self, zero: int) -> bool:
        return self.overlap_comm if self.overlap_comm is not None else zero == 3


DEEPSPEED_DEFAULTS = DeepSpeedConfig()
DS_ZERO = "deepspeed/runtime/zero/config.py"


def deepspeed_state(state: ModelState, zero: int, offload: bool, ds: DeepSpeedConfig = DEEPSPEED_DEFAULTS) -> ModelState:
    """DeepSpeed's model state from the grad_partition recipe's parts, adjusted where its code differs:

    - ZeRO-3 casts the fp32 gradients one sub-group at a time (stage3.py _prepare_fp32_grad_for_sub_group,
      released after each sub-group's step): at most sub_group_size elements.
    - With offload_optimizer, ZeRO-2 copies each gradient into the fp32 partition on the host
      (stage_1_and_2.py async_inplace_copy_grad_to_fp32_buffer_from_gpu) and ZeRO-3 allocates its 16-bit
      gradient partitions on the host (stage3.py grad_partitions_flat_buffer): the 16-bit grads leave the GPU.
    """
    parts = []
    for p in state.parts:
        if p.name == "grads_fp32" and zero == 3:
            p = replace(p, bytes=min(p.bytes, 4 * ds.sub_group_size))
        if p.name == "grads" and offload and zero >= 2:
            p = replace(p, on_host=True)
        parts.append(p)
    return replace(state, parts=tuple(parts))


def deepspeed_buffers(shape: ModelShape, tp: int, zero: int, w: int, first: bool, last: bool, pp: int, layers: int,
                      shards: int, ds: DeepSpeedConfig = DEEPSPEED_DEFAULTS) -> tuple[Term, ...]:  # fmt: skip
    """DeepSpeed's transient buffers on one GPU of a stage of `layers` blocks, w bytes per 16-bit element,
    parameters partitioned over `shards` ranks.

    ZeRO 1-2: the contiguous-gradients bucket, reduce_bucket_size elements, two with overlap_comm (off by
    default below stage 3) (stage_1_and_2.py backward: ipg_buffer, torch.empty(reduce_bucket_size)); allocated at every backward
    whatever the model's size. The updated partitions are all-gathered into the flat 16-bit groups in
    allgather_bucket_size pieces: no buffer of their own.
    ZeRO-3 (stage3.py, partitioned_param_coordinator.py): the reduce bucket (__ipg_bucket_flat_buffer); the
    parameters gathered at once, the running module and those prefetched up to stage3_prefetch_bucket_size,
    never more than stage3_max_live_parameters; the running module's unsharded 16-bit gradient; the
    parameters under stage3_param_persistence_threshold elements (norms, biases), which stay whole on every
    rank (this rank's partition of them is in its model state already). DeepSpeed gathers per module:
    the largest is the embedding or the output layer for an LLM.
    """
    if zero == 0:
        return ()
    n = 2 if zero < 3 and ds.overlaps(zero) else 1  # stage 3 keeps one __ipg_bucket_flat_buffer
    bucket = Term(f"DeepSpeed reduce bucket{'s (overlap_comm)' if n > 1 else ''}: {ds.reduce_bucket_size:,} "
                  "16-bit elements", n * w * ds.reduce_bucket_size, f"{n}·{w}·reduce_bucket_size",
                  f"{DS_ZERO} reduce_bucket_size; stage_1_and_2.py / stage3.py ipg buffer")  # fmt: skip
    if zero < 3:
        return (bucket,)
    largest = largest_module(shape, tp, first, last, pp)
    live = min(largest + ds.prefetch_bucket_size, max(ds.max_live_parameters, largest))
    small = persistent_params(shape, tp, ds.param_persistence_threshold) * layers
    return (
        bucket,
        Term("DeepSpeed ZeRO-3 gathered parameters: the largest module + the prefetch bucket", w * live,
             f"{w}·min(P_module + prefetch_bucket_size, max_live_parameters)",
             f"{DS_ZERO} stage3_prefetch_bucket_size, stage3_max_live_parameters; the largest module "
             f"({largest:,} parameters) as estimate_zero3_model_states_mem_needs counts it"),  # fmt: skip
        Term("DeepSpeed ZeRO-3 unsharded gradient of that module (16-bit)", w * largest, f"{w}·P_module",
             "deepspeed/runtime/zero/stage3.py reduce_independent_p_g_buckets_and_remove_grads"),
        Term("DeepSpeed ZeRO-3 persistent parameters (under the persistence threshold), whole on every rank",
             w * (small - small // shards), f"{w}·(L/p)·P_small·(n − 1)/n",
             f"{DS_ZERO} stage3_param_persistence_threshold ({ds.param_persistence_threshold:,} elements)"),  # fmt: skip
    )


def largest_module(shape: ModelShape, tp: int, first: bool, last: bool, pp: int) -> int:
    """The parameters of the largest module on this TP rank and stage (one nn.Module's own parameters, as
    deepspeed/runtime/zero/stage3.py model_to_params counts them): a projection, an MLP matrix, or the
    vocab-split embedding or output layer on the first and last stages."""
    h, v = shape.hidden, -(-shape.vocab // tp)
    sizes = [h * shape.q_dim // tp, h * shape.ffn // tp]
    if first:
        sizes.append(v * h)
    if last and (not shape.tied_embeddings or pp > 1):
        sizes.append(v * h)
    return max(sizes)


@lru_cache(maxsize=256)
def persistent_params(shape: ModelShape, tp: int, threshold: int) -> int:
    """One layer's parameters in tensors of fewer than `threshold` elements: the norms, q/k norms and biases
    (row-parallel biases replicated, column-parallel ones split over tp). Per layer; the caller multiplies."""
    h, q, kv, f = shape.hidden, shape.q_dim // tp, shape.kv_dim // tp, shape.ffn // tp
    tensors = [h] * shape.norms_per_layer * (2 if shape.norm == "layernorm" else 1)
    tensors += [width for width in shape.qk_norm_widths if width]
    if shape.linear_bias:
        tensors += [q, kv, kv, h, f * (2 if shape.gated_mlp else 1), h]
    elif shape.qkv_bias:
        tensors += [q, kv, kv]
    return sum(x for x in tensors if x < threshold)


# ---- FSDP2 as torchtitan runs it ------------------------------------------------------------------


def reshards_after_forward(layout) -> bool:
    """torchtitan's reshard_after_forward_policy 'default': True without pipeline parallel, False with it
    ("to avoid per-microbatch all-gathers", torchtitan/distributed/fsdp.py get_fsdp_reshard_after_forward_policy);
    Layout.reshard_after_forward overrides it ('always' / 'never')."""
    return layout.pp == 1 if layout.reshard_after_forward is None else layout.reshard_after_forward


def fsdp2_buffers(layer: int, layers: int, head: int, w: int, reshard: bool, stage: int = 0,
                  pipelined: bool = False) -> tuple[Term, ...]:  # fmt: skip
    """FSDP2's working memory at the start of backward, when the activations peak (torch 2.13
    torch/distributed/fsdp/_fully_shard; one fully_shard unit per block, torchtitan apply_fsdp_to_decoder).

    layer: one block's parameters on this TP rank; layers: the stage's blocks; head: the [norm, lm_head]
    unit's parameters on the last stage (0 elsewhere); w: bytes of param_dtype (bf16: 2); stage: every
    parameter of the stage on this TP rank.
      gathered blocks   reshard_after_forward: the running block and the one prefetched (FSDP2's implicit
                        prefetch, _fsdp_param_group.py wait_for_unshard); without it every block of the stage
                        stays unsharded from its forward to its backward
      gradients         one unit's unsharded gradients in param_dtype, until its post_backward copies them
                        into the reduce-scatter input (foreach_reduce: unsharded_grads.clear())
      reduce-scatter    that input in reduce_dtype fp32 (foreach_reduce: reduce_scatter_comm.allocate), kept
                        until the next unit's post_backward (reduce_scatter_max_input_buffers = 1)
      output unit       torchtitan does not reshard [norm, lm_head] after forward (reshard_after_forward=
                        policy == 'always'): it stays gathered until its backward
    Under pipeline parallel (torch/distributed/pipelining/stage.py backward_maybe_with_nosync) every
    backward but the last runs with set_reshard_after_backward(False) and set_requires_gradient_sync(False):
    the stage's parameters stay gathered from the first micro-batch on, and its unsharded gradients
    accumulate across micro-batches in reduce_dtype (_fsdp_param.py to_accumulated_grad_if_needed), reduced
    once after the last backward (stage.py perform_reduce_grad).
    """
    if pipelined:
        return (
            Term("FSDP2 stage parameters kept gathered across micro-batches (pipelining)", w * stage,
                 f"{w}·P_stage", "torch/distributed/pipelining/stage.py: set_reshard_after_backward(False)"),
            Term("FSDP2 unsharded gradients accumulated across micro-batches (reduce_dtype fp32)", 4 * stage,
                 "4·P_stage", "torch/distributed/pipelining/stage.py: set_requires_gradient_sync(False); "
                 f"{FSDP2}/_fsdp_param.py to_accumulated_grad_if_needed"),
        )  # fmt: skip
    unit = max(layer, head)
    if reshard:
        gathered = Term("FSDP2 gathered blocks: the running one and the one prefetched", 2 * w * layer,
                        f"2·{w}·P_layer/{{t}}", f"{FSDP2}/_fsdp_param_group.py wait_for_unshard")  # fmt: skip
    else:
        gathered = Term("FSDP2 blocks kept unsharded from forward to backward (reshard_after_forward=False)",
                        w * layers * layer, f"{w}·(L/p)·P_layer/{{t}}",
                        f"{TORCHTITAN} torchtitan/distributed/fsdp.py get_fsdp_reshard_after_forward_policy")  # fmt: skip
    out = [
        gathered,
        Term("FSDP2 unsharded gradients of one unit (param_dtype)", w * unit, f"{w}·P_unit",
             f"{FSDP2}/_fsdp_collectives.py foreach_reduce"),
        Term("FSDP2 reduce-scatter input of one unit (reduce_dtype fp32)", 4 * unit, "4·P_unit",
             f"{FSDP2}/_fsdp_collectives.py foreach_reduce; _fsdp_param_group.py post_backward"),
    ]
    if head:
        out.append(Term("FSDP2 [norm, lm_head] kept gathered from forward to backward", w * head, f"{w}·P_head",
                        f"{TORCHTITAN} torchtitan/distributed/fsdp.py apply_fsdp_to_decoder"))  # fmt: skip
    return tuple(out)


# ---- Megatron-LM ------------------------------------------------------------------------------------

MEGATRON_MEMORY = "megatron/training/theoretical_memory_usage.py"


def megatron_bucket_size(dp: int) -> int:
    """Parameters per gradient bucket: max(40,000,000, 1,000,000 · dp) (megatron/core/distributed/
    distributed_data_parallel.py). Buckets are views into the contiguous param and grad buffers
    (param_and_grad_buffer.py _get): they time the overlap, they hold no memory of their own.

    memcalc times Megatron-LM with its gradient reduce and parameter gather overlapped, as its Llama 3
    recipe runs it (examples/llama/train_llama3_8b_h100_fp8.sh: --overlap-grad-reduce
    --overlap-param-gather); the arguments' defaults are off (megatron/training/arguments.py), and then
    the whole data-parallel traffic is exposed (Assumptions(overlap_dp=0))."""
    return max(40_000_000, 1_000_000 * dp)
