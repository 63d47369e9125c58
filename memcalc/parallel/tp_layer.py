"""What one transformer layer saves for backward on one tensor-parallel rank, op by op (memcalc.exact on the
TP shard): `estimate --exact` over several GPUs, and the per-rank check of `verify --tp`."""

from __future__ import annotations

from dataclasses import replace

from memcalc.model.layout import Layout
from memcalc.model.shape import ModelShape
from memcalc.model.tricks import Tricks
from memcalc.terms import Term

SEQ_SPLIT_SCOPES = ("norm1", "norm2", "attention dropout", "mlp dropout")  # memcalc.exact scopes SP splits


def tp_shape(shape: ModelShape, tp: int) -> ModelShape:
    """The layer one TP rank runs: a/t heads, k/t KV heads, f/t MLP width, the full hidden size."""
    return replace(shape, n_layers=2, n_heads=shape.n_heads // tp, n_kv_heads=shape.n_kv_heads // tp,
                   ffn=shape.ffn // tp, name=f"{shape.name} (TP shard 1/{tp})")  # fmt: skip


def scope(t: Term) -> str:
    """memcalc.exact names a term 'scope: op saves what (dtype)'."""
    return t.name.split(":", 1)[0]


def block_terms(shape: ModelShape, seq_len: int, micro_batch: int, tricks: Tricks, layout: Layout) -> tuple[Term, ...]:
    """Bytes one block saves for backward on one TP rank, op by op (memcalc.exact on the TP shard).

    Without SP a TP rank runs the one-GPU layer of its shard (Shoeybi et al. 2019). With SP the
    norms and the residual dropouts see s/t tokens (Korthikanti et al. 2022, sec. 4.2.2), as does the
    block input full recompute keeps; the all-gathered attention and MLP inputs are saved whole.
    """
    from memcalc.exact.step import exact_activations  # memcalc.sim: loaded only when a check runs

    local = tp_shape(shape, layout.tp)
    whole = exact_activations(local, seq_len, micro_batch, tricks).terms
    if not layout.sp:
        return whole
    split = SEQ_SPLIT_SCOPES + (("checkpoint",) if tricks.recompute in ("full", "op") else ())
    part = exact_activations(local, seq_len // layout.tp, micro_batch, tricks).terms
    terms = tuple(t for t in whole if scope(t) not in split) + tuple(t for t in part if scope(t) in split)
    return terms + sac_reduce_scatters(shape, seq_len, micro_batch, tricks, layout)


def sac_reduce_scatters(shape: ModelShape, seq_len: int, micro_batch: int, tricks: Tricks, layout: Layout) -> tuple[Term, ...]:
    """With SP, per-op SAC also keeps the outputs of the row-parallel projections' reduce-scatters, the
    attention's and the MLP's, each s/t tokens (torchtitan's _save_list holds
    _c10d_functional.reduce_scatter_tensor; DTensor's RowwiseParallel(output_layouts=Shard(1)) runs one)."""
    if not (layout.sp and tricks.recompute == "op"):
        return ()
    nbytes = seq_len // layout.tp * micro_batch * shape.hidden * tricks.act_bytes
    source = "torchtitan _save_list: _c10d_functional.reduce_scatter_tensor; DTensor RowwiseParallel"
    return tuple(Term(f"{part}: reduce_scatter_tensor output, kept by selective checkpointing (SP)", nbytes,
                      "{s}/{t}·{b}·{h}·w", source) for part in ("attention", "mlp"))  # fmt: skip
