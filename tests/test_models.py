"""Presets against their published parameter counts; config.json reading; shape validation."""

import json
from dataclasses import replace

import pytest

from memcalc.cli.groups import ModelOptions
from memcalc.errors import InputError
from memcalc.model.hfconfig import config_model, shape_from_config
from memcalc.model.params import n_params, param_counts
from memcalc.model.presets import CANONICAL, PRESETS, canonical_shape, preset
from memcalc.model.shape import ModelShape, override
from memcalc.model.sizes import parse_count

EXAMPLES = "examples/configs"

# Exact counts: the HF checkpoints' tensors (safetensors total_size / 2 for bf16 checkpoints).
EXACT = {
    "gpt2": 124_439_808,  # Radford et al. 2019, HF gpt2
    "gpt2-medium": 354_823_168,  # HF gpt2-medium
    "gpt2-large": 774_030_080,  # HF gpt2-large
    "gpt2-xl": 1_557_611_200,  # HF gpt2-xl
    "llama3-8b": 8_030_261_248,  # Meta-Llama-3-8B
    "llama3-70b": 70_553_706_496,  # Meta-Llama-3-70B
    "llama3.1-8b": 8_030_261_248,  # meta-llama/Llama-3.1-8B
    "llama3.1-70b": 70_553_706_496,  # meta-llama/Llama-3.1-70B
    "llama3.2-1b": 1_235_814_400,  # meta-llama/Llama-3.2-1B
    "llama3.2-3b": 3_212_749_824,  # meta-llama/Llama-3.2-3B (PEFT's MetaMathQA results count the same)
    "llama2-7b": 6_738_415_616,  # meta-llama/Llama-2-7b-hf
    "llama2-13b": 13_015_864_320,  # meta-llama/Llama-2-13b-hf
    "llama2-70b": 68_976_648_192,  # meta-llama/Llama-2-70b-hf
    "qwen3-8b": 8_190_735_360,  # Qwen3-8B
    "mistral-7b": 7_241_732_096,  # mistralai/Mistral-7B-v0.1
    "qwen2.5-7b": 7_615_616_512,  # Qwen/Qwen2.5-7B (the model card's 7.61B)
    "gemma-7b": 8_537_680_896,  # google/gemma-7b
    "gemma2-9b": 9_241_705_984,  # google/gemma-2-9b
    "olmo2-7b": 7_298_617_344,  # allenai/OLMo-2-1124-7B
    "phi3-mini": 3_821_079_552,  # microsoft/Phi-3-mini-4k-instruct
    "pythia-6.9b": 6_857_302_016,  # EleutherAI/pythia-6.9b
}
# Counts published only to 0.1B, (total, non-embedding) from the Qwen3 model cards.
ROUNDED = {
    "qwen3-0.6b": (0.6, 0.44),
    "qwen3-1.7b": (1.7, 1.4),
    "qwen3-4b": (4.0, 3.6),
    "qwen3-14b": (14.8, 13.2),
    "qwen3-32b": (32.8, 31.2),
}


@pytest.mark.parametrize("name,count", EXACT.items())
def test_exact_published_counts(name, count):
    assert n_params(preset(name)) == count


@pytest.mark.parametrize("name,published", ROUNDED.items())
def test_rounded_published_counts(name, published):
    counts = param_counts(preset(name))
    non_embedding = counts.total - counts.embedding - counts.lm_head
    digits = 2 if published[1] < 1 else 1
    assert (round(counts.total / 1e9, 1), round(non_embedding / 1e9, digits)) == published


def test_gpt3_175b():
    # Brown et al. 2020, Table 2.1 publishes only "175.0B"; the layers alone are 12·L·h² = 173.9B
    total = n_params(preset("gpt3-175b"))
    assert total == pytest.approx(175.0e9, rel=0.003)
    assert param_counts(preset("gpt3-175b")).per_layer == 12 * 12288**2 + 13 * 12288


def test_llama31_405b():
    # Dubey et al. 2024 (Llama 3), Table 3: 405B
    assert round(n_params(preset("llama3.1-405b")) / 1e9) == 406  # 405.85B: "405B" is truncated


def test_canonical_table_is_monotone_and_nearest():
    sizes = [n_params(PRESETS[k]) for k in CANONICAL]
    assert sizes == sorted(sizes)
    assert canonical_shape(8_000_000_000).name == "qwen3-8b"
    assert canonical_shape(70_000_000_000).name == "llama3-70b"
    assert canonical_shape(175_000_000_000).name == "gpt3-175b"


def test_unknown_preset_lists_known():
    with pytest.raises(InputError, match="known: gpt2"):
        preset("gpt5")


