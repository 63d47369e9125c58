"""The shape of a decoder-only transformer, and how many parameters it has.

Dense by default; mixture-of-experts MLPs (Shazeer et al. 2017; Mixtral, Jiang et al. 2024; DeepSeek-V3)
and multi-head latent attention (MLA, DeepSeek-V2, Liu et al. 2024) are optional fields whose defaults
leave a dense shape exactly as it was.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from functools import lru_cache

from memcalc.errors import InputError
from memcalc.model.jsonfile import MAX_DIGITS, brief

NORMS = ("layernorm", "rmsnorm")
ACTIVATIONS = ("silu", "gelu")  # gelu: the tanh approximation GPT-2 and Gemma use
POSITIONS = ("learned", "rope", "none")
ROUTERS = ("softmax", "sigmoid")  # softmax over the experts (Mixtral, Qwen3-MoE); sigmoid scores (DeepSeek-V3)
MAX_SIZE = 1 << 24  # no real layer, head count, width or vocabulary comes near 16.7 million
MAX_SEQ = 1 << 27  # 134M tokens: beyond any context trained
MAX_BATCH = 1 << 20


@dataclass(frozen=True)
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
        """The dimensions RoPE rotates in each q/k head: all of head_dim, or MLA's qk_rope_head_dim."""
        return self.qk_rope_head_dim if self.kv_lora_rank else self.head_dim

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
        attention 'moe+mla') where MLPs are mixtures of experts."""
        if self.is_moe:
            return "moe+mla" if self.is_mla else "moe"
        return "llama" if self.gated_mlp else "gpt"


def check_size(name: str, value: int, allow_zero: bool = False, limit: int = MAX_SIZE) -> None:
    """Reject sizes that are not whole numbers in (0, limit]."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise InputError(f"{name} must be a whole number, got {value!r}")
    if value < 0 or (value == 0 and not allow_zero):
        raise InputError(f"{name} must be positive, got {value}")
    if value > limit:
        raise InputError(f"{name} = {value} is absurdly large (limit {limit:,})")


def check_experts(shape: ModelShape) -> None:
    """The mixture-of-experts fields agree with each other (one InputError line if not)."""
    for field in ("n_experts", "experts_per_token", "n_shared_experts", "first_dense_layers", "moe_offset",
                  "mtp_layers"):  # fmt: skip
        check_size(field, getattr(shape, field), allow_zero=True)
    check_size("moe_every", shape.moe_every)
    for field in ("expert_ffn", "shared_expert_ffn"):
        if getattr(shape, field) is not None:
            check_size(field, getattr(shape, field))
    if not isinstance(shape.dense_layers, tuple):
        raise InputError(f"dense_layers must be a tuple of layer indices, got {shape.dense_layers!r}")
    for i in shape.dense_layers:
        check_size("a dense layer index", i, allow_zero=True)
    if shape.router not in ROUTERS:
        raise InputError(f"unknown router {shape.router!r}; known: {', '.join(ROUTERS)}")
    if not shape.n_experts:
        if shape.experts_per_token or shape.n_shared_experts:
            raise InputError("experts per token and shared experts need routed experts: n_experts is 0")
        return
    if not 1 <= shape.experts_per_token <= shape.n_experts:
        raise InputError(f"experts per token ({shape.experts_per_token}) must be between 1 and the "
                         f"{shape.n_experts} routed experts")  # fmt: skip
    if shape.moe_offset >= shape.moe_every:
        raise InputError(f"moe_offset ({shape.moe_offset}) must be below moe_every ({shape.moe_every})")


