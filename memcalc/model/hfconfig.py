"""Read a Hugging Face config.json offline (standard library only) into a ModelShape.

What is fixed by the architecture (model_type) is taken from it, never guessed from sizes: whether the MLP is
gated (Llama, Mistral, Qwen2/3, Gemma 1-3, Phi-3, OLMo 2; not GPT-2, GPT-NeoX), where the norms stand (Gemma
2/3's sandwich, OLMo 2's post-norms), which q/k norms there are. What the config chooses is read: softcaps,
partial rotary positions, GPT-NeoX's parallel residual, the sliding window and the layers it spares.

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

LLAMA = dict(gated_mlp=True, activation="silu", norm="rmsnorm", positions="rope")
GEMMA = dict(LLAMA, activation="gelu")  # GeGLU: gelu_pytorch_tanh (modeling_gemma.py GemmaMLP)
# model_type -> the ModelShape fields its modeling_<type>.py fixes (the rest are read from the config)
ARCHITECTURES = {
    "llama": LLAMA,
    "mistral": LLAMA,
    "qwen2": dict(LLAMA, qkv_bias=True),
    "qwen3": dict(LLAMA, qk_norm=True),
    "gemma": GEMMA,
    "gemma2": dict(GEMMA, norm_layout="sandwich"),  # Gemma2DecoderLayer: four RMSNorms
    "gemma3_text": dict(GEMMA, norm_layout="sandwich", qk_norm=True),  # Gemma3Attention q_norm, k_norm per head
    "phi3": LLAMA,  # Phi3Attention qkv_proj and Phi3MLP gate_up_proj: fused, the same parameters
    "olmo2": dict(LLAMA, norm_layout="post", qk_norm=True, qk_norm_over="all"),  # Olmo2Attention q_norm(q_proj(x))
    "gpt_neox": dict(positions="rope", norm="layernorm", linear_bias=True),  # GPTNeoXLayer, GELU MLP
    "gpt2": dict(norm="layernorm", positions="learned", linear_bias=True),
    "mixtral": LLAMA,
    "qwen3_moe": dict(LLAMA, qk_norm=True),
    "deepseek_v3": LLAMA,
    "deepseek_v2": LLAMA,  # the same MLA and shared-expert block; softmax routing (configuration_deepseek_v2.py)
}
SOFTCAPS = {"gemma2": {"attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0}}  # where absent
WINDOWS = {"mistral": 4096, "phi3": None, "qwen2": 4096, "gemma2": 4096, "gemma3_text": 4096}  # where absent
# model_types people bring that memcalc does not read, and why
REFUSED = {
    "gemma3": "Gemma 3's vision-language model (a SigLIP tower beside the decoder); its text_config as a "
              "config of model_type gemma3_text is read",
    "qwen2_vl": "a vision-language model (a vision transformer beside the decoder, M-RoPE)",
    "qwen2_5_vl": "a vision-language model (a vision transformer beside the decoder, M-RoPE)",
    "mistral3": "a vision-language model (a Pixtral vision tower beside the decoder)",
    "llama4": "a vision-language mixture of experts (chunked attention, interleaved MoE layers, a vision tower)",
    "gpt_oss": "a mixture of experts with attention sinks and MXFP4 experts, neither modelled",
    "qwen3_next": "a hybrid of gated DeltaNet linear attention and gated attention, with a mixture of experts",
}
MOE_TYPES = ("mixtral", "qwen3_moe", "deepseek_v3", "deepseek_v2")  # the mixture-of-experts architectures memcalc reads
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
    if model_type in REFUSED:
        raise InputError(f"model_type {model_type!r} is not supported: {REFUSED[model_type]}")
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
    if model_type == "deepseek_v2":  # configuration_deepseek_v2.py defaults: softmax scores, no renormalisation
        return deepseek(config, n_experts=64, per_token=6, expert_ffn=1407, shared=2, first_dense=0,
                        norm_topk=False, router="softmax", router_fp32=False)  # fmt: skip
    # deepseek_v3: configuration_deepseek_v3.py defaults; the gate's sigmoid scores from an fp32 matmul
    # (modeling_deepseek_v3.py DeepseekV3TopkRouter); moe_layer_freq and num_nextn_predict_layers are the
    # published config.json's fields (DeepSeek's own modeling code), not Transformers' (which ignores both)
    return deepseek(config, n_experts=256, per_token=8, expert_ffn=2048, shared=1, first_dense=3, norm_topk=True,
                    router="sigmoid", router_fp32=True)  # fmt: skip


def deepseek(config: dict, *, n_experts: int, per_token: int, expert_ffn: int, shared: int, first_dense: int,
             norm_topk: bool, router: str, router_fp32: bool) -> dict:
    """DeepSeek-V2's and V3's experts, MLA and MTP fields, with the version's defaults where absent."""
    return dict(
        n_experts=whole(config, "n_routed_experts", default=n_experts),
        experts_per_token=whole(config, "num_experts_per_tok", default=per_token),
        expert_ffn=whole(config, "moe_intermediate_size", default=expert_ffn),
        n_shared_experts=whole(config, "n_shared_experts", default=shared),
        first_dense_layers=whole(config, "first_k_dense_replace", default=first_dense),
        moe_every=whole(config, "moe_layer_freq", default=1),
        norm_topk_prob=flag(config, "norm_topk_prob", default=norm_topk),
        router=router, router_fp32=router_fp32,
        q_lora_rank=whole(config, "q_lora_rank", required=False) or 0,
        kv_lora_rank=whole(config, "kv_lora_rank", default=512),
        qk_rope_head_dim=whole(config, "qk_rope_head_dim", default=64),
        qk_nope_head_dim=whole(config, "qk_nope_head_dim", default=128),
        v_head_dim=whole(config, "v_head_dim", default=128),
        mtp_layers=whole(config, "num_nextn_predict_layers", required=False) or 0,
    )  # fmt: skip


