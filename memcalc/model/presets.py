"""Named models with their published shapes, and the canonical shape behind --params N."""

from __future__ import annotations

import math
from dataclasses import replace

from memcalc.errors import InputError

from .params import n_params
from .shape import Model, ModelShape


def gpt(name: str, n_layers: int, hidden: int, n_heads: int, max_positions: int) -> ModelShape:
    """GPT-2/3 layer: MHA, LayerNorm, 4h GELU MLP, biases, tied embeddings, and learned positions
    (a table of max_positions rows; 0: no position table at all)."""
    return ModelShape(
        n_layers=n_layers, hidden=hidden, n_heads=n_heads, vocab=50257, norm="layernorm", linear_bias=True,
        positions="learned" if max_positions else "none", max_positions=max_positions, dropout=0.1, name=name,
    )  # fmt: skip


def llama(name: str, n_layers: int, hidden: int, n_heads: int, n_kv_heads: int, ffn: int,
          vocab: int, tied: bool, head_dim: int | None = None, qk_norm: bool = False) -> ModelShape:  # fmt: skip
    """Llama/Qwen layer: GQA, RMSNorm, SwiGLU, RoPE, no biases, no dropout (Transformers' llama, or qwen3 with
    its q/k norms)."""
    return ModelShape(
        n_layers=n_layers, hidden=hidden, n_heads=n_heads, n_kv_heads=n_kv_heads, head_dim=head_dim,
        ffn=ffn, gated_mlp=True, norm="rmsnorm", vocab=vocab, tied_embeddings=tied,
        positions="rope", qk_norm=qk_norm, name=name, arch="qwen3" if qk_norm else "llama",
    )  # fmt: skip


def transformers_family(name: str, arch: str, n_layers: int, hidden: int, n_heads: int, n_kv_heads: int, ffn: int,
                        vocab: int, tied: bool, head_dim: int | None = None, **wiring) -> ModelShape:  # fmt: skip
    """A shape of one of the Transformers families memcalc.model.hfconfig reads: its architecture's fixed
    fields (ARCHITECTURES), the sizes, and the config's own choices (window, softcaps, partial rotary)."""
    from .hfconfig import ARCHITECTURES

    return ModelShape(n_layers=n_layers, hidden=hidden, n_heads=n_heads, n_kv_heads=n_kv_heads, head_dim=head_dim,
                      ffn=ffn, vocab=vocab, tied_embeddings=tied, name=name, arch=arch,
                      **ARCHITECTURES[arch], **wiring)  # fmt: skip


def mixture(base: ModelShape, n_experts: int, per_token: int, expert_ffn: int | None = None, **more) -> ModelShape:
    """A Llama/Qwen shape whose MLPs are mixtures of n_experts SwiGLU experts, per_token of them per token
    (Transformers' mixtral, qwen3_moe, deepseek_v3)."""
    arch = {"llama": "mixtral", "qwen3": "qwen3_moe"}[base.arch] if "q_lora_rank" not in more else "deepseek_v3"
    return replace(base, n_experts=n_experts, experts_per_token=per_token, expert_ffn=expert_ffn,
                   norm_topk_prob=True, arch=arch, **more)  # fmt: skip


# DeepSeek-V3 (DeepSeek-AI 2024, arXiv 2412.19437, sec. 4.2 and config.json): MLA with a 1536-rank query and
# 512-rank key-value latent, 128 heads of 128 + 64 (RoPE) dims, values 128; 1 shared + 256 routed experts
# of 2048, 8 per token, sigmoid gate; the first 3 layers dense (18432); one MTP module.
DEEPSEEK_V3 = mixture(
    llama("deepseek-v3", 61, 7168, 128, 128, 18432, 129280, False), 256, 8, 2048, n_shared_experts=1,
    first_dense_layers=3, router="sigmoid", router_fp32=True, q_lora_rank=1536, kv_lora_rank=512,
    qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128, head_dim=192, mtp_layers=1,
)  # fmt: skip

