"""Turn what the user typed into engine inputs: the model, its shape overrides, the trick sets."""

from __future__ import annotations

from dataclasses import replace

from memcalc.errors import InputError
from memcalc.model.hfconfig import config_model
from memcalc.model.presets import MAX_PARAMS, canonical_model, gpt, preset_model
from memcalc.model.shape import MAX_SIZE, Model, longest_seq, n_params, override, parse_count
from memcalc.model.tricks import PROGRESSION, Tricks, parse_tricks


def optional_count(text: str | None, name: str, limit: float = float(MAX_SIZE)) -> int | None:
    return None if text is None else parse_count(text, name, limit)


def resolve_model(
    params: str | None = None,
    model: str | None = None,
    config: str | None = None,
    layers: str | None = None,
    hidden: str | None = None,
    heads: str | None = None,
    kv_heads: str | None = None,
    ffn: str | None = None,
    vocab: str | None = None,
) -> Model:
    """--params N | --model NAME | --config PATH, then --layers --hidden --heads --kv-heads --ffn --vocab.

    With --params the parameter count stays N whatever the overrides; otherwise it is the shape's own.
    With none of the three, --layers, --hidden and --heads describe a GPT-style model.
    """
    chosen = [flag for flag, value in (("--params", params), ("--model", model), ("--config", config)) if value]
    if len(chosen) > 1:
        raise InputError(f"give one of --params, --model, --config, not {' and '.join(chosen)}")
    sizes = {
        "n_layers": optional_count(layers, "layers"),
        "hidden": optional_count(hidden, "hidden"),
        "n_heads": optional_count(heads, "heads"),
        "n_kv_heads": optional_count(kv_heads, "kv-heads"),
        "ffn": optional_count(ffn, "ffn"),
        "vocab": optional_count(vocab, "vocab"),
    }
    if params:
        base = canonical_model(parse_count(params, "params", MAX_PARAMS))
        return Model(override(base.shape, **sizes), base.n_params, base.origin + overrides_note(sizes))
    if model or config:
        base = preset_model(model) if model else config_model(config)
        shape = override(base.shape, **sizes)
        return Model(shape, n_params(shape), base.origin + overrides_note(sizes))
    if None in (sizes["n_layers"], sizes["hidden"], sizes["n_heads"]):
        raise InputError("say which model: --params N, --model NAME, --config PATH, or --layers --hidden --heads")
    base = gpt("custom", sizes["n_layers"], sizes["hidden"], sizes["n_heads"], 0)
    shape = replace(base, **{k: v for k, v in sizes.items() if v is not None})
    origin = "custom GPT-style shape from --layers --hidden --heads (GPT-2/3 layer, no position table)"
    return Model(shape, n_params(shape), origin)


DEFAULT_SEQ = 4096


def seq_for(seq: str | None, model: Model | None) -> str:
    """--seq as given; without it 4096 tokens, or the model's learned position table where that is shorter
    (GPT-2: 1,024), so that `--model gpt2` runs as it is."""
    if seq is not None:
        return seq
    return str(DEFAULT_SEQ if model is None else min(DEFAULT_SEQ, longest_seq(model.shape)))


def overrides_note(sizes: dict[str, int | None]) -> str:
    given = ", ".join(f"{k} {v}" for k, v in sizes.items() if v is not None)
    return f", overridden: {given}" if given else ""


def resolve_tricks(text: str | None) -> tuple[Tricks, ...]:
    """--tricks picks one combination; without it, the progression fp32 -> ... -> bf16+selective."""
    return PROGRESSION if text is None else (parse_tricks(text),)
