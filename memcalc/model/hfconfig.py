"""Read a Hugging Face config.json offline (standard library only) into a ModelShape.

Whether the MLP is gated is decided by the architecture (model_type), never by the FFN/hidden
ratio: Llama, Mistral, Qwen2/3 and Gemma use a gated MLP; GPT-2 does not.

Mixtral, Qwen3-MoE and DeepSeek-V3 are read with the field names of Transformers'
models/mixtral/configuration_mixtral.py, models/qwen3_moe/configuration_qwen3_moe.py and
models/deepseek_v3/configuration_deepseek_v3.py, and their defaults where a field is absent; which
layers are MoE follows each modeling_*.py's decoder layer (see memcalc.model.moe_mla.is_moe_layer).
"""

from __future__ import annotations

from pathlib import Path

from memcalc.errors import InputError

from .jsonfile import brief, read_json_object
from .params import n_params
from .shape import Model, ModelShape

# model_type -> (gated MLP, MLP activation, norm, positions, qkv bias, per-head q/k norm)
ARCHITECTURES = {
    "llama": (True, "silu", "rmsnorm", "rope", False, False),
    "mistral": (True, "silu", "rmsnorm", "rope", False, False),
    "qwen2": (True, "silu", "rmsnorm", "rope", True, False),
    "qwen3": (True, "silu", "rmsnorm", "rope", False, True),
    "gemma": (True, "gelu", "rmsnorm", "rope", False, False),  # GeGLU: gelu_pytorch_tanh (modeling_gemma.py)
    "gpt2": (False, "gelu", "layernorm", "learned", False, False),
    "mixtral": (True, "silu", "rmsnorm", "rope", False, False),
    "qwen3_moe": (True, "silu", "rmsnorm", "rope", False, True),
    "deepseek_v3": (True, "silu", "rmsnorm", "rope", False, False),
}
MOE_TYPES = ("mixtral", "qwen3_moe", "deepseek_v3")  # the mixture-of-experts architectures memcalc reads
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
    """A JSON integer, or a float that is one (256.0, as some exporters write); None where the field is
    absent and not required."""
    value = field(config, *keys, default=default, required=required)
    if value is None:
        return None
    if isinstance(value, float) and value.is_integer():  # jsonfile keeps every float finite
        return int(value)
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
    moe_like = "moe" in model_type or any(config.get(k) for k in MOE_KEYS)
    if moe_like and model_type not in MOE_TYPES:
        raise InputError(f"mixture-of-experts model_type {brief(model_type or '(missing)')} is not supported; "
                         f"memcalc reads {', '.join(MOE_TYPES)}")  # fmt: skip
    if model_type not in ARCHITECTURES:
        known = ", ".join(ARCHITECTURES)
        raise InputError(f"unknown model_type {brief(model_type or '(missing)')}; memcalc reads: {known}")
    return model_type


def layer_list(config: dict, key: str) -> tuple[int, ...]:
    """A JSON list of layer indices (Qwen3-MoE mlp_only_layers), absent: none."""
    value = config.get(key)
    if value is None:
        return ()
    if not isinstance(value, list) or any(isinstance(i, bool) or not isinstance(i, int) for i in value):
        raise InputError(f"config {key!r} must be a list of layer indices, got {brief(value)}")
    return tuple(value)


def experts(config: dict, model_type: str) -> dict:
    """The ModelShape fields of a mixture-of-experts config (and of MLA and MTP for DeepSeek-V3)."""
    if model_type == "mixtral":  # configuration_mixtral.py; modeling_mixtral.py always renormalises the top-k
        return dict(n_experts=whole(config, "num_local_experts", default=8),
                    experts_per_token=whole(config, "num_experts_per_tok", default=2), norm_topk_prob=True)
    if model_type == "qwen3_moe":  # configuration_qwen3_moe.py defaults; MoE where (i + 1) % step == 0
        step = whole(config, "decoder_sparse_step", default=1)
        return dict(n_experts=whole(config, "num_experts", default=128),
                    experts_per_token=whole(config, "num_experts_per_tok", default=8),
                    expert_ffn=whole(config, "moe_intermediate_size", default=768),
                    moe_every=step, moe_offset=step - 1 if step > 0 else 0,
                    dense_layers=layer_list(config, "mlp_only_layers"),
                    norm_topk_prob=flag(config, "norm_topk_prob", default=False))  # fmt: skip
    # deepseek_v3: configuration_deepseek_v3.py defaults; the gate's sigmoid scores from an fp32 matmul
    # (modeling_deepseek_v3.py DeepseekV3TopkRouter); moe_layer_freq and num_nextn_predict_layers are the
    # published config.json's fields (DeepSeek's own modeling code), not Transformers' (which ignores both)
    return dict(
        n_experts=whole(config, "n_routed_experts", default=256),
        experts_per_token=whole(config, "num_experts_per_tok", default=8),
        expert_ffn=whole(config, "moe_intermediate_size", default=2048),
        n_shared_experts=whole(config, "n_shared_experts", default=1),
        first_dense_layers=whole(config, "first_k_dense_replace", default=3),
        moe_every=whole(config, "moe_layer_freq", default=1),
        norm_topk_prob=flag(config, "norm_topk_prob", default=True),
        router="sigmoid", router_fp32=True,
        q_lora_rank=whole(config, "q_lora_rank", required=False) or 0,
        kv_lora_rank=whole(config, "kv_lora_rank", default=512),
        qk_rope_head_dim=whole(config, "qk_rope_head_dim", default=64),
        qk_nope_head_dim=whole(config, "qk_nope_head_dim", default=128),
        v_head_dim=whole(config, "v_head_dim", default=128),
        mtp_layers=whole(config, "num_nextn_predict_layers", required=False) or 0,
    )  # fmt: skip


def shape_from_config(config: dict, name: str = "config") -> ModelShape:
    model_type = architecture(config)
    gated, activation, norm, positions, qkv_bias, qk_norm = ARCHITECTURES[model_type]
    is_gpt2 = model_type == "gpt2"
    hidden = whole(config, "hidden_size", "n_embd")
    ffn = whole(config, "intermediate_size", "n_inner", required=not is_gpt2)
    moe = experts(config, model_type) if model_type in MOE_TYPES else {}
    head_dim = None if model_type == "deepseek_v3" else whole(config, "head_dim", required=False)  # V3: rope part
    return ModelShape(
        n_layers=whole(config, "num_hidden_layers", "n_layer"),
        hidden=hidden,
        n_heads=whole(config, "num_attention_heads", "n_head"),
        n_kv_heads=whole(config, "num_key_value_heads", required=False),
        head_dim=head_dim,
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
        **moe,
    )


def config_model(path: str | Path, name: str | None = None, origin: str | None = None) -> Model:
    """--config PATH: the shape from the file and its own parameter count."""
    config = read_config(path)
    if name is None:
        named = config.get("_name_or_path")
        name = named if isinstance(named, str) and named else Path(path).name
    shape = shape_from_config(config, name=name)
    return Model(shape=shape, n_params=n_params(shape), origin=origin or f"config {path}")


def hub_model(repo_id: str) -> Model:
    """--model ORG/NAME (or --config ORG/NAME): the Hub model's config.json (memcalc.model.hub)."""
    from .hub import hub_config, snapshot_of

    path = hub_config(repo_id)
    snapshot = snapshot_of(path)
    where = f"config.json, snapshot {snapshot}" if snapshot else "config.json"
    return config_model(path, repo_id, f"Hugging Face {repo_id} ({where})")
