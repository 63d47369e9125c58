"""What the three kinds of recipe file share: the model they name, the Transformers optimizer and attention names
(TRL and axolotl hand theirs to Transformers' Trainer), LoRA's target modules, and the trick set built key by key."""

from __future__ import annotations

from pathlib import Path

from .ledger import KeyLedger

# transformers src/transformers/training_args.py @ fd798335c275 (OptimizerNames, and Trainer.get_optimizer_cls_and_
# kwargs): each `optim` as (--optimizer, --optimizer-impl, what memcalc leaves out of it). adamw_torch is
# torch.optim.AdamW, foreach by default on CUDA; adamw_torch_fused its fused kernel (the Trainer's default since
# torch 2.8); the bitsandbytes names bnb.optim.AdamW (8 or 32 bits, paged or not: a paged state lives in unified
# memory, which memcalc counts apart from the GPU's). adamw_hf (Transformers 4's own AdamW, a loop over the tensors)
# was removed in 5.
OPTIMS = {
    "adamw_torch": ("adamw", "foreach", ""), "adamw_torch_fused": ("adamw", "fused", ""),
    "adamw_hf": ("adamw", "loop", ""), "adamw_bnb_8bit": ("adam8bit", "loop", ""), "adamw_8bit": ("adam8bit", "loop", ""),
    "paged_adamw_8bit": ("paged-adam8bit", "loop", ""), "paged_adamw_32bit": ("paged-adamw", "loop", ""),
    "paged_adamw": ("paged-adamw", "loop", ""),
    "sgd": ("sgd", "foreach", "memcalc's sgd keeps a momentum buffer; torch.optim.SGD keeps none "
                              "unless optim_args sets momentum"),  # fmt: skip
}  # fmt: skip
ATTENTION_FLASH = {"flash_attention_2": True, "flash_attention_3": True, "sdpa": True, "flex_attention": True,
                   "eager": False}  # fmt: skip
LORA_NAMES = {"q": "q", "k": "k", "v": "v", "o": "o", "gate": "gate", "up": "up", "down": "down",
              "output_proj": "o", "w1": "gate", "w2": "down", "w3": "up", "lm_head": "lm_head"}  # fmt: skip


def model_option(ledger: KeyLedger, key: str) -> None:
    """A model named as the libraries take it (from_pretrained's first argument): a Hub id ORG/NAME (--model), a
    folder holding config.json or a config.json (--config), or a memcalc preset's name (--model)."""
    from memcalc.model.hub import is_hub_id
    from memcalc.model.presets import PRESETS

    name = ledger.text(key)
    if name is None:
        return
    if name.strip().lower() in PRESETS or is_hub_id(name):
        ledger.set("model", name, key)
    elif Path(name).is_dir() and (Path(name) / "config.json").is_file():
        ledger.set("config", str(Path(name) / "config.json"), key)
    elif Path(name).is_file():
        ledger.set("config", name, key)
    else:
        ledger.refuse(key, "not a Hub id ORG/NAME, a model folder with a config.json, a config.json or a memcalc "
                           "preset (memcalc presets)")  # fmt: skip


def optimizer_option(ledger: KeyLedger, key: str) -> None:
    """Transformers' `optim` name as --optimizer and --optimizer-impl; one memcalc does not model is refused."""
    name = ledger.text(key)
    if name is None:
        return
    if name.strip().lower() not in OPTIMS:
        known = ", ".join(OPTIMS)
        ledger.refuse(key, f"memcalc models AdamW (32-bit or bitsandbytes' 8-bit) and SGD: {known}")
    optimizer, impl, missing = OPTIMS[name.strip().lower()]
    ledger.set("optimizer", optimizer, key, f"--optimizer {optimizer} --optimizer-impl {impl}")
    ledger.set("optimizer_impl", impl, key, f"--optimizer {optimizer} --optimizer-impl {impl}")
    if missing:
        ledger.caveat(key, missing)