def check_latent(shape: ModelShape) -> None:
    """Multi-head latent attention's fields agree with each other (one InputError line if not)."""
    fields = ("q_lora_rank", "kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim")
    for field in fields:
        check_size(field, getattr(shape, field), allow_zero=True)
    if not shape.kv_lora_rank:
        given = [f for f in fields if getattr(shape, f)]
        if given:
            raise InputError(f"{', '.join(given)} describe latent attention (MLA), which needs kv_lora_rank > 0")
        return
    if not shape.qk_rope_head_dim or shape.qk_rope_head_dim % 2:
        raise InputError(f"latent attention needs an even qk_rope_head_dim (RoPE rotates pairs), got "
                         f"{shape.qk_rope_head_dim}")  # fmt: skip
    if not shape.v_head_dim:
        raise InputError("latent attention needs v_head_dim > 0")
    if shape.head_dim != shape.qk_nope_head_dim + shape.qk_rope_head_dim:
        raise InputError(f"under latent attention head_dim is qk_nope_head_dim + qk_rope_head_dim = "
                         f"{shape.qk_nope_head_dim + shape.qk_rope_head_dim}, got {shape.head_dim}")  # fmt: skip
    if shape.n_kv_heads != shape.n_heads:
        raise InputError(f"latent attention decompresses K and V for every head: kv heads ({shape.n_kv_heads}) "
                         f"must equal heads ({shape.n_heads})")  # fmt: skip
    if shape.linear_bias or shape.qkv_bias or shape.qk_norm:
        raise InputError("latent attention with biases or q/k norms is not modelled")
    if shape.positions != "rope":
        raise InputError("latent attention carries its positions in the rotary part: positions must be rope")


def is_moe_layer(shape: ModelShape, i: int) -> bool:
    """Whether layer i's MLP is a mixture of experts (modeling_deepseek_v3.py: layer_idx >= first_k_dense_replace;
    modeling_qwen3_moe.py: (layer_idx + 1) % decoder_sparse_step == 0 and not in mlp_only_layers)."""
    return (shape.n_experts > 0 and i >= shape.first_dense_layers and i % shape.moe_every == shape.moe_offset
            and i not in shape.dense_layers)  # fmt: skip


@lru_cache(maxsize=1024)
def moe_layer_count(shape: ModelShape) -> int:
    if not shape.n_experts:  # a dense model: asked for by every layout the planner builds
        return 0
    return sum(is_moe_layer(shape, i) for i in range(shape.n_layers))


def longest_seq(shape: ModelShape) -> int:
    """The longest sequence the model can embed: its learned position table's rows (GPT-2: 1,024), else
    no limit of its own (rotary positions extrapolate, if not well)."""
    return shape.max_positions if shape.positions == "learned" else MAX_SEQ


def check_positions(shape: ModelShape, seq_len: int) -> None:
    """The one rule for every command: a sequence longer than the position table cannot be trained."""
    if seq_len > longest_seq(shape):
        raise InputError(f"seq {seq_len:,} exceeds the {shape.max_positions:,} rows of {shape.name}'s learned "
                         f"position table: give --seq {shape.max_positions} or less")  # fmt: skip


@dataclass(frozen=True, slots=True)
class ParamCounts:
    """Parameters by place in the model; the total is their sum."""

    embedding: int  # token table (+ learned position table)
    per_layer: int  # a layer with the dense MLP
    n_layers: int
    final_norm: int
    lm_head: int  # 0 when tied to the token table
    per_moe_layer: int = 0  # a layer whose MLP is the mixture: router, every expert, shared experts
    moe_layers: int = 0  # how many of the n_layers are MoE layers
    idle_per_moe_layer: int = 0  # the routed experts one token does not go to: (E - k) experts
    mtp: int = 0  # multi-token prediction modules (embedding and output head shared with the model)

    @property
    def layers(self) -> int:
        return self.per_layer * (self.n_layers - self.moe_layers) + self.per_moe_layer * self.moe_layers

    @property
    def main(self) -> int:
        """The model without its multi-token prediction modules (DeepSeek-V3's 671B)."""
        return self.embedding + self.layers + self.final_norm + self.lm_head

    @property
    def total(self) -> int:
        return self.main + self.mtp

    @property
    def active(self) -> int:
        """The main model's parameters one token goes through: all but the routed experts it is not sent
        to (the embedding counted whole, as Mixtral's 12.9B and Qwen3's 22B active count it)."""
        return self.main - self.idle_per_moe_layer * self.moe_layers


