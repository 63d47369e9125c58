"""verify/builder.py's model, op by op, in bytes on memcalc.exact.sim.graph: its parameters as nn.Module
registers them (every block's, latent attention's and the experts' among them, and the MTP module's), and its
forward pass from the token ids to the loss: the blocks, the final norm, the logits, cross-entropy, the MTP loss.

Each function mirrors the PyTorch code of the same name line by line, so that Python keeps the
same temporaries alive for the same time. The layers a block is made of are memcalc.exact.builder.layers'
(norms, RoPE, attention, the MLP); a mixture of experts and latent attention are memcalc.exact.builder.moe's.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from memcalc.model.moe_mla import is_moe_layer, moe_layer_count

from .. import aten
from ..aten.cast_policy import Autocast, autocast_for
from ..aten.operands import made
from ..aten.te import meta_tensors, workspace
from ..base.config import StepConfig
from ..sim.graph import Graph
from ..sim.tensors import Tensor
from .layers import attention, dropout, linear, mlp, norm, rope_tables
from .moe import expert_counts, latent, mixture, routing_tables


@dataclass
class Block:
    norm1: list[Tensor]  # weight (+ bias for LayerNorm)
    wq: list[Tensor]  # weight (+ bias)
    wk: list[Tensor]
    wv: list[Tensor]
    wo: list[Tensor]
    q_norm: Tensor | None
    k_norm: Tensor | None
    norm2: list[Tensor]
    mlp: list[list[Tensor]]  # [fc, proj] or [gate, up, down], each weight (+ bias)
    latent: dict[str, list[Tensor]] | None = None  # latent attention's projections and norms (MLA)
    experts: Experts | None = None  # a mixture of experts in place of mlp


@dataclass
class Experts:
    """A MoE layer's parameters (verify/builder.py MoE): the router, each expert's MLP, the shared experts'.
    Experts that receive as many tokens run the same kernels on the same shapes: each run of them is one
    group, its MLP's parameters standing for all of them (copies; memcalc.exact.sim.tensors.Region)."""

    gate: Tensor
    experts: list[list[list[Tensor]]]  # per group
    shared: list[list[Tensor]] | None
    groups: list[tuple[str, int, int]]  # per group: its name (sim.group_of), its experts, each one's tokens


@dataclass
class Mtp:
    """verify/builder.py MTP's parameters: the two norms, the 2h -> h projection, its block, its final norm."""

    hnorm: list[Tensor]
    enorm: list[Tensor]
    proj: list[Tensor]
    block: Block
    norm: list[Tensor]


@dataclass
class Transformer:
    cfg: StepConfig
    tok_emb: Tensor
    pos_emb: Tensor | None
    blocks: list[Block]
    norm: list[Tensor]
    lm_head: Tensor | None
    future: Tensor | None  # eager attention's causal mask buffer, (T, T) bool
    params: list[Tensor] = field(default_factory=list)  # in model.parameters() order
    mtp: Mtp | None = None  # the multi-token prediction module
    autocast: Autocast | None = None  # the autocast recipe's: forward runs under it
    te_buffers: list[Tensor] = field(default_factory=list)  # fp8:te's meta tensors and cuBLAS workspace


def build(g: Graph, cfg: StepConfig) -> Transformer:
    """The parameters in the order nn.Module registers them, and the buffers."""
    s, dt, params = cfg.shape, cfg.weights_dtype, []
    g.fp8 = cfg.fp8

    def p(shape, name, copies=1):
        params.append(g.param(shape, dt, name, copies))
        return params[-1]

    def linear(n_in, n_out, bias, name, copies=1):
        return [p((n_out, n_in), name + ".weight", copies)] + ([p((n_out,), name + ".bias", copies)] if bias else [])

    def norm(dim, name):
        return [p((dim,), name + ".weight")] + ([p((dim,), name + ".bias")] if s.norm == "layernorm" else [])

    h = s.hidden
    tok = p((s.vocab, h), "tok_emb.weight")
    pos = p((s.max_positions, h), "pos_emb.weight") if s.positions == "learned" else None
    runs = expert_runs(cfg)
    blocks = [build_block(s, i, f"blocks.{i}.", p, linear, norm, runs) for i in range(s.n_layers)]
    final = norm(h, "norm")
    head = None if s.tied_embeddings else p((s.vocab, h), "lm_head.weight")
    mtp = build_mtp(s, p, linear, norm, runs) if s.mtp_layers else None
    future = None
    if not cfg.flash:  # register_buffer("future", (T, T) bool)
        future = g.empty((cfg.seq_len, cfg.seq_len), "bool", "buffer future", kind="buffer")
    autocast = autocast_for(cfg.recipe, cfg.precision, cfg.device)
    return Transformer(cfg, tok, pos, blocks, final, head, future, params, mtp, autocast, te_buffers(g, cfg, blocks))