def attention_flash(ledger: KeyLedger, key: str) -> bool | None:
    """attn_implementation: FlashAttention 2/3, SDPA and FlexAttention keep no s x s scores (memcalc's flash);
    eager does. A kernel from the Hub (kernels-community/...) is a flash kernel."""
    name = ledger.text(key)
    if name is None:
        return None
    key_name = name.strip().lower()
    if key_name in ATTENTION_FLASH:
        return ATTENTION_FLASH[key_name]
    if "flash" in key_name:
        return True
    ledger.refuse(key, f"known: {', '.join(ATTENTION_FLASH)}")
    return None


def lora_targets(ledger: KeyLedger, key: str, names: list[str]) -> str:
    """Target modules as --lora-targets: Transformers' projection names (q_proj, ..., down_proj), torchtune's
    (output_proj, w1, w2, w3), lm_head, or all-linear. A module memcalc's LoRA does not wrap (the embeddings, a
    fused qkv) is refused."""
    if [n.strip().lower() for n in names] in (["all-linear"], ["all_linear"]):
        return "all-linear"
    out = []
    for name in names:
        short = name.strip().lower().removesuffix("_proj") if name.strip().lower() != "output_proj" else "output_proj"
        if short not in LORA_NAMES:
            ledger.refuse(key, f"LoRA on {name} is not modelled: memcalc's LoRA wraps the blocks' projections "
                               "(q, k, v, o, gate, up, down) and lm_head")  # fmt: skip
        out.append(LORA_NAMES[short])
    return ",".join(dict.fromkeys(out))


class TrickSet:
    """The one trick set a file describes, part by part, each part from its key (bf16 from `bf16: true`, flash
    from the attention, ckpt from checkpointing, compile from torch.compile) or from the library's default for a
    key the file leaves out (`why` says whose)."""

    def __init__(self) -> None:
        self.parts: list[tuple[str, str, str]] = []

    def add(self, part: str, key: str, why: str = "") -> None:
        self.parts.append((part, key, why))

    def commit(self, ledger: KeyLedger) -> None:
        value = ",".join(part for part, _, _ in self.parts)
        for part, key, why in self.parts:
            if why:
                ledger.default("tricks", value, key, why, f"{part} in --tricks {value}")
            else:
                ledger.set("tricks", value, key, f"{part} in --tricks {value}")


def half_precision(ledger: KeyLedger, bf16_key: str, fp16_key: str, default_bf16: bool = False) -> tuple[str, str]:
    """The precision the Trainer's bf16 and fp16 switch on (the autocast of its step), and the key that chose it
    ('' where neither is on: fp32, or bf16 where the library defaults to it)."""
    bf16, fp16 = ledger.flag(bf16_key), ledger.flag(fp16_key)
    if bf16 and fp16:
        ledger.refuse(fp16_key, f"{bf16_key} and {fp16_key} are both on: the Trainer refuses it too")
    if fp16:
        return "fp16", fp16_key
    if bf16:
        return "bf16", bf16_key
    for key in (bf16_key, fp16_key):
        if ledger.has(key):
            ledger.used(key, "off")
    return ("bf16" if fp16 is None and bf16 is None and default_bf16 else "fp32"), ""


def ckpt_typed_away(typed: dict) -> bool:
    """Whether the user typed --tricks without ckpt over a file that checkpoints: its reentrancy then applies to
    nothing (--reentrant is not set from it)."""
    tricks = typed.get("tricks")
    if not tricks:
        return False
    return not any("ckpt" in t for t in ([tricks] if isinstance(tricks, str) else tricks))


def clipping(ledger: KeyLedger) -> None:
    """max_grad_norm, which the Trainer hands its clipping (memcalc.exact.train.clip, replayed at the default 1.0):
    any positive norm takes the same bytes; 0 turns clipping off, which the replay does not."""
    if not ledger.has("max_grad_norm"):
        return
    norm = ledger.number("max_grad_norm")
    if norm is not None and norm > 0:
        ledger.used("max_grad_norm", "the Trainer's clipping, replayed (its bytes do not depend on the norm)")
    else:
        ledger.unmodelled("max_grad_norm", "no clipping: the replay clips as the default 1.0 does (its partial sums "
                          "and a 0-d norm per gradient)")  # fmt: skip