def norm_params(shape: ModelShape) -> int:
    """One norm over hidden: weight, plus a bias for LayerNorm."""
    return 2 * shape.hidden if shape.norm == "layernorm" else shape.hidden


def attention_params(shape: ModelShape) -> int:
    """W_q, W_k, W_v, W_o (+ biases, + per-head q/k norm weights); latent attention's projections under MLA."""
    if shape.is_mla:
        return latent_attention_params(shape)
    h, q, kv = shape.hidden, shape.q_dim, shape.kv_dim
    weights = h * q + 2 * h * kv + q * h
    biases = 0
    if shape.linear_bias:
        biases = q + 2 * kv + h
    elif shape.qkv_bias:
        biases = q + 2 * kv
    qk_norm = 2 * shape.head_dim if shape.qk_norm else 0
    return weights + biases + qk_norm


def latent_attention_params(shape: ModelShape) -> int:
    """Multi-head latent attention (modeling_deepseek_v3.py DeepseekV3Attention; Megatron-LM
    theoretical_memory_usage.py self_attn_term): q_a (h x r_q), its norm, q_b (r_q x H·d_qk), or one W_q
    without q_lora_rank; kv_a_proj_with_mqa (h x (r_kv + d_rope)), its norm over r_kv, kv_b (r_kv x
    H·(d_nope + d_v)); o_proj (H·d_v x h)."""
    h, H, rq, rkv = shape.hidden, shape.n_heads, shape.q_lora_rank, shape.kv_lora_rank
    norm = 2 if shape.norm == "layernorm" else 1  # weight (+ bias) per element of the latent
    q = rq * (h + norm + H * shape.head_dim) if rq else h * H * shape.head_dim
    kv = h * (rkv + shape.qk_rope_head_dim) + norm * rkv + rkv * H * (shape.qk_nope_head_dim + shape.v_head_dim)
    return q + kv + H * shape.v_head_dim * h


def mlp_params_of(shape: ModelShape, width: int) -> int:
    """Plain: W_in (h x f), W_out (f x h). Gated: W_gate, W_up (h x f), W_down (f x h)."""
    n_in = 2 if shape.gated_mlp else 1
    weights = (n_in + 1) * shape.hidden * width
    biases = (n_in * width + shape.hidden) if shape.linear_bias else 0
    return weights + biases


def mlp_params(shape: ModelShape) -> int:
    """The dense MLP, ffn wide."""
    return mlp_params_of(shape, shape.ffn)


def expert_params(shape: ModelShape) -> int:
    """One routed expert: an MLP of expert_ffn (Mixtral's experts are SwiGLUs of its ffn)."""
    return mlp_params_of(shape, shape.routed_ffn)


def moe_mlp_params(shape: ModelShape) -> int:
    """A MoE layer's MLP: the router (h x E, no bias), every routed expert, the shared experts (one MLP of
    n_shared x their width, as DeepSeek-V3 builds them). Megatron-LM theoretical_memory_usage.py:
    routed_expert_params + shared_expert_params + router_params."""
    shared = mlp_params_of(shape, shape.shared_ffn) if shape.n_shared_experts else 0
    return shape.hidden * shape.n_experts + shape.n_experts * expert_params(shape) + shared


def layer_params(shape: ModelShape) -> int:
    """One block with the dense MLP: attention + MLP + the two pre-norms."""
    return attention_params(shape) + mlp_params(shape) + 2 * norm_params(shape)


def moe_layer_params(shape: ModelShape) -> int:
    """One block whose MLP is the mixture: attention + router + experts + shared experts + the two norms."""
    return attention_params(shape) + moe_mlp_params(shape) + 2 * norm_params(shape)


def largest_layer_params(shape: ModelShape) -> int:
    """The most parameters one block has (what ZeRO-3 gathers at once): a MoE block where there is one."""
    return moe_layer_params(shape) if moe_layer_count(shape) else layer_params(shape)


