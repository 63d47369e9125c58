"""Read a Hugging Face config.json offline (standard library only) into a ModelShape.

Whether the MLP is gated is decided by the architecture (model_type), never by the FFN/hidden
ratio: Llama, Mistral, Qwen2/3 and Gemma use a gated MLP; GPT-2 does not.
"""

from __future__ import annotations

from pathlib import Path

from memcalc.errors import InputError

from .jsonfile import brief, read_json_object
from .shape import Model, ModelShape, n_params

# model_type -> (gated MLP, MLP activation, norm, positions, qkv bias, per-head q/k norm)
ARCHITECTURES = {
    "llama": (True, "silu", "rmsnorm", "rope", False, False),
    "mistral": (True, "silu", "rmsnorm", "rope", False, False),
    "qwen2": (True, "silu", "rmsnorm", "rope", True, False),
    "qwen3": (True, "silu", "rmsnorm", "rope", False, True),
    "gemma": (True, "gelu", "rmsnorm", "rope", False, False),  # GeGLU: gelu_pytorch_tanh (modeling_gemma.py)
    "gpt2": (False, "gelu", "layernorm", "learned", False, False),
}
MOE_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_intermediate_size")


def read_config(path: str | Path) -> dict:
    """The config as a dict, or a one-line InputError (see memcalc.model.jsonfile: at most 1 MiB is read)."""
    return read_json_object(path, "config")


def field(config: dict, *keys: str, default: object = None, required: bool = True) -> object:
    """The first of keys present in config (HF names vary between GPT-2 and Llama)."""
    for key in keys:
        if config.get(key) is not None:
            return config[key]
    if required and default is None:
        raise InputError(f"config has no {keys[0]!r}")
    return default


def whole(config: dict, *keys: str, default: int | None = None, required: bool = True) -> int | None:
    """A JSON integer (None where the field is absent and not required)."""
    value = field(config, *keys, default=default, required=required)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise InputError(f"config {keys[0]!r} must be a whole number, got {brief(value)}")
    return value


def fraction(config: dict, *keys: str) -> float:
    value = field(config, *keys, default=0.0)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InputError(f"config {keys[0]!r} must be a number, got {brief(value)}")
    return float(value)


def flag(config: dict, *keys: str, default: bool) -> bool:
    """A JSON true or false; a string such as "false" is refused (bool("false") would read as true)."""
    value = field(config, *keys, default=default)
    if not isinstance(value, bool):
        raise InputError(f"config {keys[0]!r} must be true or false (a JSON boolean), got {brief(value)}")
    return value


def architecture(config: dict) -> str:
    """model_type, checked against what memcalc can model; MoE gets its own message."""
    model_type = config.get("model_type", "")
    if not isinstance(model_type, str):
        raise InputError(f"config 'model_type' must be a string, got {brief(model_type)}")
    model_type = model_type.lower()
    if "moe" in model_type or any(config.get(k) for k in MOE_KEYS):
        raise InputError(f"mixture-of-experts models ({model_type or 'this config'}) are not supported yet")
    if model_type not in ARCHITECTURES:
        known = ", ".join(ARCHITECTURES)
        raise InputError(f"unknown model_type {brief(model_type or '(missing)')}; memcalc reads: {known}")
    return model_type


def shape_from_config(config: dict, name: str = "config") -> ModelShape:
    model_type = architecture(config)
    gated, activation, norm, positions, qkv_bias, qk_norm = ARCHITECTURES[model_type]
    is_gpt2 = model_type == "gpt2"
    hidden = whole(config, "hidden_size", "n_embd")
    ffn = whole(config, "intermediate_size", "n_inner", required=not is_gpt2)
    return ModelShape(
        n_layers=whole(config, "num_hidden_layers", "n_layer"),
        hidden=hidden,
        n_heads=whole(config, "num_attention_heads", "n_head"),
        n_kv_heads=whole(config, "num_key_value_heads", required=False),
        head_dim=whole(config, "head_dim", required=False),
        ffn=ffn,
        gated_mlp=gated,
        activation=activation,
        norm=norm,
        vocab=whole(config, "vocab_size"),
        tied_embeddings=flag(config, "tie_word_embeddings", default=is_gpt2 or model_type == "gemma"),
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
    name = config.get("_name_or_path")
    shape = shape_from_config(config, name=name if isinstance(name, str) and name else Path(path).name)
    return Model(shape=shape, n_params=n_params(shape), origin=f"config {path}")