def te_buffers(g: Graph, cfg: StepConfig, blocks: list[Block]) -> list[Tensor]:
    """Under fp8:te, what Transformer Engine keeps from the first step on: each block linear's fp8 meta
    tensors and the one cuBLAS workspace (memcalc.exact.aten.te)."""
    if cfg.fp8 != "te":
        return []
    linears = [lin for blk in blocks for lin in (blk.wq, blk.wk, blk.wv, blk.wo, *blk.mlp) if lin]
    return [workspace(g)] + [t for _ in linears for t in meta_tensors(g)]


def expert_runs(cfg: StepConfig) -> list[tuple[int, int, int]]:
    """The experts of a MoE layer as runs of equal ones, (first, how many, tokens each): the balanced router
    gives expert e the slots e, e + E, ... of the B·T·k (builder_moe.expert_counts), so at most two runs;
    one expert per run where cfg.collapse is off, and under torchtitan's per-op policy (recompute "op"),
    which keeps every second mm of the block: a gated expert's three put neighbours on opposite parities."""
    s = cfg.shape
    if not s.n_experts:
        return []
    counts = expert_counts(cfg.micro_batch * cfg.seq_len * s.experts_per_token, s.n_experts)
    if not cfg.collapse or cfg.recompute == "op":
        return [(e, 1, c) for e, c in enumerate(counts)]
    runs: list[tuple[int, int, int]] = []
    for e, c in enumerate(counts):
        if runs and runs[-1][2] == c:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1, c)
        else:
            runs.append((e, 1, c))
    return runs


def build_block(s, i: int, n: str, p, linear, norm, runs=(), expert: str = "{n}mlp.experts.{e}.") -> Block:
    """Block i's parameters (verify/builder.py Block), in registration order: norm1, the attention's (latent
    for MLA), norm2, the MLP's (a mixture of experts: the router, each run of equal experts (expert_runs),
    the shared experts). expert: an expert's name (its first number is the block a parameter belongs to:
    memcalc.exact.sim.graph.layer_of); a run's is its first expert's."""
    h, qkv_bias = s.hidden, s.linear_bias or s.qkv_bias
    norm1 = norm(h, n + "norm1")
    wq = wk = wv = wo = []
    qn = kn = latent = None
    if s.is_mla:
        a, latent = n + "attn.", {}
        if s.q_lora_rank:
            latent["q_a"] = linear(h, s.q_lora_rank, False, a + "q_a")
            latent["q_a_norm"] = [p((s.q_lora_rank,), a + "q_a_norm.weight")]
            latent["q_b"] = linear(s.q_lora_rank, s.n_heads * s.head_dim, False, a + "q_b")
        else:
            latent["wq"] = linear(h, s.n_heads * s.head_dim, False, a + "wq")
        latent["kv_a"] = linear(h, s.kv_lora_rank + s.qk_rope_head_dim, False, a + "kv_a")
        latent["kv_a_norm"] = [p((s.kv_lora_rank,), a + "kv_a_norm.weight")]
        latent["kv_b"] = linear(s.kv_lora_rank, s.n_heads * (s.qk_nope_head_dim + s.v_head_dim), False, a + "kv_b")
        latent["wo"] = linear(s.n_heads * s.v_head_dim, h, False, a + "wo")
    else:
        wq, wk = linear(h, s.q_dim, qkv_bias, n + "attn.wq"), linear(h, s.kv_dim, qkv_bias, n + "attn.wk")
        wv, wo = linear(h, s.kv_dim, qkv_bias, n + "attn.wv"), linear(s.q_dim, h, s.linear_bias, n + "attn.wo")
        qn = p((s.head_dim,), n + "attn.q_norm.weight") if s.qk_norm else None
        kn = p((s.head_dim,), n + "attn.k_norm.weight") if s.qk_norm else None
    norm2 = norm(h, n + "norm2")
    mlp, experts = [], None
    if is_moe_layer(s, i):
        gate = linear(h, s.n_experts, False, n + "mlp.gate")[0]
        names = [expert.format(n=n, e=e) for e, _, _ in runs]
        each = [mlp_params(s, s.routed_ffn, name, linear, copies) for name, (_, copies, _) in zip(names, runs)]
        shared = mlp_params(s, s.shared_ffn, n + "mlp.shared.", linear) if s.n_shared_experts else None
        experts = Experts(gate, each, shared, [(name[:-1], copies, c) for name, (_, copies, c) in zip(names, runs)])
    else:
        mlp = mlp_params(s, s.ffn, n + "mlp.", linear)
    return Block(norm1, wq, wk, wv, wo, qn, kn, norm2, mlp, latent, experts)


