"""verify/builder.py's model, op by op, in bytes on memcalc.exact.sim: its parameters as nn.Module
registers them, and its forward pass.

Each function mirrors the PyTorch code of the same name line by line, so that Python keeps the
same temporaries alive for the same time. Where a reshape copies depends on memory layout, which
the simulator does not track; those places say so (a_copies, b_copies, grad_copies) with the reason.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from memcalc.model.shape import is_moe_layer, moe_layer_count

from . import aten
from .autocast import Autocast, autocast_for
from .config import Config
from .sim import Graph, Tensor


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
    """A MoE layer's parameters (verify/builder.py MoE): the router, each expert's MLP, the shared experts'."""

    gate: Tensor
    experts: list[list[list[Tensor]]]
    shared: list[list[Tensor]] | None


@dataclass
class Mtp:
    """verify/builder.py MTP's parameters: the two norms, the 2h -> h projection, its block, its final norm."""

    hnorm: list[Tensor]
    enorm: list[Tensor]
    proj: list[Tensor]
    block: Block
    norm: list[Tensor]


@dataclass
class Model:
    cfg: Config
    tok_emb: Tensor
    pos_emb: Tensor | None
    blocks: list[Block]
    norm: list[Tensor]
    lm_head: Tensor | None
    future: Tensor | None  # eager attention's causal mask buffer, (T, T) bool
    params: list[Tensor] = field(default_factory=list)  # in model.parameters() order
    mtp: Mtp | None = None  # the multi-token prediction module
    autocast: Autocast | None = None  # the autocast recipe's: forward runs under it


# -- build ----------------------------------------------------------------------------------------


def build(g: Graph, cfg: Config) -> Model:
    """The parameters in the order nn.Module registers them, and the buffers."""
    s, dt, params = cfg.shape, cfg.weights_dtype, []

    def p(shape, name):
        params.append(g.param(shape, dt, name))
        return params[-1]

    def linear(n_in, n_out, bias, name):
        return [p((n_out, n_in), name + ".weight")] + ([p((n_out,), name + ".bias")] if bias else [])

    def norm(dim, name):
        return [p((dim,), name + ".weight")] + ([p((dim,), name + ".bias")] if s.norm == "layernorm" else [])

    h, qkv_bias = s.hidden, s.linear_bias or s.qkv_bias
    tok = p((s.vocab, h), "tok_emb.weight")
    pos = p((s.max_positions, h), "pos_emb.weight") if s.positions == "learned" else None
    blocks = []
    for i in range(s.n_layers):
        n = f"blocks.{i}."
        if s.is_mla or is_moe_layer(s, i):  # MLA or a mixture of experts: build_moe_block
            blocks.append(build_moe_block(s, i, n, p, linear, norm))
            continue
        norm1 = norm(h, n + "norm1")
        wq, wk = linear(h, s.q_dim, qkv_bias, n + "attn.wq"), linear(h, s.kv_dim, qkv_bias, n + "attn.wk")
        wv, wo = linear(h, s.kv_dim, qkv_bias, n + "attn.wv"), linear(s.q_dim, h, s.linear_bias, n + "attn.wo")
        qn = p((s.head_dim,), n + "attn.q_norm.weight") if s.qk_norm else None
        kn = p((s.head_dim,), n + "attn.k_norm.weight") if s.qk_norm else None
        norm2 = norm(h, n + "norm2")
        if s.gated_mlp:
            mlp = [linear(h, s.ffn, s.linear_bias, n + "mlp.gate"), linear(h, s.ffn, s.linear_bias, n + "mlp.up"),
                   linear(s.ffn, h, s.linear_bias, n + "mlp.down")]  # fmt: skip
        else:
            mlp = [linear(h, s.ffn, s.linear_bias, n + "mlp.fc"), linear(s.ffn, h, s.linear_bias, n + "mlp.proj")]
        blocks.append(Block(norm1, wq, wk, wv, wo, qn, kn, norm2, mlp))
    final = norm(h, "norm")
    head = None if s.tied_embeddings else p((s.vocab, h), "lm_head.weight")
    mtp = build_mtp(s, p, linear, norm) if s.mtp_layers else None
    future = None
    if not cfg.flash:  # register_buffer("future", (T, T) bool)
        future = g.empty((cfg.seq_len, cfg.seq_len), "bool", "buffer future", kind="buffer")
    autocast = autocast_for(cfg.recipe, cfg.precision, cfg.device)
    return Model(cfg, tok, pos, blocks, final, head, future, params, mtp, autocast)