def shape_from_config(config: dict, name: str = "config") -> ModelShape:
    model_type = architecture(config)
    fixed = ARCHITECTURES[model_type]
    is_gpt2 = model_type == "gpt2"
    moe = experts(config, model_type) if model_type in MOE_TYPES else {}
    head_dim = None if model_type.startswith("deepseek") else whole(config, "head_dim", required=False)  # V3: rope part
    hidden = whole(config, "hidden_size", "n_embd")
    n_layers = whole(config, "num_hidden_layers", "n_layer")
    return ModelShape(
        n_layers=n_layers,
        hidden=hidden,
        n_heads=whole(config, "num_attention_heads", "n_head"),
        n_kv_heads=whole(config, "num_key_value_heads", required=False),
        head_dim=head_dim,
        ffn=whole(config, "intermediate_size", "n_inner", required=not is_gpt2),
        vocab=whole(config, "vocab_size"),
        tied_embeddings=flag(config, "tie_word_embeddings", default=is_gpt2 or model_type.startswith("gemma")),
        dropout=fraction(config, "attention_dropout", "attn_pdrop"),
        max_positions=whole(config, "n_positions", "max_position_embeddings") if is_gpt2 else 0,
        name=name,
        arch=model_type,
        **fixed,
        **wiring(config, model_type, n_layers),
        **moe,
    )


def wiring(config: dict, model_type: str, n_layers: int) -> dict:
    """The config's own choices of the families' fields: softcaps (Gemma 2), partial rotary (GPT-NeoX
    rotary_pct, Phi-3 partial_rotary_factor), the parallel residual (GPT-NeoX) and the sliding window."""
    caps = SOFTCAPS.get(model_type, {}) | config  # configuration_gemma2.py: 50 and 30 where absent
    out = dict(attn_softcap=fraction(caps, "attn_logit_softcapping"),
               logit_softcap=fraction(caps, "final_logit_softcapping"))  # fmt: skip
    rope = config.get("rope_parameters") if isinstance(config.get("rope_parameters"), dict) else {}
    default_fraction = 0.25 if model_type == "gpt_neox" else 1.0  # configuration_gpt_neox.py rotary_pct
    out["rotary_fraction"] = fraction(rope, "partial_rotary_factor") or fraction(
        config, "partial_rotary_factor", "rotary_pct") or default_fraction  # fmt: skip
    if model_type == "gpt_neox":
        out["parallel_residual"] = flag(config, "use_parallel_residual", default=True)
    return out | window(config, model_type, n_layers)


def window(config: dict, model_type: str, n_layers: int) -> dict:
    """sliding_window and the layers that keep full attention: the config's layer_types where it has them, else
    each configuration_<type>.py's default (Gemma 2: every second layer global; Gemma 3: every
    sliding_window_pattern-th, 6; Qwen2: with use_sliding_window, the layers below max_window_layers; Mistral
    and Phi-3: every layer, where sliding_window is set). Families without a window ignore the field."""
    if model_type not in WINDOWS:
        return {}
    size = whole(config, "sliding_window", required=False) if "sliding_window" in config else WINDOWS[model_type]
    if model_type == "qwen2" and not flag(config, "use_sliding_window", default=False):
        size = 0
    if not size:
        return {}
    types = config.get("layer_types")
    if types is not None:
        if not isinstance(types, list) or len(types) != n_layers or any(
                t not in ("sliding_attention", "full_attention") for t in types):  # fmt: skip
            raise InputError(f"config 'layer_types' must list sliding_attention or full_attention for each of the "
                             f"{n_layers} layers, got {brief(types)}")  # fmt: skip
        full = tuple(i for i, t in enumerate(types) if t == "full_attention")
    elif model_type == "gemma2":
        full = tuple(i for i in range(n_layers) if (i + 1) % 2 == 0)
    elif model_type == "gemma3_text":
        pattern = whole(config, "sliding_window_pattern", default=6)
        full = tuple(i for i in range(n_layers) if (i + 1) % pattern == 0)
    elif model_type == "qwen2":
        full = tuple(range(min(n_layers, whole(config, "max_window_layers", default=28))))
    else:
        full = ()
    return {} if len(full) == n_layers else dict(sliding_window=size, global_layers=full)


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
