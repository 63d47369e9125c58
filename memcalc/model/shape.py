"""The shape of a dense decoder-only transformer, and how many parameters it has."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from memcalc.errors import InputError

NORMS = ("layernorm", "rmsnorm")
ACTIVATIONS = ("silu", "gelu")  # gelu: the tanh approximation GPT-2 and Gemma use
POSITIONS = ("learned", "rope", "none")
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

    def __post_init__(self) -> None:
        for field in ("n_layers", "hidden", "n_heads", "vocab"):
            check_size(field, getattr(self, field))
        if self.n_kv_heads is None:
            object.__setattr__(self, "n_kv_heads", self.n_heads)
        if self.head_dim is None:
            object.__setattr__(self, "head_dim", self.hidden // self.n_heads)
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
        if self.positions == "rope" and self.head_dim % 2:  # RoPE rotates pairs: head_dim/2 frequencies
            raise InputError(f"rotary positions (RoPE) need an even head_dim: they rotate pairs of dimensions; "
                             f"got head_dim {self.head_dim} (hidden {self.hidden}, {self.n_heads} heads)")  # fmt: skip
        if not 0.0 <= self.dropout < 1.0:
            raise InputError(f"dropout must be in [0, 1), got {self.dropout}")

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
        """'llama' for a gated-MLP RMSNorm stack, 'gpt' for the textbook GPT-2/3 layer."""
        return "llama" if self.gated_mlp else "gpt"


def check_size(name: str, value: int, allow_zero: bool = False, limit: int = MAX_SIZE) -> None:
    """Reject sizes that are not whole numbers in (0, limit]."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise InputError(f"{name} must be a whole number, got {value!r}")
    if value < 0 or (value == 0 and not allow_zero):
        raise InputError(f"{name} must be positive, got {value}")
    if value > limit:
        raise InputError(f"{name} = {value} is absurdly large (limit {limit:,})")


def longest_seq(shape: ModelShape) -> int:
    """The longest sequence the model can embed: its learned position table's rows (GPT-2: 1,024), else
    no limit of its own (rotary positions extrapolate, if not well)."""
    return shape.max_positions if shape.positions == "learned" else MAX_SEQ


def check_positions(shape: ModelShape, seq_len: int) -> None:
    """The one rule for every command: a sequence longer than the position table cannot be trained."""
    if seq_len > longest_seq(shape):
        raise InputError(f"seq {seq_len:,} exceeds the {shape.max_positions:,} rows of {shape.name}'s learned "
                         f"position table: give --seq {shape.max_positions} or less")  # fmt: skip


@dataclass(slots=True)
class ParamCounts:
    """Parameters by place in the model; the total is their sum."""

    embedding: int  # token table (+ learned position table)
    per_layer: int
    n_layers: int
    final_norm: int
    lm_head: int  # 0 when tied to the token table

    @property
    def layers(self) -> int:
        return self.per_layer * self.n_layers

    @property
    def total(self) -> int:
        return self.embedding + self.layers + self.final_norm + self.lm_head


def norm_params(shape: ModelShape) -> int:
    """One norm over hidden: weight, plus a bias for LayerNorm."""
    return 2 * shape.hidden if shape.norm == "layernorm" else shape.hidden


def attention_params(shape: ModelShape) -> int:
    """W_q, W_k, W_v, W_o (+ biases, + per-head q/k norm weights)."""
    h, q, kv = shape.hidden, shape.q_dim, shape.kv_dim
    weights = h * q + 2 * h * kv + q * h
    biases = 0
    if shape.linear_bias:
        biases = q + 2 * kv + h
    elif shape.qkv_bias:
        biases = q + 2 * kv
    qk_norm = 2 * shape.head_dim if shape.qk_norm else 0
    return weights + biases + qk_norm


def mlp_params(shape: ModelShape) -> int:
    """Plain: W_in (h x f), W_out (f x h). Gated: W_gate, W_up (h x f), W_down (f x h)."""
    n_in = 2 if shape.gated_mlp else 1
    weights = (n_in + 1) * shape.hidden * shape.ffn
    biases = (n_in * shape.ffn + shape.hidden) if shape.linear_bias else 0
    return weights + biases


def layer_params(shape: ModelShape) -> int:
    """One block: attention + MLP + the two pre-norms."""
    return attention_params(shape) + mlp_params(shape) + 2 * norm_params(shape)


def param_counts(shape: ModelShape) -> ParamCounts:
    """Count every parameter tensor of the stack, as the PyTorch model in verify/ builds it."""
    positions = shape.max_positions * shape.hidden if shape.positions == "learned" else 0
    return ParamCounts(
        embedding=shape.vocab * shape.hidden + positions,
        per_layer=layer_params(shape),
        n_layers=shape.n_layers,
        final_norm=norm_params(shape),
        lm_head=0 if shape.tied_embeddings else shape.vocab * shape.hidden,
    )


def n_params(shape: ModelShape) -> int:
    return param_counts(shape).total


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
    if ("hidden" in given or "n_heads" in given) and shape.head_dim == shape.hidden // shape.n_heads:
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
    try:
        value = int(raw) * scale if raw.isdigit() else float(raw) * scale
    except ValueError:
        raise InputError(f"{name} must be a number, got {text!r}") from None
    if not math.isfinite(value):
        raise InputError(f"{name} must be a finite number, got {text!r}")
    if value <= 0:
        raise InputError(f"{name} must be positive, got {text!r}")
    if value > limit:
        raise InputError(f"{name} = {text} is absurdly large (limit {limit:.3g})")
    if value != int(value):
        raise InputError(f"{name} must be a whole number, got {text!r}")
    return int(value)


def parse_seq(text: str, name: str = "seq") -> int:
    """A sequence length: '8192', '8k' (8,192), '32K' (32,768), '1m' (1,048,576): binary suffixes."""
    return parse_count(text, name, MAX_SEQ, BINARY)
