"""verify/builder.py's Transformer split over a (dp, tp) device mesh with PyTorch's own tools.

tp  DTensor tensor parallelism (torch.distributed.tensor.parallel), torchtitan's Llama plan:
    W_q, W_k, W_v, W_gate, W_up, W_fc column-parallel; W_o, W_down, W_proj row-parallel
    (Shoeybi et al. 2019); the token table vocab-parallel (RowwiseParallel on an Embedding,
    Megatron's VocabParallelEmbedding) and the logits vocab-parallel with loss_parallel().
sp  sequence parallel on the tp group (Korthikanti et al. 2022): the norms run on s/t tokens
    (SequenceParallel), attention and MLP inputs are all-gathered (PrepareModuleInput) and their
    outputs reduce-scattered (RowwiseParallel(output_layouts=Shard(1))).
dp  FSDP2 (torch.distributed.fsdp.fully_shard) per block and at the root: ZeRO-3.
The model's Attention reads its head counts from its shape, so each TP rank's Attention gets the
shape of its shard (a/t heads, k/t KV heads): torchtitan's view(bs, seqlen, -1, head_dim).
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard  # FSDP2, public since torch 2.6
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from memcalc.model.layout import Layout


def block_plan(block: nn.Module, sp: bool) -> dict:
    """One block's TP plan: torchtitan's parallelize_llama, for both MLP kinds."""
    out = Shard(1) if sp else Replicate()  # row-parallel outputs: reduce-scatter (SP) or all-reduce
    plan = {"attn.wq": ColwiseParallel(), "attn.wk": ColwiseParallel(), "attn.wv": ColwiseParallel(),
            "attn.wo": RowwiseParallel(output_layouts=out)}  # fmt: skip
    if block.shape.gated_mlp:
        plan.update({"mlp.gate": ColwiseParallel(), "mlp.up": ColwiseParallel(),
                     "mlp.down": RowwiseParallel(output_layouts=out)})  # fmt: skip
    else:
        plan.update({"mlp.fc": ColwiseParallel(), "mlp.proj": RowwiseParallel(output_layouts=out)})
    if sp:  # norms on s/t tokens; attention and MLP see the all-gathered sequence
        plan.update({
            "norm1": SequenceParallel(), "norm2": SequenceParallel(),
            "attn": PrepareModuleInput(input_layouts=(Shard(1), None, None, None),
                                       desired_input_layouts=(Replicate(), None, None, None)),
            "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        })  # fmt: skip
    return plan


def tensor_parallel(model: nn.Module, mesh, sp: bool) -> None:
    """DTensor TP (+SP) over a 1-D mesh, in place; the model may still be on the meta device."""
    tp = mesh.size()
    shape = model.shape
    local = replace(shape, n_heads=shape.n_heads // tp, n_kv_heads=shape.n_kv_heads // tp)
    for block in model.blocks:
        block.attn.shape = local  # Attention.forward views q, k, v with the rank's own heads
        parallelize_module(block, mesh, block_plan(block, sp))
    learned = model.pos_emb is not None
    # SP: the embedding's output reduce-scattered over the sequence; with learned positions the
    # position rows are added to the whole sequence first and block 0 takes its slice (no comm).
    emb_out = Shard(1) if sp and not learned else Replicate()
    top = {"tok_emb": RowwiseParallel(input_layouts=Replicate(), output_layouts=emb_out)}
    if not shape.tied_embeddings:
        top["lm_head"] = ColwiseParallel()  # its weight only: the model calls F.linear on it
    if sp and learned:
        top["blocks.0"] = PrepareModuleInput(input_layouts=(Replicate(), None, None, None),
                                             desired_input_layouts=(Shard(1), None, None, None), use_local_output=True)  # fmt: skip
    parallelize_module(model, mesh, top)
    # The final norm's output as a replicated DTensor, so F.linear with the vocab-sharded table
    # gives vocab-sharded logits for loss_parallel (Megatron's vocab-parallel cross-entropy).
    if sp:
        parallelize_module(model.norm, mesh, SequenceParallel())
    layout = Shard(1) if sp else Replicate()
    parallelize_module(model.norm, mesh, PrepareModuleOutput(output_layouts=layout, desired_output_layouts=Replicate(),
                                                             use_local_output=False))  # fmt: skip


def fsdp(model: nn.Module, mesh, reshard_after_forward: bool = True) -> None:
    """FSDP2 per block and at the root (torchtitan's apply_fsdp): ZeRO-3 over the dp mesh."""
    for block in model.blocks:
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard_after_forward)


def torchtitan_fsdp(model: nn.Module, mesh, reshard: bool | None = None, pipelined: bool = False,
                    param_dtype: torch.dtype = torch.bfloat16) -> None:  # fmt: skip
    """FSDP2 as torchtitan applies it (torchtitan/distributed/fsdp.py apply_fsdp_to_decoder, pytorch/torchtitan@
    b5bcd76c): MixedPrecisionPolicy(param_dtype, reduce_dtype=fp32, cast_forward_inputs=False) over fp32
    parameters (param_dtype: torchtitan's mixed_precision_param, bf16 by default, fp32 to train in fp32);
    the token table, [final norm, lm_head] (tied: [table, final norm]), each block, then the root.
    reshard: the reshard_after_forward_policy ('always' True, 'never' False, None 'default': not pipelined);
    [norm, lm_head] reshards only under 'always', the root never (fully_shard's default for the root).
    A pipeline stage's part (verify/dist_pipeline.py StagePart) has only the units it holds (tok_emb or norm None)."""
    policy = (not pipelined) if reshard is None else reshard
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32, cast_forward_inputs=False)
    config = {"mesh": mesh, "mp_policy": mp}
    if model.lm_head is None and model.tok_emb is not None and model.norm is not None:
        fully_shard([model.tok_emb, model.norm], **config, reshard_after_forward=reshard is True)
    else:  # a pipeline stage's part holds the token table (first stage) or [norm, lm_head] (last) or neither
        if model.tok_emb is not None:
            fully_shard(model.tok_emb, **config, reshard_after_forward=policy)
        if model.norm is not None and model.lm_head is not None:
            fully_shard([model.norm, model.lm_head], **config, reshard_after_forward=reshard is True)
    for block in model.blocks:
        fully_shard(block, **config, reshard_after_forward=policy)
    fully_shard(model, **config)


def parallelize(model: nn.Module, layout: Layout, mesh, engine: str = "none",
                param_dtype: torch.dtype = torch.bfloat16) -> None:  # fmt: skip
    """TP over mesh['tp'], then FSDP2 over mesh['dp'] (2-D: FSDP shards the TP shards): per block and at the
    root (engine none), or as torchtitan does (engine fsdp2, computing in param_dtype)."""
    if layout.tp > 1:
        tensor_parallel(model, mesh["tp"], layout.sp)
    if layout.zero == 3 and layout.dp > 1:
        if engine == "fsdp2":
            torchtitan_fsdp(model, mesh["dp"], layout.reshard_after_forward, param_dtype=param_dtype)
        else:
            fsdp(model, mesh["dp"])