# Shapes from each model's published config.json; the comment is the published parameter count.
PRESETS: dict[str, ModelShape] = {
    "gpt2": gpt("gpt2", 12, 768, 12, 1024),  # 124,439,808 (Radford et al. 2019; HF gpt2)
    "gpt2-medium": gpt("gpt2-medium", 24, 1024, 16, 1024),  # 354,823,168 (HF gpt2-medium)
    "gpt2-large": gpt("gpt2-large", 36, 1280, 20, 1024),  # 774,030,080 (HF gpt2-large)
    "gpt2-xl": gpt("gpt2-xl", 48, 1600, 25, 1024),  # 1,557,611,200 (HF gpt2-xl)
    "gpt3-175b": gpt("gpt3-175b", 96, 12288, 96, 2048),  # 175.0B (Brown et al. 2020, Table 2.1)
    "llama3-8b": llama("llama3-8b", 32, 4096, 32, 8, 14336, 128256, False),  # 8,030,261,248
    "llama3-70b": llama("llama3-70b", 80, 8192, 64, 8, 28672, 128256, False),  # 70,553,706,496
    "llama3.1-8b": llama("llama3.1-8b", 32, 4096, 32, 8, 14336, 128256, False),  # 8,030,261,248 (Llama 3's shape)
    "llama3.1-70b": llama("llama3.1-70b", 80, 8192, 64, 8, 28672, 128256, False),  # 70,553,706,496
    "llama3.1-405b": llama("llama3.1-405b", 126, 16384, 128, 8, 53248, 128256, False),  # 405B
    "llama3.2-1b": llama("llama3.2-1b", 16, 2048, 32, 8, 8192, 128256, True, 64),  # 1,235,814,400
    "llama3.2-3b": llama("llama3.2-3b", 28, 3072, 24, 8, 8192, 128256, True, 128),  # 3,212,749,824
    # Llama 2 (Touvron et al. 2023, Table 1; meta-llama/Llama-2-*-hf's config.json): MHA at 7B and 13B, GQA at 70B
    "llama2-7b": llama("llama2-7b", 32, 4096, 32, 32, 11008, 32000, False),  # 6,738,415,616
    "llama2-13b": llama("llama2-13b", 40, 5120, 40, 40, 13824, 32000, False),  # 13,015,864,320
    "llama2-70b": llama("llama2-70b", 80, 8192, 64, 8, 28672, 32000, False),  # 68,976,648,192
    "qwen3-0.6b": llama("qwen3-0.6b", 28, 1024, 16, 8, 3072, 151936, True, 128, True),  # 0.6B
    "qwen3-1.7b": llama("qwen3-1.7b", 28, 2048, 16, 8, 6144, 151936, True, 128, True),  # 1.7B
    "qwen3-4b": llama("qwen3-4b", 36, 2560, 32, 8, 9728, 151936, True, 128, True),  # 4.0B
    "qwen3-8b": llama("qwen3-8b", 36, 4096, 32, 8, 12288, 151936, False, 128, True),  # 8.2B
    "qwen3-14b": llama("qwen3-14b", 40, 5120, 40, 8, 17408, 151936, False, 128, True),  # 14.8B
    "qwen3-32b": llama("qwen3-32b", 64, 5120, 64, 8, 25600, 151936, False, 128, True),  # 32.8B
    # the Transformers families (config.json of each Hub repo named; tests/test_models.py holds the counts)
    "mistral-7b": transformers_family("mistral-7b", "mistral", 32, 4096, 32, 8, 14336, 32000, False,
                                      sliding_window=4096),  # 7,241,732,096 (mistralai/Mistral-7B-v0.1)
    "gemma-7b": transformers_family("gemma-7b", "gemma", 28, 3072, 16, 16, 24576, 256000, True,
                                    256),  # 8,537,680,896 (google/gemma-7b)
    "gemma2-9b": transformers_family("gemma2-9b", "gemma2", 42, 3584, 16, 8, 14336, 256000, True, 256,
                                     attn_softcap=50.0, logit_softcap=30.0, sliding_window=4096,
                                     global_layers=tuple(range(1, 42, 2))),  # 9,241,705,984 (google/gemma-2-9b)
    "gemma3-4b": transformers_family("gemma3-4b", "gemma3_text", 34, 2560, 8, 4, 10240, 262208, True, 256,
                                     sliding_window=1024, global_layers=tuple(range(5, 34, 6))),
    # 3,880,263,168: google/gemma-3-4b-pt's text_config (its vision tower apart)
    "qwen2.5-7b": transformers_family("qwen2.5-7b", "qwen2", 28, 3584, 28, 4, 18944, 152064,
                                      False),  # 7,615,616,512 (Qwen/Qwen2.5-7B; use_sliding_window false)
    "olmo2-7b": transformers_family("olmo2-7b", "olmo2", 32, 4096, 32, 32, 11008, 100352,
                                    False),  # 7,298,617,344 (allenai/OLMo-2-1124-7B)
    "phi3-mini": transformers_family("phi3-mini", "phi3", 32, 3072, 32, 32, 8192, 32064, False,
                                     sliding_window=2047),  # 3,821,079,552 (microsoft/Phi-3-mini-4k-instruct)
    "pythia-6.9b": transformers_family("pythia-6.9b", "gpt_neox", 32, 4096, 32, 32, 16384, 50432, False,
                                       rotary_fraction=0.25, parallel_residual=True),  # 6,857,302,016
    # (EleutherAI/pythia-6.9b)
    # mixtures of experts: total / active per token (tests/test_moe.py holds the exact counts against these)
    "mixtral-8x7b": mixture(llama("mixtral-8x7b", 32, 4096, 32, 8, 14336, 32000, False), 8, 2),  # 46.7B / 12.9B
    "qwen3-30b-a3b": mixture(llama("qwen3-30b-a3b", 48, 2048, 32, 4, 6144, 151936, False, 128, True),
                             128, 8, 768),  # 30.5B / 3.3B  # fmt: skip
    "qwen3-235b-a22b": mixture(llama("qwen3-235b-a22b", 94, 4096, 64, 4, 12288, 151936, False, 128, True),
                               128, 8, 1536),  # 235B / 22B  # fmt: skip
    "deepseek-v3": DEEPSEEK_V3,  # 671B / 37B, + 14B multi-token prediction (as stored: see docs/moe.md)
}

