"""The parameter tensors of verify/builder.py's model as a (dp × tp) job places them, and the elements one
rank holds: each tensor with the dim tensor parallelism splits (ParamTensor, param_tensors), its piece on
a TP rank (tp_dims: DTensor Shard, torch.chunk's pieces), its FSDP2 shard on a data-parallel rank
(fsdp_numel: dim 0 chunked, padded to a multiple of G), the sums over the model (local_counts), and a
rank's place on the mesh (rank_coords).
"""

from __future__ import annotations

import math

from memcalc.errors import InputError
from memcalc.model.layout import Layout
from memcalc.model.shape import ModelShape
from memcalc.records import record


def rank_coords(layout: Layout, rank: int) -> tuple[int, int]:
    """(dp rank, tp rank) on the (dp, tp) mesh: TP ranks are neighbours (Megatron-LM's order)."""
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < layout.world:
        raise InputError(f"rank must be a whole number in [0, {layout.world}), got {rank!r}")
    return rank // layout.tp, rank % layout.tp



@record(frozen=True)
class ParamTensor:
    """One parameter tensor of the model, and the dimension TP splits it on."""

    name: str
    dims: tuple[int, ...]
    tp_dim: int | None  # 0: column-parallel (and its bias) or vocab-parallel; 1: row-parallel; None: replicated


def linear(name: str, n_in: int, n_out: int, bias: bool, tp_dim: int | None) -> list[ParamTensor]:
    """nn.Linear: weight (out, in); a row-parallel layer's bias is replicated (Shoeybi et al. 2019)."""
    out = [ParamTensor(name + ".weight", (n_out, n_in), tp_dim)]
    if bias:
        out.append(ParamTensor(name + ".bias", (n_out,), 0 if tp_dim == 0 else None))
    return out


def norm(shape: ModelShape, name: str) -> list[ParamTensor]:
    out = [ParamTensor(name + ".weight", (shape.hidden,), None)]
    if shape.norm == "layernorm":
        out.append(ParamTensor(name + ".bias", (shape.hidden,), None))
    return out


def block_tensors(shape: ModelShape, i: int) -> list[ParamTensor]:
    h, q, kv, f = shape.hidden, shape.q_dim, shape.kv_dim, shape.ffn
    n, qkv_bias = f"blocks.{i}.", shape.linear_bias or shape.qkv_bias
    out = norm(shape, n + "norm1")
    out += linear(n + "attn.wq", h, q, qkv_bias, 0) + linear(n + "attn.wk", h, kv, qkv_bias, 0)
    out += linear(n + "attn.wv", h, kv, qkv_bias, 0) + linear(n + "attn.wo", q, h, shape.linear_bias, 1)
    if shape.qk_norm:
        out += [ParamTensor(n + "attn.q_norm.weight", (shape.head_dim,), None),
                ParamTensor(n + "attn.k_norm.weight", (shape.head_dim,), None)]  # fmt: skip
    out += norm(shape, n + "norm2")
    if shape.gated_mlp:  # SwiGLU: gate and up column-parallel, down row-parallel
        out += linear(n + "mlp.gate", h, f, shape.linear_bias, 0) + linear(n + "mlp.up", h, f, shape.linear_bias, 0)
        out += linear(n + "mlp.down", f, h, shape.linear_bias, 1)
    else:
        out += linear(n + "mlp.fc", h, f, shape.linear_bias, 0) + linear(n + "mlp.proj", f, h, shape.linear_bias, 1)
    return out


def param_tensors(shape: ModelShape) -> list[ParamTensor]:
    """Every parameter tensor of verify/builder.py's Transformer, with the dim TP splits."""
    out = [ParamTensor("tok_emb.weight", (shape.vocab, shape.hidden), 0)]  # vocab-parallel
    if shape.positions == "learned":
        out.append(ParamTensor("pos_emb.weight", (shape.max_positions, shape.hidden), None))
    for i in range(shape.n_layers):
        out += block_tensors(shape, i)
    out += norm(shape, "norm")
    if not shape.tied_embeddings:
        out.append(ParamTensor("lm_head.weight", (shape.vocab, shape.hidden), 0))
    return out


def chunk(n: int, k: int, i: int) -> int:
    """Rows of piece i when torch.chunk splits n rows k ways: ⌈n/k⌉ each until they run out."""
    c = -(-n // k)
    return max(0, min(c, n - i * c))


def tp_dims(t: ParamTensor, tp: int, tp_rank: int) -> tuple[int, ...]:
    """The tensor on one TP rank: DTensor Shard(tp_dim) splits as torch.chunk does."""
    if t.tp_dim is None or tp == 1:
        return t.dims
    dims = list(t.dims)
    dims[t.tp_dim] = chunk(dims[t.tp_dim], tp, tp_rank)
    return tuple(dims)


def fsdp_numel(dims: tuple[int, ...], g: int, g_rank: int, padded: bool) -> int:
    """FSDP2 shards dim 0 with torch.chunk; the padded shard is ⌈d0/G⌉ rows on every rank."""
    rest = math.prod(dims[1:])
    return (-(-dims[0] // g) if padded else chunk(dims[0], g, g_rank)) * rest


@record(slots=True)
class LocalCounts:
    """Elements one rank holds, counted tensor by tensor."""

    shard_elements: int  # this rank's FSDP2 chunks (what .float() copies: master, m, v)
    padded_elements: int  # the padded FSDP2 shards (what weights and reduce-scattered grads occupy)


def local_counts(shape: ModelShape, layout: Layout, rank: int) -> LocalCounts:
    dp_rank, tp_rank = rank_coords(layout, rank)
    g = layout.shard_group
    shard_n = padded_n = 0
    for t in param_tensors(shape):
        dims = tp_dims(t, layout.tp, tp_rank)
        shard_n += fsdp_numel(dims, g, dp_rank, False) if g > 1 else math.prod(dims)
        padded_n += fsdp_numel(dims, g, dp_rank, True) if g > 1 else math.prod(dims)
    return LocalCounts(shard_n, padded_n)
