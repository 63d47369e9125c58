"""Turn what the user typed into engine inputs: the model, its shape overrides, the trick sets, the step,
the layout, the time model, the run; and the output's format and units. One InputError line for each
thing that cannot be."""

from __future__ import annotations

import math
import sys
from dataclasses import replace

import typer

from memcalc.errors import InputError, subject
from memcalc.model.presets import MAX_PARAMS, PRESETS, canonical_model, gpt, preset_model
from memcalc.model.shape import MAX_SIZE, Model, longest_seq, n_params, override, parse_count
from memcalc.model.tricks import PROGRESSION, Tricks, parse_tricks, trick_warnings
from memcalc.report import render


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
        from memcalc.model.hfconfig import config_model, hub_model  # here: only these read a config.json
        from memcalc.model.hub import is_hub_id

        if model:
            base = hub_model(model) if model.strip().lower() not in PRESETS and is_hub_id(model) else preset_model(model)
        else:
            base = hub_model(config) if is_hub_id(config) else config_model(config)
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


def resolve_tricks(texts: list[str] | None, gpu=None, default: str | None = None) -> tuple[tuple[Tricks, ...], list[str]]:
    """Each --tricks picks one combination (repeated: several, in the order given, each once); without it,
    the command's default (None: estimate's progression fp32 -> ... -> bf16+selective), fp16 in place of
    bf16 on a card without bf16 tensor cores (V100, T4; a bf16 named there is refused: check_precision),
    without fp32 on a card whose --gpu file gives no fp32 rate. With what every command says on stderr once
    its input is good (warn): what the card's file left out (GPU.derived), that switch, and
    memcalc.model.tricks.trick_warnings."""
    said = [f"{gpu.key} ({gpu.name}): {gpu.derived}"] if gpu is not None and gpu.derived else []
    if texts:
        sets = tuple(dict.fromkeys(parse_tricks(text) for text in texts))
    else:
        sets = (parse_tricks(default),) if default else PROGRESSION
        if gpu is not None:
            sets, switched = default_on(gpu, sets)
            said += switched
    return sets, said + [w for t in sets for w in trick_warnings(t)]


def default_on(gpu, sets: tuple[Tricks, ...]) -> tuple[tuple[Tricks, ...], list[str]]:
    """A default's trick sets as the card runs them: fp16 in place of bf16 where it has no bf16 tensor cores,
    and only those it has a peak for (a --gpu file may give no fp32 or fp16 rate; with none left, the sets as
    they were, for check_precision to refuse in one line). With the switch said."""
    from memcalc.model.gpus import half_precision

    said, half = [], half_precision(gpu)
    if half != "bf16" and gpu.peak_flops(half) and any(t.precision == "bf16" for t in sets):
        sets = tuple(replace(t, precision=half) if t.precision == "bf16" else t for t in sets)
        said.append(f"the {gpu.name} has no bf16 tensor cores (Volta, Turing): fp16 in place of bf16 in the default "
                    "tricks; --tricks names others")  # fmt: skip
    return tuple(t for t in sets if gpu.peak_flops(t.precision)) or sets, said


def resolve_gpu(spec: str, memory: str | None = None, headroom: str | None = None):
    """--gpu KEY or FILE.json, --gpu-memory, --headroom: the card, checked whole here (its links, what its
    headroom leaves) so that a bad file or flag is one line before anything is computed."""
    from memcalc.model.gpus import find_gpu
    from memcalc.model.headroom import headroom as headroom_of
    from memcalc.parallel.links import fabric_of

    card = find_gpu(spec, memory, headroom)
    fabric_of(card)
    headroom_of(card)
    return card



def fail(message: str) -> None:
    """Bad input: one line on stderr, exit code 2."""
    print(f"error: {message}", file=sys.stderr)
    raise typer.Exit(2)


def warn(lines) -> None:
    """What the user should know beside the answer, each line once on stderr (stdout stays the answer)."""
    for line in dict.fromkeys(lines):
        print(f"warning: {line}", file=sys.stderr)


def check_format(fmt: str) -> str:
    key = fmt.strip().lower()
    if key not in render.FORMATS:
        raise InputError(f"unknown format {fmt!r}; choose {', '.join(render.FORMATS)}")
    return key


def build_routing(model, capacity_factor: str | None, imbalance: str | None):
    """--capacity-factor and --expert-imbalance: the routing assumption of a mixture-of-experts model."""
    from memcalc.model.moe import BALANCED, Routing

    if capacity_factor is None and imbalance is None:
        return BALANCED
    if not model.shape.is_moe:
        given = [f for f, v in (("--capacity-factor", capacity_factor), ("--expert-imbalance", imbalance)) if v is not None]
        raise InputError(f"{subject(given, 'describes', 'describe')} how a mixture of experts routes tokens; "
                         f"{model.shape.name} has no experts")  # fmt: skip
    cf = None if capacity_factor is None else parse_positive(capacity_factor, "capacity-factor")
    x = 1.0 if imbalance is None else parse_positive(imbalance, "expert-imbalance")
    return Routing(cf, x)


def build_setup(seq, micro_batch, grad_accum, optimizer, mfu, host_memory="2T", stack=None, recipe=None, impl=None,
                routing=None, no_cache=False, finetune=None):  # fmt: skip
    from memcalc.memory.estimate import MAX_HOST_BYTES, Setup
    from memcalc.memory.state import OPTIMIZERS
    from memcalc.model.moe import BALANCED
    from memcalc.model.shape import MAX_BATCH, parse_count, parse_seq

    if optimizer.strip().lower() not in OPTIMIZERS:
        raise InputError(f"unknown optimizer {optimizer!r}; known: {', '.join(OPTIMIZERS)}")
    return Setup(
        seq_len=parse_seq(seq),
        micro_batch=parse_count(micro_batch, "micro-batch", MAX_BATCH),
        grad_accum=parse_count(grad_accum, "grad-accum", MAX_BATCH),
        optimizer=optimizer.strip().lower(),
        mfu=parse_fraction(mfu, "mfu"),
        host_memory=parse_count(host_memory, "host-memory", MAX_HOST_BYTES),
        stack=finetune_stack(stack, recipe, impl, no_cache, finetune),
        routing=routing or BALANCED,
    )


