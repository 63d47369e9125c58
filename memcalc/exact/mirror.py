"""verify/builder.py's model and verify/recipes.py's training step, run in bytes on memcalc.exact.sim.

Each function mirrors the PyTorch code of the same name line by line, so that Python keeps the
same temporaries alive for the same time. Where a reshape copies depends on memory layout, which
the simulator does not track; those places say so (a_copies, b_copies, grad_copies) with the reason.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from memcalc.model.shape import ModelShape

from . import aten
from .sim import Graph, Kernel, Memory, Tensor


@dataclass(frozen=True)
class Config:
    """What decides the bytes of a training step."""

    shape: ModelShape
    seq_len: int
    micro_batch: int
    precision: str  # fp32 | bf16 | fp16
    flash: bool  # attention by the flash kernel (aten._scaled_dot_product_flash_attention)
    recompute: str  # none | selective | full
    grad_accum: int = 1  # micro-batches per optimizer step

    @property
    def dtype(self) -> str:
        """The parameters' and activations' dtype: the precision's name is the sim's dtype name."""
        return self.precision


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


# -- build ----------------------------------------------------------------------------------------


def build(g: Graph, cfg: Config) -> Model:
    """The parameters in the order nn.Module registers them, and the buffers."""
    s, dt, params = cfg.shape, cfg.dtype, []

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
    return Model(cfg, tok, pos, blocks, final, head, future, params)


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
            return aten.flash_attention(g, q, k, v)
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
    future = m.future
    for i, b in enumerate(m.blocks):
        g.layer = i
        if cfg.recompute == "full":
            x = g.checkpoint(lambda x, cos, sin, future, b=b: block(g, cfg, b, x, cos, sin, future),
                             x, cos, sin, future)  # fmt: skip
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


def cross_entropy(g: Graph, logits: Tensor, targets: Tensor) -> Tensor:
    """F.cross_entropy: log_softmax, then nll_loss (mean)."""
    return aten.nll_loss(g, aten.log_softmax(g, logits), targets)


# -- the training step ----------------------------------------------------------------------------


class Recipe:
    """verify/recipes.py's Recipe: fp32 master weights (16-bit recipes), AdamW m and v made at the
    first step, and GradScaler's scale and growth tracker for fp16."""

    def __init__(self, g: Graph, m: Model):
        self.g, self.model, self.precision = g, m, m.cfg.precision
        self.params = m.params
        if self.precision == "fp32":
            self.masters = self.params
        else:  # p.detach().float()
            self.masters = [g.empty(p.shape, "fp32", "_to_copy", kind="state") for p in self.params]
        self.m: list[Tensor | None] = [None] * len(self.params)
        self.v: list[Tensor | None] = [None] * len(self.params)
        self.scale = self.growth = None
        if self.precision == "fp16":
            self.scale = g.empty((), "fp32", "full", kind="state")
            self.growth = g.empty((), "int32", "zeros", kind="state")

    def backward(self, loss: Tensor) -> None:
        if self.scale is None:
            self.g.backward(loss)
        else:  # (loss * scale).backward()
            scaled = aten.mul(self.g, loss, self.scale)
            self.g.backward(scaled)
            del scaled

    def update(self) -> None:
        """Per parameter tensor: its grad to fp32 (the 16-bit grad released), AdamW (one temporary,
        the denominator), the fp32 grad released, the master copied back in place. Each kernel is
        recorded against the parameter's layer (recipes.adamw_ line by line)."""
        g = self.g
        g.stage = "optimizer"
        found_inf = inv_scale = None
        if self.scale is not None:
            found_inf = made(g, (), "zeros")
            inv_scale = made(g, (), "reciprocal", self.scale)
            one = made(g, (), "ones")
            self.check_finite(found_inf)
            g.kernel("_amp_update_scale_", (self.scale, self.growth, found_inf), (self.scale, self.growth))
            del one
        for i, (p, w) in enumerate(zip(self.params, self.masters)):
            g.layer = layer_of(p.name)
            if self.precision == "fp32":
                grad = p.grad
            else:  # p.grad.float()
                grad = g.empty(p.shape, "fp32", "_to_copy")
                g.kernel("_to_copy", (p.grad,), (grad,))
            p.grad = None
            if inv_scale is not None:
                g.kernel("mul_", (grad, inv_scale), (grad,))
            if self.m[i] is None:  # made at the first step only
                self.m[i] = g.empty(w.shape, "fp32", "zeros_like", kind="state")
                self.v[i] = g.empty(w.shape, "fp32", "zeros_like", kind="state")
            m, v = self.m[i], self.v[i]
            g.kernel("mul_", (w,), (w,))  # decoupled weight decay
            g.kernel("lerp_", (m, grad), (m,))
            g.kernel("mul_", (v,), (v,))
            g.kernel("addcmul_", (v, grad), (v,))  # g·g: one operand read once
            denom = g.empty(w.shape, "fp32", "sqrt")  # v.sqrt().div_(...).add_(eps)
            g.kernel("sqrt", (v,), (denom,))
            g.kernel("div_", (denom,), (denom,))
            g.kernel("add_", (denom,), (denom,))
            g.kernel("addcdiv_", (w, m, denom), (w,))
            if w is not p:
                g.kernel("copy_", (w,), (p,))  # the new 16-bit weights
            del denom, grad, m, v
        del found_inf, inv_scale
        g.layer, g.stage = None, "forward"

    def check_finite(self, found_inf: Tensor) -> None:
        """_amp_foreach_non_finite_check_and_unscale_: one foreach kernel over every 16-bit gradient,
        recorded per layer (the grads of one block, then those outside) so that layers scale."""
        layers: dict[int | None, list] = {}
        for p in self.params:
            layers.setdefault(layer_of(p.name), []).append(p.grad)
        for layer, grads in layers.items():
            self.g.layer = layer
            self.g.kernel("_amp_foreach_non_finite_check_and_unscale_", tuple(grads), (found_inf,))
        self.g.layer = None