def mtp_params(shape: ModelShape) -> int:
    """One multi-token prediction module (DeepSeek-V3 report sec. 2.2): RMSNorms of the hidden state and of
    the next token's embedding, their projection M (2h -> h), one block (MoE when the last block is, as
    Megatron-LM counts mtp_num_moe_layers) and its final norm; embedding and output head shared."""
    last_is_moe = shape.n_layers > 0 and is_moe_layer(shape, shape.n_layers - 1)
    block = moe_layer_params(shape) if last_is_moe else layer_params(shape)
    return 3 * norm_params(shape) + 2 * shape.hidden * shape.hidden + block


@lru_cache(maxsize=1024)  # the estimate, the toolbox and the planner ask for the same shape many times
def param_counts(shape: ModelShape) -> ParamCounts:
    """Count every parameter tensor of the stack, as the PyTorch model in verify/ builds it."""
    positions = shape.max_positions * shape.hidden if shape.positions == "learned" else 0
    moe = moe_layer_count(shape)
    return ParamCounts(
        embedding=shape.vocab * shape.hidden + positions,
        per_layer=layer_params(shape),
        n_layers=shape.n_layers,
        final_norm=norm_params(shape),
        lm_head=0 if shape.tied_embeddings else shape.vocab * shape.hidden,
        per_moe_layer=moe_layer_params(shape) if moe else 0,
        moe_layers=moe,
        idle_per_moe_layer=(shape.n_experts - shape.experts_per_token) * expert_params(shape) if moe else 0,
        mtp=shape.mtp_layers * mtp_params(shape),
    )


def n_params(shape: ModelShape) -> int:
    return param_counts(shape).total


def idle_params(shape: ModelShape) -> int:
    """The routed experts one token does not go to, in every MoE block (MTP modules' too): what training
    FLOPs leave out of 6N."""
    counts = param_counts(shape)
    mtp_moe = shape.mtp_layers if shape.n_layers and is_moe_layer(shape, shape.n_layers - 1) else 0
    return counts.idle_per_moe_layer and (shape.n_experts - shape.experts_per_token) * expert_params(shape) * (
        counts.moe_layers + mtp_moe)


def active_params(shape: ModelShape) -> int:
    """Parameters one token goes through in the main model (see ParamCounts.active): the total of a dense model."""
    return param_counts(shape).active


@dataclass(frozen=True)
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


DECIMAL = {"k": 10**3, "m": 10**6, "b": 10**9, "g": 10**9, "t": 10**12}  # parameters, tokens, GPUs: 70B, 15T
BINARY = {"k": 1 << 10, "m": 1 << 20}  # sequence lengths: an 8k context is 8,192 tokens, 32K is 32,768


def parse_count(text: str, name: str, limit: float = float(MAX_SIZE), suffixes: dict[str, int] = DECIMAL) -> int:
    """Parse '8e9', '8B', '70b', '1.5M', '8192', '8k' into a positive int, or raise InputError."""
    raw = text.strip().replace("_", "").replace(",", "")
    scale = 1
    if raw and raw[-1].lower() in suffixes:
        scale, raw = suffixes[raw[-1].lower()], raw[:-1]
    too_large = InputError(f"{name} = {brief(text.strip())} is absurdly large (limit {limit:.3g})")
    if raw.isdigit() and len(raw) > MAX_DIGITS:  # int() refuses 4,300 digits; no float holds 309
        raise too_large
    try:
        value = int(raw) * scale if raw.isdigit() else float(raw) * scale
    except ValueError:
        raise InputError(f"{name} must be a number, got {brief(text)}") from None
    if isinstance(value, float) and not math.isfinite(value):  # an int is never converted to float
        raise InputError(f"{name} must be a finite number, got {brief(text)}")
    if value <= 0:
        raise InputError(f"{name} must be positive, got {brief(text)}")
    if value > limit:  # Python compares an int with a float exactly
        raise too_large
    if value != int(value):
        raise InputError(f"{name} must be a whole number, got {brief(text)}")
    return int(value)


def parse_seq(text: str, name: str = "seq") -> int:
    """A sequence length: '8192', '8k' (8,192), '32K' (32,768), '1m' (1,048,576): binary suffixes."""
    return parse_count(text, name, MAX_SEQ, BINARY)