def finetune_stack(stack, recipe, impl, no_cache, finetune):
    """--stack with --lora or --freeze (finetune: those options as given, memcalc.model.finetune.finetune_for):
    PEFT and frozen weights are replayed on Transformers' classes, so hf is the default there and any other
    stack is refused; without them, reference is the default."""
    from dataclasses import replace

    from memcalc.model.finetune import finetune_for
    from memcalc.model.stacks import stack_for

    finetune = finetune_for(*(finetune or ()))
    chosen = stack_for(stack or ("reference" if finetune.trains_all else "hf"), recipe, impl, no_cache)
    if finetune.trains_all:
        return chosen
    if chosen.model != "hf":
        raise InputError(f"{finetune.label}: PEFT's LoRA and frozen weights are replayed on Transformers' classes "
                         f"(--stack hf), not --stack {chosen.key}")  # fmt: skip
    return replace(chosen, finetune=finetune)


def parse_positive(text: str, name: str, most: float = math.inf) -> float:
    """A finite number in (0, most]: --mfu and --tol are fractions (most 1), times and rates are not."""
    from memcalc.model.jsonfile import brief

    try:
        value = float(text)  # a number past a double's range is inf (refused below), below it 0.0
    except ValueError:
        raise InputError(f"{name} must be a number, got {brief(text)}") from None
    if not (0 < value <= most and math.isfinite(value)):  # also rejects nan
        kind = "a fraction in (0, 1]" if most == 1 else "a positive number"
        raise InputError(f"{name} must be {kind}, got {brief(text)}")
    return value


def parse_fraction(text: str, name: str) -> float:
    return parse_positive(text, name, most=1)


def parse_run(tokens: str | None, price: str | None) -> tuple[int, float | None] | None:
    """--tokens N [--price-per-gpu-hour X]: the length (and price) of the whole run, or None."""
    from memcalc.model.shape import parse_count
    from memcalc.time.training_run import MAX_TOKENS

    if tokens is None:
        if price is not None:
            raise InputError("--price-per-gpu-hour needs --tokens (the length of the run)")
        return None
    return parse_count(tokens, "tokens", MAX_TOKENS), None if price is None else parse_positive(price, "price-per-gpu-hour")


def roofline_calibration(gpu, spec: str | None):
    """--calibration SPEC: a JSON file, NAME=X overrides, or both (file first), comma-separated. A card whose
    --gpu file leaves out a rate the roofline needs is timed end to end at the default MFU instead (as plan
    times a shape it cannot trace), its GPU.derived saying so."""
    from memcalc.memory.setup import DEFAULT_MFU
    from memcalc.model.gpus import roofline_gaps
    from memcalc.time.calibration import calibration_for

    gaps = roofline_gaps(gpu)
    if gaps and spec:
        raise InputError(f"--calibration tunes the roofline, which needs the card's {' and '.join(gaps)}: its --gpu "
                         "file does not give them; add them to the file, or drop --calibration")  # fmt: skip
    if gaps:
        return DEFAULT_MFU

    items = [x.strip() for x in (spec or "").split(",") if x.strip()]
    paths, overrides = [x for x in items if "=" not in x], [x for x in items if "=" in x]
    if len(paths) > 1:
        raise InputError(f"--calibration takes one file, got {', '.join(paths)}")
    return calibration_for(gpu.key, paths[0] if paths else None, ",".join(overrides) or None)


def build_layout(gpus, tp=None, pp=None, cp=None, dp=None, zero="0", sp=False, vpp=None, hybrid=False, offload=False,
                 offload_params=False, gpus_per_node=None, pp_layers=None, reshard=None, ep=None, etp=None):  # fmt: skip
    from memcalc.memory.state import MAX_GPUS
    from memcalc.model.shape import parse_count
    from memcalc.model.layout import layout_for

    def count(text, name, default):
        return default if text is None else parse_count(text, name, MAX_GPUS)

    if zero.strip() not in ("0", "1", "2", "3"):
        raise InputError(f"zero stage must be 0, 1, 2 or 3, got {zero!r}")
    ends = (pp_layers or "0,0").split(",")
    if len(ends) != 2:
        raise InputError(f"--pp-layers takes FIRST,LAST (0 leaves one to the split), got {pp_layers!r}")
    first, last = (parse_count(x, "pp-layers", MAX_GPUS) if x.strip() not in ("", "0") else 0 for x in ends)
    return layout_for(
        gpus=count(gpus, "gpus", None), tp=count(tp, "tp", 1), pp=count(pp, "pp", 1), cp=count(cp, "cp", 1),
        dp=count(dp, "dp", None), zero=int(zero), sp=sp, vpp=count(vpp, "vpp", 1), hybrid=hybrid,
        offload_optimizer=offload or offload_params, offload_params=offload_params,
        gpus_per_node=count(gpus_per_node, "gpus-per-node", 8), first_layers=first, last_layers=last,
        reshard_after_forward=reshard, ep=count(ep, "ep", 1), etp=count(etp, "etp", 1),
    )  # fmt: skip


def render_units(units: str) -> str:
    from memcalc.report.units import check_units

    return check_units(units)
