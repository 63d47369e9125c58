"""The layers of verify/builder.py's blocks (they are verify/builder_layers.py's), op by op, in bytes on
memcalc.exact.sim.graph: RMSNorm and LayerNorm, linear, dropout, the rotary tables and RoPE, attention (eager, or
the flash kernel; its core what selective recompute rebuilds) and the MLP (a dense block's, or an expert's).

Each function mirrors the PyTorch code of the same name line by line. Where a reshape copies depends on
memory layout, which the simulator does not track; those places say so (a_copies, b_copies, grad_copies)
with the reason.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .. import aten
from ..aten.float8 import float8_linear
from ..aten.operands import made
from ..aten.te import te_linear
from ..base.config import StepConfig
from ..sim.graph import Graph
from ..sim.tensors import Tensor

if TYPE_CHECKING:  # only for annotations
    from .model import Block


def rms_norm(g: Graph, x: Tensor, w: Tensor) -> Tensor:
    """RMSNorm.forward: x.float(); rsqrt(x32.pow(2).mean(-1) + eps); (x32 * rstd).type_as(x) * w."""
    x32 = aten.to(g, x, "fp32")
    rstd = aten.rsqrt(g, aten.add_scalar(g, aten.mean_last(g, aten.pow2(g, x32))))
    return aten.mul(g, aten.to(g, aten.mul(g, x32, rstd), x.dtype), w)


def norm(g: Graph, x: Tensor, params: list[Tensor], scope: str, cpu: bool = False) -> Tensor:
    """LayerNorm (weight and bias; cpu: on CPU tensors, whose statistics keep the input's dtype) or RMSNorm."""
    with g.scoped(scope):
        return aten.layer_norm(g, x, *params, cpu) if len(params) == 2 else rms_norm(g, x, params[0])


def linear(g: Graph, x: Tensor, params: list[Tensor]) -> Tensor:
    """A block's nn.Linear; under fp8 torchao's Float8Linear where torchtitan's float8 converter swaps it in
    (torchtitan/components/quantization/utils.py module_filter_fn: both dimensions divisible by 16); under
    fp8:te Transformer Engine's te.Linear (memcalc.exact.aten.te)."""
    w, b = params[0], params[1] if len(params) == 2 else None
    if g.fp8 == "te":  # Transformer Engine's te.Linear (llm-foundry's fc_type te): every linear of the blocks
        return te_linear(g, x, w, b)
    if g.fp8 and w.shape[0] % 16 == 0 and w.shape[1] % 16 == 0:
        return float8_linear(g, x, w, b, g.fp8)
    return aten.linear(g, x, w, b)


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


def core(g: Graph, cfg: StepConfig, q, k, v, future) -> Tensor:
    """Attention.core: what selective recompute rebuilds."""
    with g.scoped("attention core"):
        if cfg.flash:
            return aten.flash_attention(g, q, k, v, cpu=cfg.device == "cpu")
        return eager_attention(g, q, k, v, future, cfg.shape.dropout)


def attention(g: Graph, cfg: StepConfig, b: Block, x, cos, sin, future) -> Tensor:
    with g.scoped("attention"):
        return attention_body(g, cfg, b, x, cos, sin, future)


def attention_body(g: Graph, cfg: StepConfig, b: Block, x, cos, sin, future) -> Tensor:
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


def grad_copies(cfg: StepConfig) -> tuple[bool, bool, bool]:
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


def mlp(g: Graph, cfg: StepConfig, b: Block, x: Tensor) -> Tensor:
    with g.scoped("mlp"):
        return mlp_forward(g, cfg, b.mlp, x)


def mlp_forward(g: Graph, cfg: StepConfig, params: list[list[Tensor]], x: Tensor) -> Tensor:
    """SwiGLU.forward and MLP.forward (verify/builder.py) on an MLP's parameters: down(act(gate(x)) * up(x))
    (SwiGLU, GeGLU), or proj(act(fc(x))) (GPT's gelu). The dense block's MLP, and each expert's."""
    act = aten.silu if cfg.shape.activation == "silu" else aten.gelu
    if cfg.shape.gated_mlp:
        gate, up, down = params
        return linear(g, aten.mul(g, act(g, linear(g, x, gate)), linear(g, x, up)), down)
    fc, proj = params
    return linear(g, act(g, linear(g, x, fc)), proj)
