"""LoRA and the 4-bit base as a TRL or Transformers file gives them: TRL's ModelConfig keys (what `trl sft --config
FILE` reads beside SFTConfig), a PEFT LoraConfig section (peft_config or lora_config), and the BitsAndBytesConfig
fields of model_init_kwargs.quantization_config.

Sources: huggingface/trl trl/trainer/model_config.py @ v0.25.0 (55f5433e15cc: use_peft, lora_r 16, lora_dropout
0.05, lora_target_modules None, use_dora, lora_modules_to_save, load_in_4bit, load_in_8bit, bnb_4bit_quant_type
nf4, use_bnb_nested_quant False); peft 0.21.2 src/peft/tuners/lora/config.py (LoraConfig: r 8, lora_dropout 0.0,
target_modules None) and src/peft/utils/constants.py (None: the model type's defaults, q_proj and v_proj for
llama, mistral, qwen2 and qwen3, the families memcalc's LoRA runs on).
"""

from __future__ import annotations

from memcalc.model.finetune import SAVABLE

from .common import lora_targets
from .ledger import KeyLedger

PEFT_DEFAULT_TARGETS = "q,v"
DOUBLE_QUANT = ("without double quantisation bitsandbytes keeps an fp32 absmax per 64 weights: memcalc counts the "
                "double-quantised 4-bit weights (about 9% fewer bytes of them)")  # fmt: skip
SECTION_IGNORED = ("task_type", "lora_alpha", "use_rslora", "init_lora_weights", "fan_in_fan_out", "inference_mode",
                   "base_model_name_or_path", "revision", "alpha_pattern", "rank_pattern")  # fmt: skip
TRL_IGNORED = ("lora_alpha", "lora_task_type", "use_rslora")


def lora_options(ledger: KeyLedger) -> bool:
    """LoRA from TRL's use_peft and lora_* keys, or from a LoraConfig section; whether LoRA is on."""
    sections = [k for k in ("peft_config", "lora_config") if ledger.has(k)]
    if len(sections) > 1 or sections and ledger.flag("use_peft"):
        given = sections + (["use_peft"] if ledger.flag("use_peft") else [])
        ledger.refuse(given[-1], f"LoRA is set twice ({' and '.join(given)}): keep one")
    if sections:
        return lora_section(ledger, sections[0])
    if not ledger.flag("use_peft"):
        for key in ("use_peft", "lora_r", "lora_dropout", "lora_target_modules", *TRL_IGNORED):
            if ledger.has(key):
                ledger.ignore(key, "use_peft is off: full training")
        return False
    ledger.used("use_peft", "LoRA (TRL's ModelConfig)")
    lora_settings(ledger, "lora_r", 16, "lora_dropout", 0.05, "lora_target_modules", "TRL's ModelConfig")
    dora_option(ledger, "use_dora")
    saved_option(ledger, "lora_modules_to_save")
    refuse_extra(ledger, "lora_target_parameters", "target_parameters")
    for key in TRL_IGNORED:
        if ledger.has(key):
            ledger.ignore(key, "scales or labels the adapters: no memory")
    return True


def lora_section(ledger: KeyLedger, name: str) -> bool:
    """A PEFT LoraConfig written out as a mapping (LoraConfig's own field names)."""
    kind = ledger.text(f"{name}.peft_type")
    if kind is not None and kind.strip().upper() != "LORA":
        ledger.refuse(f"{name}.peft_type", "memcalc replays LoRA and QLoRA, not other PEFT methods")
    lora_settings(ledger, f"{name}.r", 8, f"{name}.lora_dropout", 0.0, f"{name}.target_modules", "LoraConfig's")
    dora_option(ledger, f"{name}.use_dora")
    saved_option(ledger, f"{name}.modules_to_save")
    for key, why in (("target_parameters", "target_parameters"), ("layers_to_transform", "layers_to_transform")):
        refuse_extra(ledger, f"{name}.{key}", why)
    bias = ledger.text(f"{name}.bias")
    if bias is not None and bias.strip().lower() != "none":
        ledger.refuse(f"{name}.bias", "trained biases beside LoRA are not modelled (bias: none)")
    for key in SECTION_IGNORED + ("peft_type", "bias"):
        if ledger.has(f"{name}.{key}"):
            ledger.ignore(f"{name}.{key}", "scales, labels or initialises the adapters: no memory")
    return True