# --params N alone takes the nearest of these (in log-parameters): one dense family per size,
# the Qwen3 dense models from 0.6B to 32B, Llama 3 at 70B and 405B, GPT-3 at 175B.
# At 8e9 this is Qwen3-8B's shape: 36 layers, hidden 4096, 32 heads (8 KV heads, SwiGLU 12288).
CANONICAL = (
    "qwen3-0.6b", "qwen3-1.7b", "qwen3-4b", "qwen3-8b", "qwen3-14b", "qwen3-32b",
    "llama3-70b", "gpt3-175b", "llama3.1-405b",
)  # fmt: skip

MAX_PARAMS = 1e14  # a hundred trillion: beyond any dense model trained
# --params N takes a canonical shape only if N is within this factor of the shape's own count. Inside
# the table the nearest shape is always within 1.7x (the widest gap, 0.6B to 1.7B, is 2.9x); past
# its ends a shape 2x away still describes a model of about N parameters, a farther one another model.
REACH = 2.0


def preset(name: str) -> ModelShape:
    """The preset of that name, or a one-line InputError listing the known names."""
    key = name.strip().lower()
    if key not in PRESETS:
        raise InputError(f"unknown model {name!r}; known: {', '.join(PRESETS)}")
    return PRESETS[key]


def preset_model(name: str) -> Model:
    shape = preset(name)
    return Model(shape=shape, n_params=n_params(shape), origin=f"preset {shape.name}")


def canonical_shape(params: int) -> ModelShape:
    """The canonical shape whose own parameter count is nearest to params, in log scale.

    The rule a user can count on: N within REACH (2x) of the nearest shape's own count gets that shape,
    and model state is charged for exactly N (8e9: Qwen3-8B's shape, 8,000,000,000 parameters). Farther
    from every shape (below 0.298B or above 812B), the shape would describe another model than N
    (at --params 124e6, Qwen3-0.6B's embedding alone is 156M), so N is refused with a line that says
    how to give the shape instead.
    """
    if not 0 < params <= MAX_PARAMS:
        raise InputError(f"parameter count {params:.3g} is out of range (0, {MAX_PARAMS:.0e}]")
    shape = min((PRESETS[k] for k in CANONICAL), key=lambda s: abs(math.log(n_params(s) / params)))
    if abs(math.log(n_params(shape) / params)) > math.log(REACH):
        raise InputError(out_of_reach(params))
    return shape


def out_of_reach(params: int) -> str:
    smallest, largest = PRESETS[CANONICAL[0]], PRESETS[CANONICAL[-1]]
    low, high = n_params(smallest) / REACH, n_params(largest) * REACH
    return (f"--params {params:,}: the canonical shapes cover {low / 1e9:.3g}B to {high / 1e9:.3g}B parameters "
            f"(within {REACH:g}x of {smallest.name} to {largest.name}); give the shape instead: --model NAME "
            f"(gpt2 is 124M; see `memcalc presets`), --config PATH, or --layers --hidden --heads")


def canonical_model(params: int) -> Model:
    """--params N: N parameters on the nearest canonical shape (see canonical_shape), and a note saying so."""
    shape = canonical_shape(params)
    origin = (
        f"{params / 1e9:.3g}B parameters on the canonical {shape.name} shape "
        f"({shape.n_layers} layers, hidden {shape.hidden}, {shape.n_heads} heads; "
        f"its own count is {n_params(shape) / 1e9:.3g}B)"
    )
    return Model(shape=shape, n_params=params, origin=origin)
