"""memcalc's two model families in plain PyTorch, built from a memcalc ModelShape.

gpt    the textbook GPT-2/3 layer (Korthikanti et al. 2022, sec. 4.1): MHA, LayerNorm, 4h GELU
       MLP, dropout on the attention probabilities and on both residual branches.
llama  the Llama/Qwen layer: GQA, RMSNorm, SwiGLU, RoPE, no dropout.
moe    a mixture of experts in place of the MLP (MoE), and latent attention (LatentAttention) in place of
       attention where the shape has them: the reference blocks memcalc.exact mirrors (issue 13).
The family only picks the MLP (shape.gated_mlp); every other ModelShape field is honoured as given
(norm, biases, qk_norm, tied embeddings, learned or rotary positions, dropout), so the parameter
count equals memcalc.model.params.param_counts(shape) for any shape.

The layers are verify/builder_layers.py's, the mixture of experts and latent attention
verify/builder_moe.py's; this module assembles them into blocks and the model, and checkpoints them.

The model is built on the meta device (nothing allocated) and materialised where it is measured.
Which kernel runs attention and dropout is an explicit, documented switch (Kernels), because on
meta and CPU stock PyTorch takes code paths that CUDA does not:
  F.dropout on CPU/meta multiplies by a mask of the input dtype (2 bytes in bf16); on CUDA it is
  the fused aten.native_dropout, which saves a 1-byte bool mask. dropout="native" calls that op.
  SDPA on meta always takes the math path (s×s materialised); on CUDA its flash backend calls
  aten._scaled_dot_product_flash_attention. attention="aten-flash" calls that op directly.
(A TorchFunctionMode shim would do the same invisibly, but it breaks checkpoint recompute.)

Checkpointing (Kernels.recompute): selective wraps the attention core in torch.utils.checkpoint; full
wraps every block, or with ckpt_every = N every Nth (torchtitan's per-layer selective AC); op wraps
every block with torchtitan's per-op policy through create_selective_checkpoint_contexts. torchtitan
calls torch.utils.checkpoint through ptd_checkpoint_wrapper(module, preserve_rng_state=False); here
it is called directly (non-reentrant, the wrapper's default), and preserve_rng_state stays True: the
RNG state it stashes is a CPU tensor, nothing on the device.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils._pytree import tree_leaves
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from memcalc.errors import InputError
from memcalc.model.moe_mla import is_moe_layer, moe_layer_count
from memcalc.model.shape import ModelShape, check_positions

from .builder_layers import Attention, Kernels, RMSNorm, dropout, make_mlp, make_norm, rope_tables
from .builder_moe import LatentAttention, MoE, balanced_routing

__all__ = ["Kernels", "Transformer", "build", "init_weights", "materialise", "rope_tables", "sac_contexts",
           "sac_policy"]  # fmt: skip


# torchtitan's per-op selective AC, as torchtitan v0.1.0 applies it (commit
# f7084fc78567f865d0c411f2c7b9bbbef6b155ac, torchtitan/models/llama3/infra/parallelize.py,
# _save_list and _apply_ac_to_transformer_block): the same ops, the same rule, written here.
# (Later torchtitan moved it to torchtitan/distributed/activation_checkpoint.py, per model.)
SAC_SAVE_OPS = frozenset({
    torch.ops.aten.mm.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops._c10d_functional.reduce_scatter_tensor.default,
    torch.ops.aten.max.default,  # float8's amax
})  # fmt: skip


def sac_policy(counts: dict, observe: Callable | None = None):
    """MUST_SAVE the outputs of SAC_SAVE_OPS except every second aten.mm (counts: this checkpointed
    call's mm count, forward and recompute apart), PREFER_RECOMPUTE everything else. observe (verify's
    instrument, not torchtitan's) is shown the tensors of every output kept."""

    def policy(ctx, func, *args, **kwargs):
        pass_ = "recompute" if ctx.is_recompute else "forward"
        if func == torch.ops.aten.mm.default:
            counts[pass_] += 1
        keep = func in SAC_SAVE_OPS and not (func == torch.ops.aten.mm.default and counts[pass_] % 2 == 0)
        if keep and observe is not None:
            observe([t for t in tree_leaves(ctx.op_output) if isinstance(t, torch.Tensor)])
        return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def sac_contexts(observe: Callable | None = None):
    """context_fn for torch.utils.checkpoint: a fresh mm count for each checkpointed call."""
    return create_selective_checkpoint_contexts(sac_policy(defaultdict(int), observe))


class Block(nn.Module):
    """Pre-norm block: x + drop(attn(norm(x))), then x + drop(mlp(norm(x))); moe: its MLP a mixture of experts."""

    def __init__(self, shape: ModelShape, kernels: Kernels, moe: bool = False):
        super().__init__()
        self.shape, self.kernels = shape, kernels
        self.norm1 = make_norm(shape, shape.hidden)
        self.attn = LatentAttention(shape, kernels) if shape.is_mla else Attention(shape, kernels)
        self.norm2 = make_norm(shape, shape.hidden)
        self.mlp = MoE(shape) if moe else make_mlp(shape)

    def drop(self, x: torch.Tensor) -> torch.Tensor:
        return dropout(x, self.shape.dropout, self.kernels.dropout, self.training)

    def forward(self, x, cos, sin, future, *routing) -> torch.Tensor:
        x = x + self.drop(self.attn(self.norm1(x), cos, sin, future))
        if isinstance(self.mlp, MoE):
            return x + self.drop(self.mlp(self.norm2(x), routing))
        return x + self.drop(self.mlp(self.norm2(x)))


MTP_WEIGHT = 0.3  # the MTP loss's weight, lambda (DeepSeek-V3 report sec. 4.2: 0.3, later 0.1): no bytes depend on it


class MTP(nn.Module):
    """A multi-token prediction module (DeepSeek-V3 report sec. 2.2; Megatron-LM multi_token_prediction.py):
    the model's last hidden state and the next token's embedding, each normalised, concatenated and projected
    (2h -> h), one block (MoE when the model's last is), a final norm; the embedding and the output head are
    the model's own. It predicts the token after next from every position (the last wraps around: same shapes)."""

    def __init__(self, shape: ModelShape, kernels: Kernels, moe: bool):
        super().__init__()
        self.hnorm = make_norm(shape, shape.hidden)
        self.enorm = make_norm(shape, shape.hidden)
        self.proj = nn.Linear(2 * shape.hidden, shape.hidden, bias=False)
        self.block = Block(shape, kernels, moe)
        self.norm = make_norm(shape, shape.hidden)


class Transformer(nn.Module):
    """Token ids and targets in, mean cross-entropy out (the logits never leave forward)."""

    def __init__(self, shape: ModelShape, kernels: Kernels, seq_len: int):
        super().__init__()
        check_positions(shape, seq_len)
        self.shape, self.kernels, self.seq_len = shape, kernels, seq_len
        self.tok_emb = nn.Embedding(shape.vocab, shape.hidden)
        self.pos_emb = nn.Embedding(shape.max_positions, shape.hidden) if shape.positions == "learned" else None
        if shape.mtp_layers > 1:
            raise InputError("verify's reference model builds one multi-token prediction module (DeepSeek-V3's)")
        self.blocks = nn.ModuleList(Block(shape, kernels, is_moe_layer(shape, i)) for i in range(shape.n_layers))
        self.norm = make_norm(shape, shape.hidden)
        self.lm_head = None if shape.tied_embeddings else nn.Linear(shape.hidden, shape.vocab, bias=False)
        last_is_moe = is_moe_layer(shape, shape.n_layers - 1)
        self.mtp = MTP(shape, kernels, last_is_moe) if shape.mtp_layers else None
        # Eager attention's causal mask, (T, T) bool, True above the diagonal; one buffer for all layers.
        future = None if kernels.flash else torch.ones(seq_len, seq_len, dtype=torch.bool).triu(1)
        self.register_buffer("future", future, persistent=False)
        self.sac_observer: Callable | None = None  # verify's: shown the outputs per-op selective AC keeps

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        B, T = idx.shape
        x = self.tok_emb(idx)  # (B, T, h)
        if self.pos_emb is not None:
            x = x + self.pos_emb(torch.arange(T, device=idx.device))
        cos = sin = None
        if self.shape.positions == "rope":
            cos, sin = rope_tables(T, self.shape.rope_dim, x.dtype, idx.device)  # (T, hs) each
        future = self.future[:T, :T] if self.future is not None else None
        routing = balanced_routing(B * T, self.shape, idx.device) if moe_layer_count(self.shape) else ()
        for i, block in enumerate(self.blocks):
            if self.kernels.recompute == "op":  # torchtitan's per-op selective AC
                context = lambda: sac_contexts(self.sac_observer)
                x = checkpoint(block, x, cos, sin, future, *routing, use_reentrant=False, context_fn=context)
            elif self.kernels.checkpointed(i):  # full AC, or per-layer selective AC (every Nth block)
                x = checkpoint(block, x, cos, sin, future, *routing, use_reentrant=False)
            else:
                x = block(x, cos, sin, future, *routing)
        last = x if self.mtp is not None else None  # the MTP module's input: the hidden state before the final norm
        x = self.norm(x)
        weight = self.tok_emb.weight if self.lm_head is None else self.lm_head.weight
        logits = F.linear(x, weight)  # (B, T, V) in the activation dtype
        loss = F.cross_entropy(logits.float().view(B * T, -1), targets.view(B * T))  # fp32 upcast for the loss
        if self.mtp is None:
            return loss
        return loss + MTP_WEIGHT * self.mtp_loss(last, idx, targets, weight, cos, sin, future, routing)

    def mtp_loss(self, x, idx, targets, weight, cos, sin, future, routing) -> torch.Tensor:
        """The MTP module's cross-entropy against the token after next."""
        B, T = idx.shape
        m = self.mtp
        nxt = self.tok_emb(idx.roll(-1, 1))  # the next token's embedding
        y = m.proj(torch.cat((m.hnorm(x), m.enorm(nxt)), dim=-1))
        if self.kernels.recompute == "full":
            y = checkpoint(m.block, y, cos, sin, future, *routing, use_reentrant=False)
        else:
            y = m.block(y, cos, sin, future, *routing)
        logits = F.linear(m.norm(y), weight)
        return F.cross_entropy(logits.float().view(B * T, -1), targets.roll(-1, 1).view(B * T))


def build(shape: ModelShape, kernels: Kernels, seq_len: int, dtype: torch.dtype) -> Transformer:
    """The model on the meta device, parameters in dtype: nothing is allocated."""
    with torch.device("meta"):
        model = Transformer(shape, kernels, seq_len)
    model = model.to(dtype)
    if kernels.fp8:
        from .float8 import convert

        convert(model, kernels.fp8)
    return model


@torch.no_grad()
def init_weights(model: Transformer) -> None:
    """GPT-2's initialisation (normal, std 0.02; norms one; biases zero) and the causal mask."""
    for module in model.modules():
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)
        if isinstance(module, (nn.LayerNorm, RMSNorm)):  # (MoE's gate is an nn.Linear: normal, std 0.02)
            nn.init.ones_(module.weight)
        if isinstance(module, nn.LayerNorm) and module.bias is not None:
            nn.init.zeros_(module.bias)
    if model.future is not None:
        model.future.copy_(torch.ones_like(model.future).triu(1))


def materialise(model: Transformer, device: str | torch.device) -> Transformer:
    """Allocate the meta model's tensors on device and initialise them."""
    model.to_empty(device=device)
    init_weights(model)
    return model