def mlp_params(s, width: int, n: str, linear, copies: int = 1) -> list[list[Tensor]]:
    """[gate, up, down] or [fc, proj] of an MLP width wide (verify/builder.py make_mlp); copies: of equal experts."""
    h, bias = s.hidden, s.linear_bias
    if s.gated_mlp:
        return [linear(h, width, bias, n + "gate", copies), linear(h, width, bias, n + "up", copies),
                linear(width, h, bias, n + "down", copies)]  # fmt: skip
    return [linear(h, width, bias, n + "fc", copies), linear(width, h, bias, n + "proj", copies)]


def build_mtp(s, p, linear, norm, runs) -> Mtp:
    """The MTP module's parameters, after the output head's. Their names carry no number (sim.layer_of: none):
    the module runs outside the blocks."""
    h = s.hidden
    hnorm, enorm = norm(h, "mtp.hnorm"), norm(h, "mtp.enorm")
    proj = linear(2 * h, h, False, "mtp.proj")
    block = build_block(s, s.n_layers - 1, "mtp.block.", p, linear, norm, runs, "{n}mlp.experts.e{e}.")
    return Mtp(hnorm, enorm, proj, block, norm(h, "mtp.norm"))


def forward(g: Graph, m: Transformer, idx: Tensor, targets: Tensor) -> Tensor:
    """recipe.forward: the model, under torch.autocast where the recipe autocasts (verify/autocast.py)."""
    if m.autocast is None:
        return transformer(g, m, idx, targets)
    with m.autocast.region(g):
        return transformer(g, m, idx, targets)


def transformer(g: Graph, m: Transformer, idx: Tensor, targets: Tensor) -> Tensor:
    """Transformer.forward: token ids and targets in, the mean cross-entropy (fp32 scalar) out."""
    cfg, s = m.cfg, m.cfg.shape
    B, T = idx.shape
    with g.scoped("embedding"):
        x = aten.embedding(g, m.tok_emb, idx)  # (B, T, h)
        if m.pos_emb is not None:
            x = aten.add(g, x, aten.embedding(g, m.pos_emb, made(g, (T,), "arange", dtype="int64")))
    cos = sin = None
    if s.positions == "rope":
        with g.scoped("rope tables"):
            cos, sin = rope_tables(g, T, s.rope_dim, x.dtype)
    future, tricks = m.future, cfg.tricks
    policy = torchtitan_policy if cfg.recompute == "op" else None
    routing = routing_tables(g, B * T, s) if moe_layer_count(s) else ()
    for i, b in enumerate(m.blocks):
        g.layer = i
        if tricks.checkpointed(i):  # ckpt, ckpt:N (every Nth block), sac (each block, with its policy)
            x = g.checkpoint(lambda x, cos, sin, future, *r, b=b: block(g, cfg, b, x, cos, sin, future, r),
                             x, cos, sin, future, *routing, policy=policy)  # fmt: skip
        else:
            x = block(g, cfg, b, x, cos, sin, future, routing)
    g.layer = None
    last = x if m.mtp is not None else None  # the MTP module's input
    x = norm(g, x, m.norm, "final norm", cfg.device == "cpu")
    weight = m.tok_emb if m.lm_head is None else m.lm_head
    with g.scoped("logits"):
        logits = aten.linear(g, x, weight, None, "logits")  # (B, T, V)
    with g.scoped("loss"):
        flat = aten.view(g, targets, (B * T,))
        loss = cross_entropy(g, aten.view(g, aten.to(g, logits, "fp32"), (B * T, s.vocab)), flat)
    if m.mtp is None:
        return loss
    return aten.add(g, loss, aten.mul_scalar(g, mtp_loss(g, m, last, idx, targets, weight, cos, sin, future, routing)))


