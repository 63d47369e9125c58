"""verify/builder.py's model, op by op, in bytes on memcalc.exact.sim: its parameters as nn.Module
registers them, and its forward pass.

Each function mirrors the PyTorch code of the same name line by line, so that Python keeps the
same temporaries alive for the same time. Where a reshape copies depends on memory layout, which
the simulator does not track; those places say so (a_copies, b_copies, grad_copies) with the reason.
"""

from __future__ import annotations

from dataclasses import dataclass, field

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
    future = None
    if not cfg.flash:  # register_buffer("future", (T, T) bool)
        future = g.empty((cfg.seq_len, cfg.seq_len), "bool", "buffer future", kind="buffer")
    autocast = autocast_for(cfg.recipe, cfg.precision, cfg.device)
    return Model(cfg, tok, pos, blocks, final, head, future, params, autocast)


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


def block(g: Graph, cfg: Config, b: Block, x, cos, sin, future) -> Tensor:
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
            cos, sin = rope_tables(g, T, s.head_dim, x.dtype)
    future, tricks = m.future, cfg.tricks
    policy = torchtitan_policy if cfg.recompute == "op" else None
    for i, b in enumerate(m.blocks):
        g.layer = i
        if tricks.checkpointed(i):  # ckpt, ckpt:N (every Nth block), sac (each block, with its policy)
            x = g.checkpoint(lambda x, cos, sin, future, b=b: block(g, cfg, b, x, cos, sin, future),
                             x, cos, sin, future, policy=policy)  # fmt: skip
        else:
            x = block(g, cfg, b, x, cos, sin, future)
    g.layer = None
    x = norm(g, x, m.norm, "final norm")
    weight = m.tok_emb if m.lm_head is None else m.lm_head
    with g.scoped("logits"):
        logits = aten.linear(g, x, weight, None, "logits")  # (B, T, V)
    with g.scoped("loss"):
        flat = aten.view(g, targets, (B * T,))
        return cross_entropy(g, aten.view(g, aten.to(g, logits, "fp32"), (B * T, s.vocab)), flat)


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