# -- forward --------------------------------------------------------------------------------------


def rms_norm(g: Graph, x: Tensor, w: Tensor) -> Tensor:
    """RMSNorm.forward: x.float(); rsqrt(x32.pow(2).mean(-1) + eps); (x32 * rstd).type_as(x) * w."""
    x32 = aten.to(g, x, "fp32")
    rstd = aten.rsqrt(g, aten.add_scalar(g, aten.mean_last(g, aten.pow2(g, x32))))
    return aten.mul(g, aten.to(g, aten.mul(g, x32, rstd), x.dtype), w)


def norm(g: Graph, x: Tensor, params: list[Tensor], scope: str) -> Tensor:
    with g.scoped(scope):
        return aten.layer_norm(g, x, *params) if len(params) == 2 else rms_norm(g, x, params[0])


def linear(g: Graph, x: Tensor, params: list[Tensor]) -> Tensor:
    return aten.linear(g, x, params[0], params[1] if len(params) == 2 else None)


def dropout(g: Graph, x: Tensor, p: float, scope: str | None = None) -> Tensor:
    with g.scoped(scope or g.scope):
        return aten.native_dropout(g, x) if p > 0 else x


def rope_tables(g: Graph, T: int, hs: int, dtype: str) -> tuple[Tensor, Tensor]:
    """rope_tables: inv_freq (hs/2) and the angles (T, hs) in fp32, then cos and sin in dtype.
    Nothing here needs grad; the temporaries are tiny but counted."""
    half = hs // 2
    a = made(g, (half,), "arange")
    d = made(g, (half,), "div", a)  # arange / head_dim
    del a
    pw = made(g, (half,), "pow", d)  # theta ** (...)
    del d
    r = made(g, (half,), "reciprocal", pw)  # 1.0 / (...): reciprocal, then mul by 1.0
    inv_freq = made(g, (half,), "mul", r)
    del r, pw
    pos = made(g, (T,), "arange")
    angles = made(g, (T, half), "mul", pos, inv_freq)  # torch.outer
    del pos
    angles2 = made(g, (T, hs), "cat", angles)
    del angles
    cos = aten.to(g, made(g, (T, hs), "cos", angles2), dtype)
    sin = aten.to(g, made(g, (T, hs), "sin", angles2), dtype)
    del inv_freq, angles2
    return cos, sin


def made(g: Graph, shape, op: str, *inputs: Tensor, dtype: str = "fp32") -> Tensor:
    """A tensor no gradient flows through, made by one kernel from inputs."""
    t = g.empty(shape, dtype, op)
    g.kernel(op, inputs, (t,))
    return t