def layer_of(name: str) -> int | None:
    """The block a parameter belongs to, from its name (blocks.3.attn.wq.weight -> 3)."""
    return int(name.split(".")[1]) if name.startswith("blocks.") else None


@dataclass(frozen=True)
class Phases:
    """Bytes of one steady-state training step (the second), as verify measures them. Peaks are
    of everything live on the device: weights, buffers, inputs, optimizer state, activations; with
    gradient accumulation, forward and backward are its last micro-batch's (grads already exist)."""

    weights_bytes: int  # parameters and buffers, after build
    inputs_bytes: int  # token ids and targets
    state_bytes: int  # live between steps, less the inputs: weights, buffers, master, m, v (+ scaler)
    retained_bytes: int  # what forward leaves alive: saved tensors (and checkpoint inputs) and the loss
    grads_bytes: int  # what backward leaves alive above the state (the loss released): the gradients
    forward_peak_bytes: int
    backward_peak_bytes: int
    optimizer_peak_bytes: int
    forward_peak_at: str  # the op at which the peak was reached
    backward_peak_at: str
    optimizer_peak_at: str

    @property
    def step_peak_bytes(self) -> int:
        return max(self.forward_peak_bytes, self.backward_peak_bytes, self.optimizer_peak_bytes)


def micro_step(g: Graph, model: Model, recipe: Recipe, idx: Tensor, targets: Tensor, grad_accum: int) -> None:
    """grad_accum forward-backward passes (grads add up in place), then the optimizer step."""
    for _ in range(grad_accum):
        loss = forward(g, model, idx, targets)
        recipe.backward(loss)
        del loss
    recipe.update()


def trace(cfg: Config) -> list[Kernel]:
    """The kernels of one steady-state training step: one micro-batch's forward and backward (and
    checkpoint recompute), what each further micro-batch adds into the gradients (AccumulateGrad's
    in-place add, phase "accumulate"), and the optimizer step. One step, no warm-up: a first step
    runs the same kernels as any other, except making AdamW's m and v, which is not a kernel here."""
    g = Graph(Memory())
    g.kernels = []
    model = build(g, cfg)
    B, T = cfg.micro_batch, cfg.seq_len
    idx = g.empty((B, T), "int64", "input", kind="input")
    targets = g.empty((B, T), "int64", "input", kind="input")
    recipe = Recipe(g, model)
    loss = forward(g, model, idx, targets)
    recipe.backward(loss)
    del loss
    g.stage = "accumulate"
    for p in model.params:  # a later micro-batch's gradient, added into this one
        if p.grad is not None:
            g.layer = layer_of(p.name)
            g.accumulate(p)
    g.layer = None
    recipe.update()
    return g.kernels


def replayed(grad_accum: int) -> int:
    """How many of a step's micro-batches must be simulated: the first, whose gradients AccumulateGrad
    steals into .grad, and one later one, which adds its gradients into them in place. Every later
    micro-batch starts from the same live bytes and allocates and frees the same tensors in the same
    order (nothing marks the last one), so the second stands for the middle ones and the last."""
    return min(grad_accum, 2)


def simulate(cfg: Config, timeline: bool = False, every_micro_batch: bool = False) -> tuple[Phases, Graph, Memory]:
    """Build, one warm-up step, then the measured step (its last micro-batch's phases; the saved
    terms, rebuilt bytes and FLOPs of its first). Each step simulates replayed(grad_accum)
    micro-batches, equal to the byte to replaying all of them (every_micro_batch, or a timeline,
    which records every allocation, replays all), so the time does not grow with grad_accum."""
    micro_batches = cfg.grad_accum if timeline or every_micro_batch else replayed(cfg.grad_accum)
    mem = Memory(timeline=[] if timeline else None)
    g = Graph(mem)
    model = build(g, cfg)
    weights = mem.live_bytes
    B, T = cfg.micro_batch, cfg.seq_len
    idx = g.empty((B, T), "int64", "input", kind="input")
    targets = g.empty((B, T), "int64", "input", kind="input")
    inputs = mem.live_bytes - weights
    recipe = Recipe(g, model)
    micro_step(g, model, recipe, idx, targets, micro_batches)
    before = mem.live_bytes
    peaks = {}
    for k in range(micro_batches):
        mem.phase = "forward"
        mem.reset_peak()
        if k == 0:
            g.record_saves()
            g.flops, g.rebuilt_bytes = {}, 0
        loss = forward(g, model, idx, targets)
        if k == 0:
            terms, g.saved_terms = g.saved_terms, None
            retained = mem.live_bytes - before
        peaks["forward"] = (mem.peak_bytes, mem.peak_at)
        mem.phase = "backward"
        mem.reset_peak()
        recipe.backward(loss)
        del loss
        peaks["backward"] = (mem.peak_bytes, mem.peak_at)
        if k == 0:
            flops, rebuilt = dict(g.flops), g.rebuilt_bytes
    grads = mem.live_bytes - before
    mem.phase = "optimizer"
    mem.reset_peak()
    recipe.update()
    peaks["optimizer"] = (mem.peak_bytes, mem.peak_at)
    mem.phase = ""
    g.saved_terms, g.flops, g.rebuilt_bytes = terms, flops, rebuilt
    (fp, fa), (bp, ba), (op, oa) = peaks["forward"], peaks["backward"], peaks["optimizer"]
    phases = Phases(weights, inputs, before - inputs, retained, grads, fp, bp, op, fa, ba, oa)
    return phases, g, mem