def lora_settings(ledger: KeyLedger, rank_key: str, rank: int, dropout_key: str, dropout: float, targets_key: str,
                  whose: str) -> None:  # fmt: skip
    """--lora, --lora-dropout and --lora-targets from their keys, the library's defaults where absent."""
    if ledger.has(rank_key):
        ledger.set("lora", str(ledger.count(rank_key)), rank_key)
    else:
        ledger.default("lora", str(rank), rank_key, f"{whose} default rank")
    if ledger.has(dropout_key):
        ledger.set("lora_dropout", str(ledger.number(dropout_key)), dropout_key)
    elif dropout:
        ledger.default("lora_dropout", str(dropout), dropout_key, f"{whose} default")
    names = ledger.names(targets_key)
    if names:
        ledger.set("lora_targets", lora_targets(ledger, targets_key, names), targets_key)
    else:
        ledger.default("lora_targets", PEFT_DEFAULT_TARGETS, targets_key, "PEFT's default for Llama and Qwen")


def dora_option(ledger: KeyLedger, key: str) -> None:
    """use_dora (LoraConfig's, TRL's ModelConfig's; axolotl's peft_use_dora): --dora where it is on."""
    if ledger.flag(key):
        ledger.set("dora", True, key, "--dora")
    elif ledger.has(key):
        ledger.used(key, "off")


def saved_option(ledger: KeyLedger, key: str) -> None:
    """modules_to_save (LoraConfig's; TRL's and axolotl's lora_modules_to_save): --modules-to-save, the embedding
    and the head alone (another module trained whole is refused)."""
    names = ledger.names(key) if ledger.has(key) and ledger.raw(key) not in (None, []) else []
    if not names:
        return
    other = [n for n in names if n not in SAVABLE]
    if other:
        ledger.refuse(key, f"modules_to_save {', '.join(other)}: memcalc replays {' and '.join(SAVABLE)} trained whole")
    ledger.set("modules_to_save", ",".join(names), key)


def refuse_extra(ledger: KeyLedger, key: str, what: str) -> None:
    value = ledger.raw(key)
    if ledger.has(key) and value not in (False, [], {}):
        ledger.refuse(key, f"{what} changes what trains and is not modelled: memcalc replays LoRA on the blocks' "
                           "projections alone")  # fmt: skip


def quantize_options(ledger: KeyLedger, lora: bool) -> None:
    """The base in 4 bits (bitsandbytes' nf4: --quantize nf4) from TRL's load_in_4bit or a BitsAndBytesConfig in
    model_init_kwargs; the 8-bit base is refused (its memory depends on the data: docs/finetune.md)."""
    q = "model_init_kwargs.quantization_config"
    four = [k for k in ("load_in_4bit", f"{q}.load_in_4bit") if ledger.flag(k)]
    eight = [k for k in ("load_in_8bit", f"{q}.load_in_8bit") if ledger.flag(k)]
    for key in ("load_in_4bit", "load_in_8bit", f"{q}.load_in_4bit", f"{q}.load_in_8bit"):
        if ledger.has(key) and key not in four + eight:
            ledger.used(key, "off")
    if eight:
        ledger.refuse(eight[0], "bitsandbytes' 8-bit base is not replayed: LLM.int8() multiplies the outlier "
                                "columns in 16 bits, so its memory depends on the data")  # fmt: skip
    if not four:
        return
    if not lora:
        ledger.refuse(four[0], "a 4-bit base trains adapters only: set use_peft (or a peft_config)")
    ledger.set("quantize", "nf4", four[0])
    kind = ledger.text("bnb_4bit_quant_type") or ledger.text(f"{q}.bnb_4bit_quant_type") or "nf4"
    if kind.strip().lower() not in ("nf4", "fp4"):
        ledger.refuse(four[0], f"unknown bnb_4bit_quant_type {kind!r}: nf4 or fp4")
    for key in ("bnb_4bit_quant_type", f"{q}.bnb_4bit_quant_type"):
        if ledger.has(key):
            ledger.used(key, "nf4 and fp4 take the same bytes")
    nested = [k for k in ("use_bnb_nested_quant", f"{q}.bnb_4bit_use_double_quant") if ledger.has(k)]
    if not any(ledger.flag(k) for k in nested):
        ledger.caveat(four[0], DOUBLE_QUANT)
    for key in nested:
        ledger.used(key, "double quantisation" if ledger.flag(key) else "off")
    for key in (f"{q}.bnb_4bit_compute_dtype", f"{q}.bnb_4bit_quant_storage"):
        if ledger.has(key):
            ledger.ignore(key, "memcalc computes in the trick set's dtype and stores the 4 bits as uint8")
