"""Read a Hugging Face config.json offline (standard library only) into a ModelShape.

Whether the MLP is gated is decided by the architecture (model_type), never by the FFN/hidden
ratio: Llama, Mistral, Qwen2/3 and Gemma use a gated MLP; GPT-2 does not.
"""

from __future__ import annotations

import json
from pathlib import Path

from memcalc.errors import InputError

from .shape import Model, ModelShape, n_params

# model_type -> (gated MLP, norm, positions, qkv bias, per-head q/k norm)
ARCHITECTURES = {
    "llama": (True, "rmsnorm", "rope", False, False),
    "mistral": (True, "rmsnorm", "rope", False, False),
    "qwen2": (True, "rmsnorm", "rope", True, False),
    "qwen3": (True, "rmsnorm", "rope", False, True),
    "gemma": (True, "rmsnorm", "rope", False, False),
    "gpt2": (False, "layernorm", "learned", False, False),
}
MOE_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_intermediate_size")


def read_config(path: str | Path) -> dict:
    """The config as a dict, or a one-line InputError for a missing, malformed or non-object file."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise InputError(f"config file not found: {p}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise InputError(f"cannot read config {p}: {e.__class__.__name__}") from None
    try:
        config = json.loads(text)
    except json.JSONDecodeError as e:
        raise InputError(f"config {p} is not valid JSON (line {e.lineno}, column {e.colno}: {e.msg})") from None
    if not isinstance(config, dict):
        raise InputError(f"config {p} must hold a JSON object, not a {type(config).__name__}")
    return config


def field(config: dict, *keys: str, default: object = None, required: bool = True) -> object:
    """The first of keys present in config (HF names vary between GPT-2 and Llama)."""
    for key in keys:
        if config.get(key) is not None:
            return config[key]
    if required and default is None:
        raise InputError(f"config has no {keys[0]!r}")
    return default


def whole(config: dict, *keys: str, default: int | None = None) -> int:
    value = field(config, *keys, default=default)
    if isinstance(value, bool) or not isinstance(value, int):
        raise InputError(f"config {keys[0]!r} must be a whole number, got {value!r}")
    return value


def fraction(config: dict, *keys: str) -> float:
    value = field(config, *keys, default=0.0)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InputError(f"config {keys[0]!r} must be a number, got {value!r}")
    return float(value)


def architecture(config: dict) -> str:
    """model_type, checked against what memcalc can model; MoE gets its own message."""
    model_type = str(config.get("model_type", "")).lower()
    if "moe" in model_type or any(config.get(k) for k in MOE_KEYS):
        raise InputError(f"mixture-of-experts models ({model_type or 'this config'}) are not supported yet")
    if model_type not in ARCHITECTURES:
        known = ", ".join(ARCHITECTURES)
        raise InputError(f"unknown model_type {model_type or '(missing)'!r}; memcalc reads: {known}")
    return model_type


def shape_from_config(config: dict, name: str = "config") -> ModelShape:
    model_type = architecture(config)
    gated, norm, positions, qkv_bias, qk_norm = ARCHITECTURES[model_type]
    is_gpt2 = model_type == "gpt2"
    hidden = whole(config, "hidden_size", "n_embd")
    ffn = field(config, "intermediate_size", "n_inner", required=not is_gpt2)
    return ModelShape(
        n_layers=whole(config, "num_hidden_layers", "n_layer"),
        hidden=hidden,
        n_heads=whole(config, "num_attention_heads", "n_head"),
        n_kv_heads=field(config, "num_key_value_heads", required=False),
        head_dim=field(config, "head_dim", required=False),
        ffn=ffn,
        gated_mlp=gated,
        norm=norm,
        vocab=whole(config, "vocab_size"),
        tied_embeddings=bool(field(config, "tie_word_embeddings", default=is_gpt2 or model_type == "gemma")),
        dropout=fraction(config, "attention_dropout", "attn_pdrop"),
        linear_bias=is_gpt2,
        qkv_bias=qkv_bias,
        qk_norm=qk_norm,
        positions=positions,
        max_positions=whole(config, "n_positions", "max_position_embeddings") if is_gpt2 else 0,
        name=name,
    )


def config_model(path: str | Path) -> Model:
    """--config PATH: the shape from the file and its own parameter count."""
    config = read_config(path)
    shape = shape_from_config(config, name=str(config.get("_name_or_path") or Path(path).name))
    return Model(shape=shape, n_params=n_params(shape), origin=f"config {path} ({shape.family} family)")