@pytest.mark.parametrize("kwargs,message", [
    (dict(n_layers=0, hidden=64, n_heads=4), "n_layers must be positive"),
    (dict(n_layers=2, hidden=100, n_heads=3), "must divide hidden"),
    (dict(n_layers=2, hidden=64, n_heads=4, n_kv_heads=3), "must divide heads"),
    (dict(n_layers=2, hidden=64, n_heads=4, norm="batchnorm"), "unknown norm"),
    (dict(n_layers=2, hidden=1 << 30, n_heads=4), "absurdly large"),
    (dict(n_layers=2.5, hidden=64, n_heads=4), "whole number"),
])  # fmt: skip
def test_shape_validation(kwargs, message):
    with pytest.raises(InputError, match=message):
        ModelShape(**kwargs)


def test_override_rederives_head_dim_and_kv():
    gpt = preset("gpt2-medium")
    wider = override(gpt, hidden=2048, n_heads=32)
    assert (wider.head_dim, wider.n_kv_heads, wider.ffn) == (64, 32, 8192)
    qwen = preset("qwen3-8b")
    more_layers = override(qwen, n_layers=4)
    assert (more_layers.head_dim, more_layers.n_kv_heads, more_layers.ffn) == (128, 8, 12288)
    assert override(qwen) is qwen


@pytest.mark.parametrize("text,value", [("8e9", 8_000_000_000), ("8B", 8_000_000_000), ("70b", 70_000_000_000),
                                        ("1.5M", 1_500_000), ("8192", 8192), ("8k", 8000), ("1_024", 1024)])  # fmt: skip
def test_parse_count(text, value):
    assert parse_count(text, "x", 1e15) == value


@pytest.mark.parametrize("text,message", [("0", "positive"), ("-5", "positive"), ("nan", "finite"), ("inf", "finite"),
                                          ("abc", "a number"), ("1.5", "whole"), ("1e30", "absurdly")])  # fmt: skip
def test_parse_count_rejects(text, message):
    with pytest.raises(InputError, match=message):
        parse_count(text, "x", 1e15)


@pytest.mark.parametrize("name,preset_name", [("llama3-8b", "llama3-8b"), ("qwen3-8b", "qwen3-8b"),
                                              ("gpt2-medium", "gpt2-medium")])  # fmt: skip
def test_example_configs_match_presets(name, preset_name):
    model = config_model(f"{EXAMPLES}/{name}.json")
    assert model.n_params == n_params(preset(preset_name))
    got, want = model.shape, preset(preset_name)
    for field in ("n_layers", "hidden", "n_heads", "n_kv_heads", "head_dim", "ffn", "gated_mlp", "norm",
                  "vocab", "tied_embeddings", "qk_norm", "positions"):  # fmt: skip
        assert getattr(got, field) == getattr(want, field), field


FAMILIES = [("mistral-7b", "mistral-7b"), ("qwen2.5-7b", "qwen2.5-7b"), ("gemma2-9b", "gemma2-9b"), ("gemma3-4b-text", "gemma3-4b"),
            ("olmo2-7b", "olmo2-7b"), ("phi3-mini-4k", "phi3-mini"), ("pythia-6.9b", "pythia-6.9b")]


@pytest.mark.parametrize("name,preset_name", FAMILIES)
def test_family_configs_read_as_their_presets(name, preset_name):
    """Each family's config.json (the Hub repo's fields) is its preset, field for field: the architecture's
    fixed fields (sandwich or post norms, q/k norms, GPT-NeoX's LayerNorm and biases) and the config's
    choices (softcaps, window and the layers it spares, partial rotary, the parallel residual)."""
    assert config_model(f"{EXAMPLES}/{name}.json").shape == replace(preset(preset_name), name=f"{name}.json")


@pytest.mark.parametrize("edit,expected", [
    ({}, tuple(range(1, 42, 2))),  # configuration_gemma2.py: every second layer full
    ({"layer_types": ["full_attention"] * 2 + ["sliding_attention"] * 40}, (0, 1)),
    ({"sliding_window": None}, ()),
])  # fmt: skip
def test_window_layers_from_the_config(edit, expected):
    config = {**json.loads(open(f"{EXAMPLES}/gemma2-9b.json").read()), **edit}
    shape = shape_from_config(config)
    assert shape.global_layers == expected and shape.sliding_window == (4096 if edit.get("sliding_window", 1) else 0)


