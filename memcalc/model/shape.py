"""The shape of a decoder-only transformer (ModelShape), the model it describes (Model), and the rules a
shape and a sequence keep.

Dense by default; mixture-of-experts MLPs (Shazeer et al. 2017; Mixtral, Jiang et al. 2024; DeepSeek-V3)
and multi-head latent attention (MLA, DeepSeek-V2, Liu et al. 2024) are optional fields whose defaults
leave a dense shape exactly as it was (their rules and which layers are MoE: moe_mla). How many
parameters a shape has: params; the limits on sizes and the parsing of '70B' and '8k': sizes.
"""

from __future__ import annotations

from dataclasses import replace

from memcalc.errors import InputError
from memcalc.records import record

from .moe_mla import check_experts, check_latent, is_moe_layer, moe_layer_count
from .params import (attention_params, expert_params, mlp_params, mlp_params_of, mtp_params, n_params, norm_params,
                     param_counts)  # fmt: skip
from .sizes import BINARY, DECIMAL, MAX_BATCH, MAX_SEQ, MAX_SIZE, check_size, parse_count, parse_seq

# Names moved to sizes, moe_mla and params, still imported from here by memcalc.cli, engine, parallel and report.
__all__ = [
    "ACTIVATIONS", "NORMS", "NORM_LAYOUTS", "POSITIONS", "QK_NORMS", "Model", "ModelShape", "check_positions", "longest_seq", "override",
    "BINARY", "DECIMAL", "MAX_BATCH", "MAX_SEQ", "MAX_SIZE", "check_size", "parse_count", "parse_seq",
    "is_moe_layer", "moe_layer_count",
    "attention_params", "expert_params", "mlp_params", "mlp_params_of", "mtp_params", "n_params", "norm_params",
    "param_counts",
]  # fmt: skip

NORMS = ("layernorm", "rmsnorm")
NORM_LAYOUTS = ("pre", "sandwich", "post")  # where a block's norms stand: see ModelShape.norm_layout
QK_NORMS = ("head", "all")
ACTIVATIONS = ("silu", "gelu")  # gelu: the tanh approximation GPT-2 and Gemma use
POSITIONS = ("learned", "rope", "none")