def apply_rope(g: Graph, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x * cos + rotate_half(x) * sin; rotate_half = cat(-x2, x1)."""
    return aten.add(g, aten.mul(g, x, cos), aten.mul(g, rotate_half(g, x), sin))


def rotate_half(g: Graph, x: Tensor) -> Tensor:
    x1, x2 = aten.chunk2(g, x)
    return aten.cat_last(g, aten.neg(g, x2), x1)


def repeat_kv(g: Graph, x: Tensor, n_heads: int) -> Tensor:
    """x[:, :, None].expand(B, nkv, groups, T, hs).reshape(B, nh, T, hs): a copy, except for one KV
    head (the size-1 dim merges with the expanded one: a stride-0 view)."""
    B, nkv, T, hs = x.shape
    if nkv == n_heads:
        return x
    x5 = aten.expand(g, aten.view(g, x, (B, nkv, 1, T, hs)), (B, nkv, n_heads // nkv, T, hs))
    return (aten.view if nkv == 1 else aten.reshape_copy)(g, x5, (B, n_heads, T, hs))


def eager_attention(g: Graph, q, k, v, future, p: float) -> Tensor:
    """softmax(QKᵀ/√hs)V with the (B, nh, T, T) scores. matmul reshapes a (B, nh, ...) operand to
    3-D with a copy only where B and nh cannot merge: B > 1 and the operand not contiguous in
    (B, nh) (q always; k and v unless repeat_kv copied them)."""
    B, groups = q.shape[0], q.shape[1] // k.shape[1]
    copied = groups > 1 and k.shape[1] > 1  # repeat_kv made contiguous copies
    k, v = repeat_kv(g, k, q.shape[1]), repeat_kv(g, v, q.shape[1])
    kt = aten.view(g, k, k.shape[:2] + (k.shape[3], k.shape[2]))  # k.transpose(-2, -1)
    att = aten.mul_scalar(g, aten.matmul4(g, q, kt, B > 1, B > 1 and not copied, False))  # (B, nh, T, T)
    att = aten.masked_fill(g, att, future)
    att = aten.softmax(g, att)
    att = dropout(g, att, p)
    # its gradient comes back through the transpose of y: (B, T, nh, hs)-laid, a copy to merge B, nh
    return aten.matmul4(g, att, v, False, B > 1 and not copied, B > 1)  # (B, nh, T, hs)


def core(g: Graph, cfg: Config, q, k, v, future) -> Tensor:
    """Attention.core: what selective recompute rebuilds."""
    with g.scoped("attention core"):
        if cfg.flash:
            return aten.flash_attention(g, q, k, v, cpu=cfg.device == "cpu")
        return eager_attention(g, q, k, v, future, cfg.shape.dropout)


def attention(g: Graph, cfg: Config, b: Block, x, cos, sin, future) -> Tensor:
    with g.scoped("attention"):
        return attention_body(g, cfg, b, x, cos, sin, future)


def attention_body(g: Graph, cfg: Config, b: Block, x, cos, sin, future) -> Tensor:
    s = cfg.shape
    B, T, _ = x.shape
    nh, nkv, hs = s.n_heads, s.n_kv_heads, s.head_dim
    q_copies, k_copies, v_copies = grad_copies(cfg)
    q = aten.view(g, linear(g, x, b.wq), (B, T, nh, hs), grad_copies=q_copies)
    k = aten.view(g, linear(g, x, b.wk), (B, T, nkv, hs), grad_copies=k_copies)
    v = aten.view(g, linear(g, x, b.wv), (B, T, nkv, hs), grad_copies=v_copies)
    if b.q_norm is not None:
        q, k = rms_norm(g, q, b.q_norm), rms_norm(g, k, b.k_norm)
    q, k, v = transpose12(g, q), transpose12(g, k), transpose12(g, v)  # (B, nh|nkv, T, hs)
    if cos is not None:
        q, k = apply_rope(g, q, cos, sin), apply_rope(g, k, cos, sin)
    if cfg.recompute == "selective":
        y = g.checkpoint(lambda q, k, v, future: core(g, cfg, q, k, v, future), q, k, v, future)
    else:
        y = core(g, cfg, q, k, v, future)  # (B, nh, T, hs)
    if cfg.flash:  # the flash output is laid out as q, (B, T, nh, hs): the reshape is a view
        return linear(g, aten.view(g, transpose12(g, y), (B, T, nh * hs)), b.wo)
    return linear(g, aten.reshape_copy(g, transpose12(g, y), (B, T, nh * hs)), b.wo)


def grad_copies(cfg: Config) -> tuple[bool, bool, bool]:
    """Whether the gradient reaching each of the q, k, v views (B, T, n, hs) is non-contiguous, so
    that reshaping it back to (B, T, n·hs) copies. It is laid out as what made it: eager's bmm
    gradients are (B, n, T, hs)-contiguous, and so is RoPE's (its first term is a cat); flash's
    are laid out as q, k, v themselves; kᵀ's bmm gradient transposes back mergeably, unless RoPE,
    repeat_kv or B > 1 intervene. With one head (n = 1) every layout merges: never a copy."""
    s = cfg.shape
    rope, gqa = s.positions == "rope", s.n_kv_heads != s.n_heads
    if cfg.flash:
        q, k, v = rope, rope, False
    else:
        q, k, v = True, rope or gqa or cfg.micro_batch > 1, True
    return q and s.n_heads > 1, k and s.n_kv_heads > 1, v and s.n_kv_heads > 1


def transpose12(g: Graph, x: Tensor) -> Tensor:
    return aten.view(g, x, (x.shape[0], x.shape[2], x.shape[1], x.shape[3]))


def mlp(g: Graph, cfg: Config, b: Block, x: Tensor) -> Tensor:
    act = aten.silu if cfg.shape.activation == "silu" else aten.gelu
    with g.scoped("mlp"):
        if cfg.shape.gated_mlp:  # down(act(gate(x)) * up(x)): SwiGLU, GeGLU
            gate, up, down = b.mlp
            return linear(g, aten.mul(g, act(g, linear(g, x, gate)), linear(g, x, up)), down)
        fc, proj = b.mlp  # proj(act(fc(x))): GPT's gelu
        return linear(g, act(g, linear(g, x, fc)), proj)


def block(g: Graph, cfg: Config, b: Block, x, cos, sin, future, routing=()) -> Tensor:
    if b.latent is not None or b.experts is not None:
        return moe_block(g, cfg, b, x, cos, sin, future, routing)
    p = cfg.shape.dropout
    x = aten.add(g, x, dropout(g, attention(g, cfg, b, norm(g, x, b.norm1, "norm1"), cos, sin, future), p,
                               "attention dropout"))  # fmt: skip
    return aten.add(g, x, dropout(g, mlp(g, cfg, b, norm(g, x, b.norm2, "norm2")), p, "mlp dropout"))


def forward(g: Graph, m: Model, idx: Tensor, targets: Tensor) -> Tensor:
    """recipe.forward: the model, under torch.autocast where the recipe autocasts (verify/autocast.py)."""
    if m.autocast is None:
        return transformer(g, m, idx, targets)
    with m.autocast.region(g):
        return transformer(g, m, idx, targets)


def transformer(g: Graph, m: Model, idx: Tensor, targets: Tensor) -> Tensor:
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
    x = norm(g, x, m.norm, "final norm")
    weight = m.tok_emb if m.lm_head is None else m.lm_head
    with g.scoped("logits"):
        logits = aten.linear(g, x, weight, None, "logits")  # (B, T, V)
    with g.scoped("loss"):
        flat = aten.view(g, targets, (B * T,))
        loss = cross_entropy(g, aten.view(g, aten.to(g, logits, "fp32"), (B * T, s.vocab)), flat)
    if m.mtp is None:
        return loss
    return aten.add(g, loss, aten.mul_scalar(g, mtp_loss(g, m, last, idx, targets, weight, cos, sin, future, routing)))


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


# -- mixture of experts and latent attention (verify/builder.py MoE, LatentAttention) ---------------------


def build_moe_block(s, i: int, n: str, p, linear, norm, expert: str = "{n}mlp.experts.{e}.") -> Block:
    """Block i's parameters when its attention is latent or its MLP a mixture of experts, in registration
    order: norm1, the attention's, norm2, the MLP's (router, each expert, the shared experts). expert: each
    expert's name (its first number is the block a parameter belongs to: memcalc.exact.sim.layer_of)."""
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
    else:  # as build() makes them
        wq, wk = linear(h, s.q_dim, qkv_bias, n + "attn.wq"), linear(h, s.kv_dim, qkv_bias, n + "attn.wk")
        wv, wo = linear(h, s.kv_dim, qkv_bias, n + "attn.wv"), linear(s.q_dim, h, s.linear_bias, n + "attn.wo")
        qn = p((s.head_dim,), n + "attn.q_norm.weight") if s.qk_norm else None
        kn = p((s.head_dim,), n + "attn.k_norm.weight") if s.qk_norm else None
    norm2 = norm(h, n + "norm2")
    mlp, experts = [], None
    if is_moe_layer(s, i):
        gate = linear(h, s.n_experts, False, n + "mlp.gate")[0]
        each = [mlp_params(s, s.routed_ffn, expert.format(n=n, e=e), linear) for e in range(s.n_experts)]
        shared = mlp_params(s, s.shared_ffn, n + "mlp.shared.", linear) if s.n_shared_experts else None
        experts = Experts(gate, each, shared)
    else:
        mlp = mlp_params(s, s.ffn, n + "mlp.", linear)
    return Block(norm1, wq, wk, wv, wo, qn, kn, norm2, mlp, latent, experts)


def mlp_params(s, width: int, n: str, linear) -> list[list[Tensor]]:
    """[gate, up, down] or [fc, proj] of an MLP width wide (verify/builder.py make_mlp)."""
    h, bias = s.hidden, s.linear_bias
    if s.gated_mlp:
        return [linear(h, width, bias, n + "gate"), linear(h, width, bias, n + "up"), linear(width, h, bias, n + "down")]
    return [linear(h, width, bias, n + "fc"), linear(width, h, bias, n + "proj")]


def routing_tables(g: Graph, tokens: int, s) -> tuple[Tensor, Tensor, Tensor]:
    """balanced_routing: arange of the T·k slots, their experts (remainder), the slots expert by expert (a
    transposed reshape: a copy; a stable sort, values and indices, when E does not divide T·k), each such
    slot's token (a floor division). The arange dies on return."""
    E, k = s.n_experts, s.experts_per_token
    with g.scoped("routing tables"):
        slots = made(g, (tokens * k,), "arange", dtype="int64")
        chosen = g.view(made(g, (tokens * k,), "remainder", slots, dtype="int64"), (tokens, k))
        if tokens * k % E == 0:
            order = made(g, (tokens * k,), "clone", slots, dtype="int64")
        else:
            order = g.empty((tokens * k,), "int64", "sort")  # .indices of torch.sort(..., stable=True)
            values = g.empty((tokens * k,), "int64", "sort")
            g.kernel("sort", (chosen,), (values, order))
            del values
        owner = made(g, (tokens * k,), "div", order, dtype="int64")
        del slots
    return chosen, order, owner


def expert_counts(routed: int, n_experts: int) -> list[int]:
    """verify/builder.py expert_counts: expert e has the slots e, e + E, ... below T·k."""
    return [(routed - e + n_experts - 1) // n_experts for e in range(n_experts)]


def moe_block(g: Graph, cfg: Config, b: Block, x, cos, sin, future, routing) -> Tensor:
    """Block.forward with latent attention and/or a mixture of experts (verify/builder.py Block), as block()."""
    p = cfg.shape.dropout
    attend = latent if b.latent is not None else attention
    x = aten.add(g, x, dropout(g, attend(g, cfg, b, norm(g, x, b.norm1, "norm1"), cos, sin, future), p,
                               "attention dropout"))  # fmt: skip
    if b.experts is not None:
        return aten.add(g, x, dropout(g, mixture(g, cfg, b, norm(g, x, b.norm2, "norm2"), routing), p, "mlp dropout"))
    return aten.add(g, x, dropout(g, mlp(g, cfg, b, norm(g, x, b.norm2, "norm2")), p, "mlp dropout"))


def latent(g: Graph, cfg: Config, b: Block, x, cos, sin, future) -> Tensor:
    with g.scoped("attention"):
        return latent_attention(g, cfg, b, x, cos, sin, future)


def router_scores(g: Graph, cfg: Config, x: Tensor, weight: Tensor) -> Tensor:
    """verify/builder.py router_scores: logits (from fp32 copies of x and W for DeepSeek-V3's gate), their fp32
    copy, softmax or sigmoid."""
    s = cfg.shape
    with g.scoped("router"):  # the fp32 copies are temporaries: kept only where the matmul saves them
        if s.router_fp32:
            logits = linear2d(g, aten.to(g, x, "fp32"), aten.to(g, weight, "fp32"), "linear")
        else:
            logits = linear2d(g, x, weight, "linear")
        logits = aten.to(g, logits, "fp32")
        return aten.softmax(g, logits) if s.router == "softmax" else aten.sigmoid(g, logits)


def linear2d(g: Graph, x: Tensor, w: Tensor, kind: str) -> Tensor:
    """F.linear of a 2-D input without bias: matmul(x, w.t()) runs mm directly (no fold)."""
    return aten.mm(g, x, aten.t(g, w), kind)


def mixture(g: Graph, cfg: Config, b: Block, x: Tensor, routing) -> Tensor:
    """MoE.forward line by line (its locals live until it returns, as Python keeps them): route, permute,
    each expert on its tokens, weight, add back, plus the shared experts."""
    s, e = cfg.shape, b.experts
    B, T, h = x.shape
    chosen, order, owner = routing
    with g.scoped("mlp"):
        flat = aten.view(g, x, (B * T, h))
        with g.scoped("router"):
            weights = aten.gather(g, router_scores(g, cfg, flat, e.gate), chosen)  # (T, k) fp32
            if s.norm_topk_prob:
                weights = aten.div(g, weights, aten.sum_keepdim(g, weights))
            n = weights.shape[0] * weights.shape[1]
            weights = aten.index_select(g, aten.view(g, aten.to(g, weights, x.dtype), (n,)), order)
        with g.scoped("dispatch"):
            permuted = aten.index_select(g, flat, owner)  # (T·k, h)
            parts = aten.split(g, permuted, expert_counts(n, s.n_experts), 0)
        with g.scoped("experts"):
            outs = [expert_mlp(g, cfg, w, part) for w, part in zip(e.experts, parts)]
        with g.scoped("combine"):
            y = aten.cat(g, outs, 0)
            del outs  # the list comprehension's list: a temporary
            y = aten.mul(g, y, aten.view(g, weights, (n, 1)))
            out = made(g, (B * T, h), "new_zeros", dtype=x.dtype)
            out = aten.index_add_(g, out, owner, y)
            out = aten.view(g, out, (B, T, h))
        if e.shared is None:
            return out
        with g.scoped("shared experts"):
            return aten.add(g, out, expert_mlp(g, cfg, e.shared, x))


def expert_mlp(g: Graph, cfg: Config, params: list[list[Tensor]], x: Tensor) -> Tensor:
    """An expert's MLP, as mlp() runs the dense one."""
    act = aten.silu if cfg.shape.activation == "silu" else aten.gelu
    if cfg.shape.gated_mlp:
        gate, up, down = params
        return linear(g, aten.mul(g, act(g, linear(g, x, gate)), linear(g, x, up)), down)
    fc, proj = params
    return linear(g, act(g, linear(g, x, fc)), proj)


def latent_attention(g: Graph, cfg: Config, b: Block, x, cos, sin, future) -> Tensor:
    """LatentAttention.forward (verify/builder.py) line by line: its locals live until it returns. The
    gradients reaching the q and kv views come from transposes: copied back to (B, T, H·d) unless one of
    H and T is 1."""
    s, w = cfg.shape, b.latent
    B, T, _ = x.shape
    H, nope, rope, dv = s.n_heads, s.qk_nope_head_dim, s.qk_rope_head_dim, s.v_head_dim
    copies = H > 1 and T > 1
    q = linear(g, rms_norm(g, linear(g, x, w["q_a"]), w["q_a_norm"][0]), w["q_b"]) if s.q_lora_rank else linear(g, x, w["wq"])
    q_pass, q_rot = aten.split(g, transpose12(g, aten.view(g, q, (B, T, H, nope + rope), grad_copies=copies)), [nope, rope], 3)
    k_pass, k_rot = aten.split(g, linear(g, x, w["kv_a"]), [s.kv_lora_rank, rope], 2)
    kv = transpose12(g, aten.view(g, linear(g, rms_norm(g, k_pass, w["kv_a_norm"][0]), w["kv_b"]), (B, T, H, nope + dv),
                                  grad_copies=copies))  # fmt: skip
    k_pass, v = aten.split(g, kv, [nope, dv], 3)
    q_rot, k_rot = apply_rope(g, q_rot, cos, sin), apply_rope(g, aten.view(g, k_rot, (B, 1, T, rope)), cos, sin)
    q = aten.cat_last(g, q_pass, q_rot)  # (B, H, T, d_qk)
    k = aten.cat_last(g, k_pass, aten.expand(g, k_rot, (B, H, T, rope)))
    if cfg.recompute == "selective":
        y = g.checkpoint(lambda q, k, v, future: latent_core(g, cfg, q, k, v, future), q, k, v, future)
    else:
        y = latent_core(g, cfg, q, k, v, future)  # (B, H, T, d_v)
    return linear(g, aten.reshape_copy(g, transpose12(g, y), (B, T, H * dv)), w["wo"])


def latent_core(g: Graph, cfg: Config, q, k, v, future) -> Tensor:
    """LatentAttention.core: eager attention (q and k contiguous from their cats, v a view that merges B and H
    only when B = 1), or the flash kernel on V padded to d_qk, its output cut back to d_v."""
    with g.scoped("attention core"):
        B = q.shape[0]
        if cfg.flash:
            return aten.narrow_last(g, aten.flash_attention(g, q, k, aten.pad_last(g, v, q.shape[3])), v.shape[3])
        kt = aten.view(g, k, k.shape[:2] + (k.shape[3], k.shape[2]))  # eager_attention line by line
        att = aten.mul_scalar(g, aten.matmul4(g, q, kt, False, False, False))
        att = aten.masked_fill(g, att, future)
        att = aten.softmax(g, att)
        att = dropout(g, att, cfg.shape.dropout)
        return aten.matmul4(g, att, v, False, B > 1, B > 1)


# -- multi-token prediction (verify/builder.py MTP, Transformer.mtp_loss) ----------------------------------


def build_mtp(s, p, linear, norm) -> Mtp:
    """The MTP module's parameters, after the output head's. Their names carry no number (sim.layer_of: none):
    the module runs outside the blocks."""
    h = s.hidden
    hnorm, enorm = norm(h, "mtp.hnorm"), norm(h, "mtp.enorm")
    proj = linear(2 * h, h, False, "mtp.proj")
    block = build_moe_block(s, s.n_layers - 1, "mtp.block.", p, linear, norm, "{n}mlp.experts.e{e}.")
    return Mtp(hnorm, enorm, proj, block, norm(h, "mtp.norm"))


def mtp_loss(g: Graph, m: Model, x, idx, targets, weight, cos, sin, future, routing) -> Tensor:
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