def test_family_defaults_where_the_config_is_silent():
    """The configuration classes' defaults: Gemma 2's softcaps 50 and 30, Mistral's window 4096, GPT-NeoX's
    rotary_pct 0.25 and parallel residual; Gemma 3's window pattern 6; Qwen2's window only with
    use_sliding_window, below max_window_layers full."""
    sizes = {"hidden_size": 256, "num_hidden_layers": 12, "num_attention_heads": 4, "vocab_size": 100,
             "intermediate_size": 512}  # fmt: skip
    gemma2 = shape_from_config({**sizes, "model_type": "gemma2"})
    assert (gemma2.attn_softcap, gemma2.logit_softcap, gemma2.sliding_window) == (50.0, 30.0, 4096)
    assert shape_from_config({**sizes, "model_type": "mistral"}).sliding_window == 4096
    assert shape_from_config({**sizes, "model_type": "mistral", "sliding_window": None}).sliding_window == 0
    neox = shape_from_config({**sizes, "model_type": "gpt_neox"})
    assert (neox.rotary_fraction, neox.parallel_residual, neox.rope_dim, neox.gated_mlp) == (0.25, True, 16, False)
    assert shape_from_config({**sizes, "model_type": "gemma3_text"}).global_layers == (5, 11)
    assert shape_from_config({**sizes, "model_type": "qwen2"}).sliding_window == 0
    qwen2 = shape_from_config({**sizes, "model_type": "qwen2", "use_sliding_window": True, "max_window_layers": 8})
    assert (qwen2.sliding_window, qwen2.global_layers) == (4096, tuple(range(8)))
    assert shape_from_config({**sizes, "model_type": "phi3"}).sliding_window == 0


@pytest.mark.parametrize("model_type,reason", [("gemma3", "vision-language"), ("qwen2_vl", "vision-language"),
                                               ("llama4", "chunked attention"), ("gpt_oss", "attention sinks"),
                                               ("qwen3_next", "DeltaNet"), ("mistral3", "Pixtral")])  # fmt: skip
def test_refused_model_types_say_why(model_type, reason):
    with pytest.raises(InputError, match=f"model_type '{model_type}' is not supported: .*{reason}"):
        shape_from_config({"model_type": model_type, "hidden_size": 8})


def test_gated_mlp_comes_from_the_architecture_not_the_ratio():
    base = {"hidden_size": 1024, "num_hidden_layers": 2, "num_attention_heads": 16, "vocab_size": 1000,
            "intermediate_size": 4096}  # fmt: skip
    assert shape_from_config({**base, "model_type": "llama"}).gated_mlp  # 4h, yet gated
    plain = {"n_embd": 1024, "n_layer": 2, "n_head": 16, "vocab_size": 1000, "n_positions": 64}
    assert not shape_from_config({**plain, "model_type": "gpt2", "n_inner": 2730}).gated_mlp  # 8/3 h, yet plain


@pytest.mark.parametrize("content,message", [
    ("{", "not valid JSON"),
    ("[1, 2]", "must hold a JSON object"),
    ('{"model_type": "llama"}', "has no 'hidden_size'"),
    ('{"model_type": "bert", "hidden_size": 8}', "unknown model_type 'bert'"),
    ('{"model_type": "qwen2_moe", "num_experts": 60}', "mixture-of-experts model_type 'qwen2_moe' is not supported"),
    ('{"model_type": "llama", "n_routed_experts": 8}', "mixture-of-experts model_type 'llama' is not supported"),
    ('{"model_type": "qwen3_moe"}', "has no 'hidden_size'"),
    ('{"model_type": "llama", "hidden_size": "big", "num_hidden_layers": 2, "num_attention_heads": 2, '
     '"vocab_size": 8, "intermediate_size": 8}', "must be a whole number"),
])  # fmt: skip
def test_bad_configs(tmp_path, content, message):
    path = tmp_path / "config.json"
    path.write_text(content)
    with pytest.raises(InputError, match=message):
        config_model(path)


def test_missing_config():
    with pytest.raises(InputError, match="not found"):
        config_model("no/such/config.json")


def test_model_options_rules(tmp_path):
    assert ModelOptions(params="8e9", layers="4").resolve().shape.n_layers == 4
    assert ModelOptions(params="8e9", layers="4").resolve().n_params == 8_000_000_000  # N stays as given
    assert ModelOptions(model="llama3-8b", layers="16").resolve().n_params < 8_030_261_248
    custom = ModelOptions(layers="2", hidden="256", heads="4").resolve()
    assert custom.n_params == n_params(custom.shape)
    with pytest.raises(InputError, match="give one of"):
        ModelOptions(params="8e9", model="gpt2").resolve()
    with pytest.raises(InputError, match="say which model"):
        ModelOptions().resolve()
    cfg = tmp_path / "c.json"
    cfg.write_text(json.dumps({"model_type": "gpt2", "n_embd": 64, "n_layer": 2, "n_head": 4, "vocab_size": 100,
                               "n_positions": 32}))  # fmt: skip
    assert ModelOptions(config=str(cfg)).resolve().shape.max_positions == 32
