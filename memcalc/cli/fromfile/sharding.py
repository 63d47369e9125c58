"""FSDP and DeepSpeed as a Trainer's arguments (and axolotl's, which hands them to it) give them: memcalc's ZeRO
stage over the job's GPUs (--zero, --offload, --offload-params, --hybrid). How many GPUs is the launcher's
(torchrun, accelerate), never the file's: a sharded recipe needs --gpus N. LoRA under DeepSpeed ZeRO is memcalc's
ZeRO replay with the base frozen (memcalc.exact.replay.zero); LoRA under FSDP is refused, naming the key, unless
--zero is typed: memcalc replays FSDP2 over PEFT's model as --stack fsdp2 --zero 3, which the file's stack is not.

transformers src/transformers/training_args.py @ fd798335c275 (fsdp: True or a string of FSDPOption,
trainer_utils.py: full_shard, shard_grad_op, hybrid_shard, hybrid_shard_zero2, no_shard, offload, auto_wrap;
fsdp_config: version, cpu_offload, reshard_after_forward); axolotl src/axolotl/utils/schemas/config.py @
067b021c8b87 (fsdp: a list of the same, fsdp_config with fsdp_-prefixed keys, fsdp_version); DeepSpeed's config
(zero_optimization.stage, offload_optimizer.device, offload_param.device).
"""

from __future__ import annotations

from pathlib import Path

from memcalc.errors import InputError
from memcalc.model.jsonfile import read_json_object

from .ledger import KeyLedger

FSDP_TOKENS = {"full_shard": ("3", False), "shard_grad_op": ("2", False), "hybrid_shard": ("3", True),
               "hybrid_shard_zero2": ("2", True), "no_shard": ("0", False)}  # fmt: skip
GPUS_NEEDED = "sharding splits the state over the job's GPUs, which the launcher sets, not the file: add --gpus N"
LORA_SHARDED = ("LoRA and QLoRA under FSDP: memcalc replays FSDP2 over PEFT's model as --stack fsdp2 --zero 3 "
                "--gpus N (accelerate's fully_shard per decoder layer); type --zero to say how the file's stack "
                "shards")  # fmt: skip


def fsdp_options(ledger: KeyLedger, key: str, config_key: str, lora: bool, config_alone: bool = False) -> None:
    """`fsdp` (true, a string or a list of FSDPOption) and its `fsdp_config` as --zero, --hybrid, --offload-params;
    with config_alone (axolotl) an `fsdp_config` without `fsdp` turns FSDP on by itself."""
    config = ledger.section(config_key) or {}
    if ledger.raw(key) not in (None, False, "", []) and ledger.has(key):
        tokens, source = fsdp_tokens(ledger, key, ledger.raw(key)), key
    elif config_alone and config:
        strategy = str(config.get("fsdp_sharding_strategy", config.get("sharding_strategy", "full_shard")))
        tokens, source = [strategy.strip().lower()], config_key
    else:
        return
    stage, hybrid = "3", False
    for token in tokens:
        if token in FSDP_TOKENS:
            stage, hybrid = FSDP_TOKENS[token]
        elif token not in ("offload", "auto_wrap"):
            ledger.refuse(source, f"unknown FSDP option {token!r}; known: {', '.join(FSDP_TOKENS)}, offload, auto_wrap")
    if str(config.get("reshard_after_forward", config.get("fsdp_reshard_after_forward", True))).lower() == "false":
        stage = "2" if stage == "3" else stage  # FSDP2 keeps the gathered weights between forward and backward
    if lora and stage != "0":
        ledger.refuse_unless(("zero",), source, LORA_SHARDED)
    ledger.set("zero", stage, source)
    if hybrid:
        ledger.set("hybrid", True, source, "--hybrid")
    if "offload" in tokens or offloads(config):
        ledger.set("offload_params", True, source if "offload" in tokens else config_key, "--offload-params")
    if config and config_key not in ledger.uses:
        ledger.unmodelled(config_key, "FSDP's wrapping and prefetch: memcalc's ZeRO layout shards block by block")
    if stage != "0":
        ledger.refuse_unless(("gpus", "zero"), source, GPUS_NEEDED, replaces=False)


def fsdp_tokens(ledger: KeyLedger, key: str, value: object) -> list[str]:
    if value is True:
        return ["full_shard"]  # Transformers 5: fsdp=True is FSDP2 resharding after forward
    if isinstance(value, str):
        return [t.strip().lower() for t in value.split() if t.strip()]
    return [t.strip().lower() for t in (ledger.names(key) or [])]


def offloads(config: dict) -> bool:
    return any(str(config.get(k, False)).lower() == "true" for k in ("cpu_offload", "fsdp_offload_params",
                                                                       "offload_params"))  # fmt: skip


def deepspeed_options(ledger: KeyLedger, key: str, recipe_dir: Path) -> None:
    """`deepspeed`: a DeepSpeed config (a path, read relative to here or to the recipe's folder, or the mapping
    itself) as --zero, --offload, --offload-params."""
    value = ledger.raw(key)
    if not ledger.has(key):
        return
    if isinstance(value, str):
        config = read_deepspeed(ledger, key, value, recipe_dir)
    elif isinstance(value, dict):
        config = value
    else:
        ledger.refuse(key, "a DeepSpeed config: a path to its JSON, or the mapping")
    if config is None:
        return
    zero = config.get("zero_optimization") or {}
    stage = zero.get("stage", 0) if isinstance(zero, dict) else None
    if stage not in (0, 1, 2, 3):
        ledger.refuse(key, f"zero_optimization.stage must be 0, 1, 2 or 3, not {stage!r}")
    ledger.set("zero", str(stage), key)  # with LoRA too: the frozen base sharded at stage 3 (memcalc.exact.replay.zero)
    if device_of(zero.get("offload_param")):
        ledger.set("offload_params", True, key, "--offload-params")
    elif device_of(zero.get("offload_optimizer")):
        ledger.set("offload", True, key, "--offload")
    if stage:
        ledger.refuse_unless(("gpus", "zero"), key, GPUS_NEEDED, replaces=False)


def read_deepspeed(ledger: KeyLedger, key: str, name: str, recipe_dir: Path) -> dict | None:
    """The DeepSpeed JSON a path names; where it is not found, --zero typed decides in its place."""
    for path in (Path(name), recipe_dir / name):
        if path.is_file():
            try:
                return read_json_object(path, "DeepSpeed config")
            except InputError as e:
                ledger.refuse(key, str(e))
    ledger.refuse_unless(("zero",), key, "DeepSpeed config not found (memcalc reads its zero_optimization.stage): "
                                      "give its path, or --zero STAGE --gpus N")  # fmt: skip
    return None


def device_of(section: object) -> bool:
    """Whether a DeepSpeed offload section moves its tensors off the GPU (device cpu or nvme)."""
    return isinstance(section, dict) and str(section.get("device", "none")).lower() in ("cpu", "nvme")