@record(frozen=True)
class ModelShape:
    """A decoder stack. Unset derived sizes (None) take the usual default in __post_init__."""

    n_layers: int
    hidden: int
    n_heads: int
    n_kv_heads: int | None = None  # None: n_heads (multi-head attention); fewer: GQA
    head_dim: int | None = None  # None: hidden // n_heads
    ffn: int | None = None  # None: 4 * hidden, the GPT-2/3 MLP
    gated_mlp: bool = False  # act(x W_gate) * (x W_up), then W_down: SwiGLU, GeGLU (Shazeer 2020)
    activation: str | None = None  # None: silu for a gated MLP (SwiGLU), gelu for a plain one (GPT)
    norm: str = "layernorm"  # layernorm: weight + bias; rmsnorm: weight only
    vocab: int = 50257
    tied_embeddings: bool = True  # the output projection reuses the token embedding
    dropout: float = 0.0  # on attention probabilities and both residual branches
    linear_bias: bool = False  # GPT-2/3: every linear layer has a bias
    qkv_bias: bool = False  # Qwen2: biases on the q, k, v projections only
    qk_norm: bool = False  # Qwen3: RMSNorm over each head of q and k
    positions: str = "none"  # learned: a position table of max_positions rows; rope: rotary, no parameters
    max_positions: int = 0  # rows of the learned position table
    name: str = "custom"
    # Mixture of experts: a MoE layer's MLP is a router and n_experts expert MLPs, each token sent to
    # experts_per_token of them (top-k), plus n_shared_experts every token goes through. 0 experts: dense.
    n_experts: int = 0  # routed experts per MoE layer (Mixtral num_local_experts, Qwen3-MoE num_experts)
    experts_per_token: int = 0  # top-k (num_experts_per_tok)
    expert_ffn: int | None = None  # one routed expert's MLP width (moe_intermediate_size); None: ffn (Mixtral)
    n_shared_experts: int = 0  # DeepSeek-V3: 1
    shared_expert_ffn: int | None = None  # one shared expert's width; None: expert_ffn
    first_dense_layers: int = 0  # the first k layers keep the dense MLP (DeepSeek first_k_dense_replace)
    moe_every: int = 1  # layer i is MoE when i % moe_every == moe_offset (Qwen3-MoE decoder_sparse_step,
    moe_offset: int = 0  # DeepSeek moe_layer_freq); Qwen3-MoE's (i + 1) % step == 0 is offset step - 1
    dense_layers: tuple[int, ...] = ()  # further layers with the dense MLP (Qwen3-MoE mlp_only_layers)
    router: str = "softmax"  # how router logits become scores: softmax (in fp32) or sigmoid (DeepSeek-V3)
    router_fp32: bool = False  # the router's matmul on fp32 copies of x and W (DeepSeek-V3's gate)
    norm_topk_prob: bool = False  # the k chosen weights divided by their sum (Mixtral always; Qwen3 by config)
    # Multi-head latent attention: K and V decompressed per head from a kv_lora_rank latent (and Q from a
    # q_lora_rank one); kv_lora_rank 0 is ordinary attention. head_dim is then qk_nope + qk_rope.
    q_lora_rank: int = 0  # 0: queries from a full W_q (DeepSeek-V2-Lite); V3: 1536
    kv_lora_rank: int = 0
    qk_rope_head_dim: int = 0  # the rotary part of each q/k head; its k part is shared by all heads
    qk_nope_head_dim: int = 0  # the part without positions
    v_head_dim: int = 0
    mtp_layers: int = 0  # multi-token prediction modules after the stack (DeepSeek-V3 num_nextn_predict_layers)
    # The Transformers families (memcalc.model.hfconfig): how a block is wired and what attention sees.
    arch: str = ""  # the Transformers model_type whose modeling file builds it ("": inferred, memcalc.exact.hf.model)
    norm_layout: str = "pre"  # pre: x + f(norm(x)) (Llama); sandwich: x + norm(f(norm(x))) (Gemma 2/3);
    #                          post: x + norm(f(x)) (OLMo 2)
    qk_norm_over: str = "head"  # the q/k norm over each head (Qwen3, Gemma 3) or the whole projection (OLMo 2)
    parallel_residual: bool = False  # x + attn(norm1(x)) + mlp(norm2(x)) (GPT-NeoX use_parallel_residual)
    rotary_fraction: float = 1.0  # the share of each head RoPE rotates (GPT-NeoX rotary_pct 0.25)
    attn_softcap: float = 0.0  # scores -> cap * tanh(scores / cap) before the softmax (Gemma 2: 50)
    logit_softcap: float = 0.0  # the same on the logits (Gemma 2: 30)
    sliding_window: int = 0  # each query sees the last sliding_window keys (Mistral 4096); 0: all of them
    global_layers: tuple[int, ...] = ()  # under a window, the layers that still see every key (Gemma 2: odd)

    def __post_init__(self) -> None:
        for field in ("n_layers", "hidden", "n_heads", "vocab"):
            check_size(field, getattr(self, field))
        if self.n_kv_heads is None:
            object.__setattr__(self, "n_kv_heads", self.n_heads)
        if self.head_dim is None:
            mla = self.qk_nope_head_dim + self.qk_rope_head_dim if self.kv_lora_rank else 0
            object.__setattr__(self, "head_dim", mla or self.hidden // self.n_heads)
        if self.ffn is None:
            object.__setattr__(self, "ffn", 4 * self.hidden)
        if self.activation is None:
            object.__setattr__(self, "activation", "silu" if self.gated_mlp else "gelu")
        if self.activation not in ACTIVATIONS:
            raise InputError(f"unknown activation {self.activation!r}; known: {', '.join(ACTIVATIONS)}")
        for field in ("n_kv_heads", "head_dim", "ffn"):
            check_size(field, getattr(self, field))
        check_size("max_positions", self.max_positions, allow_zero=True)
        if self.hidden % self.n_heads:
            raise InputError(f"heads ({self.n_heads}) must divide hidden ({self.hidden})")
        if self.n_heads % self.n_kv_heads:
            raise InputError(f"kv heads ({self.n_kv_heads}) must divide heads ({self.n_heads})")
        if self.norm not in NORMS:
            raise InputError(f"unknown norm {self.norm!r}; known: {', '.join(NORMS)}")
        if self.positions not in POSITIONS:
            raise InputError(f"unknown positions {self.positions!r}; known: {', '.join(POSITIONS)}")
        if self.positions == "learned" and not self.max_positions:
            raise InputError("a learned position table needs its length: max_positions (n_positions) of at least 1")
        check_experts(self)
        check_latent(self)
        if self.positions == "rope" and not self.kv_lora_rank and self.head_dim % 2:  # RoPE rotates pairs
            raise InputError(f"rotary positions (RoPE) need an even head_dim: they rotate pairs of dimensions; "
                             f"got head_dim {self.head_dim} (hidden {self.hidden}, {self.n_heads} heads)")  # fmt: skip
        if not 0.0 <= self.dropout < 1.0:
            raise InputError(f"dropout must be in [0, 1), got {self.dropout}")
        check_wiring(self)

    @property
    def norms_per_layer(self) -> int:
        """Norms over hidden in one block: two, four in the sandwich (Gemma 2/3's pre- and post-norms)."""
        return 4 if self.norm_layout == "sandwich" else 2

    @property
    def qk_norm_widths(self) -> tuple[int, int]:
        """The q and k norms' weight lengths: head_dim each (per head), or the projections' widths (OLMo 2)."""
        if not self.qk_norm:
            return (0, 0)
        return (self.q_dim, self.kv_dim) if self.qk_norm_over == "all" else (self.head_dim, self.head_dim)

    def window_at(self, layer: int) -> int:
        """Layer's sliding window, 0 where it sees every key."""
        return 0 if layer in self.global_layers else self.sliding_window

    @property
    def is_moe(self) -> bool:
        return self.n_experts > 0

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def routed_ffn(self) -> int:
        """One routed expert's MLP width."""
        return self.ffn if self.expert_ffn is None else self.expert_ffn

    @property
    def shared_ffn(self) -> int:
        """The shared experts' MLP width, all together (DeepSeek runs them as one MLP)."""
        return self.n_shared_experts * (self.routed_ffn if self.shared_expert_ffn is None else self.shared_expert_ffn)

    @property
    def rope_dim(self) -> int:
        """The dimensions RoPE rotates in each q/k head: int(head_dim * rotary_fraction) (all of it but for
        GPT-NeoX's rotary_ndims and Phi's partial_rotary_factor), or MLA's qk_rope_head_dim; head_dim itself
        when whole (an exact term's formula keeps its symbol)."""
        if self.kv_lora_rank:
            return self.qk_rope_head_dim
        return self.head_dim if self.rotary_fraction == 1 else int(self.head_dim * self.rotary_fraction)

    @property
    def v_dim(self) -> int:
        """Width of one value head: v_head_dim under MLA, else head_dim."""
        return self.v_head_dim if self.kv_lora_rank else self.head_dim

    @property
    def q_dim(self) -> int:
        """Width of the concatenated query heads (equals hidden unless head_dim is set apart)."""
        return self.n_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        """Width of the concatenated key (or value) heads: smaller than q_dim under GQA."""
        return self.n_kv_heads * self.head_dim

    @property
    def mlp_name(self) -> str:
        """'SwiGLU', 'GeGLU' or 'GELU MLP': what the MLP is called in print."""
        if self.gated_mlp:
            return {"silu": "SwiGLU", "gelu": "GeGLU"}[self.activation]
        return {"silu": "SiLU MLP", "gelu": "GELU MLP"}[self.activation]

    @property
    def family(self) -> str:
        """'llama' for a gated-MLP RMSNorm stack, 'gpt' for the textbook GPT-2/3 layer; 'moe' (with latent
        attention 'moe+mla') where MLPs are mixtures of experts; a Transformers family's own model_type
        (gemma2, olmo2, gpt_neox...) where its block is wired otherwise than Llama's or GPT-2's."""
        if self.is_moe:
            return "moe+mla" if self.is_mla else "moe"
        if self.arch not in ("", "llama", "mistral", "qwen2", "qwen3", "gpt2"):
            return self.arch
        return "llama" if self.gated_mlp else "gpt"


def check_wiring(shape: ModelShape) -> None:
    """The Transformers families' fields (norm layout, q/k norm, parallel residual, partial rotary, softcaps,
    sliding window) keep their own rules."""
    if shape.norm_layout not in NORM_LAYOUTS:
        raise InputError(f"unknown norm layout {shape.norm_layout!r}; known: {', '.join(NORM_LAYOUTS)}")
    if shape.qk_norm_over not in QK_NORMS:
        raise InputError(f"unknown q/k norm {shape.qk_norm_over!r}; known: {', '.join(QK_NORMS)}")
    if shape.parallel_residual and shape.norm_layout != "pre":
        raise InputError("a parallel residual (GPT-NeoX) takes pre-norms: norm_layout must be pre")
    if not 0.0 < shape.rotary_fraction <= 1.0:
        raise InputError(f"rotary_fraction must be in (0, 1], got {shape.rotary_fraction}")
    if shape.rotary_fraction < 1.0 and (shape.positions != "rope" or shape.rope_dim < 2 or shape.rope_dim % 2):
        raise InputError(f"partial rotary positions need rope and an even number of rotated dimensions, got "
                         f"{shape.rope_dim} of head_dim {shape.head_dim}")  # fmt: skip
    for name in ("attn_softcap", "logit_softcap"):
        if getattr(shape, name) < 0:
            raise InputError(f"{name} must be 0 (none) or positive, got {getattr(shape, name)}")
    check_size("sliding_window", shape.sliding_window, allow_zero=True)
    if shape.global_layers and not shape.sliding_window:
        raise InputError("global_layers name the layers without a sliding window: give sliding_window too")
    if any(i < 0 for i in shape.global_layers) or len(set(shape.global_layers)) < len(shape.global_layers):
        raise InputError("global_layers must be distinct layer indices")  # (a shallower copy keeps them all)
    if shape.is_mla and (shape.sliding_window or shape.qk_norm_over != "head" or shape.rotary_fraction < 1.0):
        raise InputError("latent attention with a sliding window, whole-projection q/k norms or partial rotary "
                         "positions is not modelled")  # fmt: skip


def longest_seq(shape: ModelShape) -> int:
    """The longest sequence the model can embed: its learned position table's rows (GPT-2: 1,024), else
    no limit of its own (rotary positions extrapolate, if not well)."""
    return shape.max_positions if shape.positions == "learned" else MAX_SEQ


def check_positions(shape: ModelShape, seq_len: int) -> None:
    """The one rule for every command: a sequence longer than the position table cannot be trained."""
    if seq_len > longest_seq(shape):
        raise InputError(f"seq {seq_len:,} exceeds the {shape.max_positions:,} rows of {shape.name}'s learned "
                         f"position table: give --seq {shape.max_positions} or less")  # fmt: skip


@record(frozen=True)
class Model:
    """A shape and the parameter count model state is charged for.

    With --params N the shape comes from a table and N is used as given, so n_params
    may differ from the shape's own count; everywhere else the two are equal.
    """

    shape: ModelShape
    n_params: int
    origin: str  # how the shape was chosen, printed with every estimate

    def __post_init__(self) -> None:
        if self.n_params <= 0:
            raise InputError(f"parameter count must be positive, got {self.n_params}")


def override(shape: ModelShape, **sizes: int | None) -> ModelShape:
    """Apply --layers --hidden --heads --kv-heads --ffn --vocab on top of a shape.

    head_dim follows hidden/heads when it was hidden // n_heads before; KV heads follow the
    head count when the shape was multi-head. Everything else stays as the shape had it.
    """
    given = {k: v for k, v in sizes.items() if v is not None}
    if not given:
        return shape
    changes = dict(given)
    if ("hidden" in given or "n_heads" in given) and shape.head_dim == shape.hidden // shape.n_heads and not shape.is_mla:
        changes["head_dim"] = None
    if "n_heads" in given and "n_kv_heads" not in given and shape.n_kv_heads == shape.n_heads:
        changes["n_kv_heads"] = None
    if "hidden" in given and "ffn" not in given and shape.ffn == 4 * shape.hidden and not shape.gated_mlp:
        changes["ffn"] = None
    return replace(shape, name=f"{shape.name} (modified)", **changes)