def block(g: Graph, cfg: StepConfig, b: Block, x, cos, sin, future, routing=()) -> Tensor:
    """Block.forward (verify/builder.py Block): x + dropout(attention(norm1(x))), then x + dropout(mlp(norm2(x))),
    the attention latent (MLA) and the MLP a mixture of experts where the block has them."""
    p, cpu = cfg.shape.dropout, cfg.device == "cpu"
    attend = latent if b.latent is not None else attention
    x = aten.add(g, x, dropout(g, attend(g, cfg, b, norm(g, x, b.norm1, "norm1", cpu), cos, sin, future), p,
                               "attention dropout"))  # fmt: skip
    if b.experts is not None:
        return aten.add(g, x, dropout(g, mixture(g, cfg, b, norm(g, x, b.norm2, "norm2", cpu), routing), p, "mlp dropout"))
    return aten.add(g, x, dropout(g, mlp(g, cfg, b, norm(g, x, b.norm2, "norm2", cpu)), p, "mlp dropout"))


# torchtitan v0.1.0 (f7084fc7), torchtitan/models/llama3/infra/parallelize.py: _save_list, the ops whose
# outputs per-op selective AC keeps (aten.mm, the SDPA efficient and flash ops, the functional
# reduce_scatter_tensor, aten.max): those verify/builder.py's model dispatches are mm and the flash op.
SAC_SAVE = ("mm", "_scaled_dot_product_efficient_attention", "_scaled_dot_product_flash_attention",
            "reduce_scatter_tensor", "max")  # fmt: skip


def torchtitan_policy(op: str, count: int) -> bool:
    """torchtitan's _custom_policy (same file, _apply_ac_to_transformer_block): MUST_SAVE the outputs of
    the ops in _save_list except every second aten.mm (count: the op's calls in the block so far, this
    one included), PREFER_RECOMPUTE the rest. A Llama block's mms are wq, wk, wv, wo, gate, up, down:
    wq, wv, gate and down are kept; a linear with a bias is aten.addmm, never kept."""
    return op in SAC_SAVE and not (op == "mm" and count % 2 == 0)


def cross_entropy(g: Graph, logits: Tensor, targets: Tensor) -> Tensor:
    """F.cross_entropy: log_softmax, then nll_loss (mean). CPU's autocast wraps aten.cross_entropy_loss
    (fp32); CUDA's wraps the log_softmax and nll_loss inside it (fp32 as well)."""
    (logits,) = aten.autocast(g, "cross_entropy_loss", logits)
    return aten.nll_loss(g, aten.log_softmax(g, logits), targets)


def mtp_loss(g: Graph, m: Transformer, x, idx, targets, weight, cos, sin, future, routing) -> Tensor:
    """Transformer.mtp_loss: the next token's embedding and x normalised, concatenated, projected, a block, the
    final norm, the shared head, cross-entropy against the token after next (targets rolled)."""
    cfg, s, mt = m.cfg, m.cfg.shape, m.mtp
    B, T = idx.shape
    with g.scoped("mtp"):
        nxt = aten.embedding(g, m.tok_emb, made(g, (B, T), "roll", idx, dtype="int64"))
        y = linear(g, aten.cat_last(g, norm(g, x, mt.hnorm, "mtp"), norm(g, nxt, mt.enorm, "mtp")), mt.proj)
        if cfg.recompute == "full":
            y = g.checkpoint(lambda y, cos, sin, future, *r: block(g, cfg, mt.block, y, cos, sin, future, r),
                             y, cos, sin, future, *routing)  # fmt: skip
        else:
            y = block(g, cfg, mt.block, y, cos, sin, future, routing)
    with g.scoped("logits"):
        logits = aten.linear(g, norm(g, y, mt.norm, "mtp"), weight, None, "logits")
    with g.scoped("loss"):
        return cross_entropy(g, aten.view(g, aten.to(g, logits, "fp32"), (B * T, s.vocab)),
                             aten.view(g, made(g, (B, T), "roll", targets, dtype="int64"), (B * T,)))
