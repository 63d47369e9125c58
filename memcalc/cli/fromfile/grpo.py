"""TRL's GRPOConfig in a TRL arguments file (`trl grpo --config FILE`), read where --rl grpo is typed beside --from
(and RLOOConfig's, the same keys, under --rl rloo):
the keys GRPOConfig adds to TrainingArguments (huggingface/trl trl/trainer/grpo_config.py in the trl 1.16.0 wheel),
as memcalc.exact.hf.grpo and memcalc.engine.rollout replay GRPOTrainer. The rest of the file (the batch, bf16,
checkpointing, PEFT) is read as for SFTConfig (memcalc.cli.fromfile.trainer). GRPOConfig has no prompt length
(TRL 1.x does not truncate prompts): --seq is typed, the prompt and the completion together.
"""

from __future__ import annotations

from .ledger import KeyLedger

# keys GRPOConfig has and neither TrainingArguments nor SFTConfig has: the file is a GRPOConfig
GRPO_KEYS = ("num_generations", "max_completion_length", "use_vllm", "vllm_mode", "vllm_gpu_memory_utilization",
             "vllm_enable_sleep_mode", "vllm_max_model_length", "vllm_tensor_parallel_size", "steps_per_generation",
             "generation_batch_size", "num_iterations", "epsilon", "epsilon_high", "importance_sampling_level",
             "top_entropy_quantile", "scale_rewards", "reward_weights", "mask_truncated_completions",
             "vllm_importance_sampling_correction", "vllm_importance_sampling_mode", "cast_lm_head_to_fp32",
             "off_policy_mask_threshold", "entropy_coef", "use_bias_correction_kl")  # fmt: skip
NO_BYTES = {  # keys that change the loss's or the sampler's numbers, not what a GPU holds
    "epsilon": "the clip's lower bound", "epsilon_high": "the clip's upper bound", "temperature": "the sampler's",
    "top_p": "the sampler's", "top_k": "the sampler's", "scale_rewards": "the advantages' scaling",
    "reward_weights": "the rewards' weights", "mask_truncated_completions": "which completions count",
    "use_bias_correction_kl": "the KL term's correction (one (B, C) product)",
}  # fmt: skip
OPTIONS = (("max_completion_length", "completion_len"), ("num_generations", "num_generations"))
VLLM_OPTIONS = (("vllm_gpu_memory_utilization", "vllm_util"), ("vllm_max_model_length", "vllm_max_len"))
# (key, its default, why another value is not modelled)
UNMODELLED = (
    ("loss_type", "dapo", "the verdict is loss_type dapo's, GRPOConfig's default (the others differ by a few (B, C) "
                          "tensors)"),
    ("importance_sampling_level", "token", "sequence-level importance sampling is not replayed (its (B, 1) ratio)"),
    ("num_iterations", 1, "more than one iteration brings old log-probs into the batch, which the verdict does not "
                          "hold without --vllm"),
    ("top_entropy_quantile", 1.0, "the entropy mask is not replayed (a (B, C) quantile and mask)"),
    ("entropy_coef", 0.0, "the entropy bonus is not replayed (its (B, C) products)"),
    ("off_policy_mask_threshold", None, "the off-policy sequence mask is not replayed"),
    ("vllm_importance_sampling_mode", "sequence_mask", "token-level ratios ((B, C), not (B, 1)) are not replayed"),
)  # fmt: skip
REFUSED = (
    ("cast_lm_head_to_fp32", True, "the head cast to fp32 is not replayed"),
    ("vllm_importance_sampling_correction", False, "without the ratio in the batch is not replayed"),
)  # fmt: skip


def grpo_config(ledger: KeyLedger, typed: dict) -> bool:
    """Whether the file is read as GRPOTrainer's or RLOOTrainer's (--rl grpo or rloo typed: RLOOConfig shares these
    keys). A file with them and neither is refused at the first of them: memcalc would answer for SFT."""
    if (typed.get("rl") or "").strip().lower() not in ("grpo", "rloo"):
        first = next((key for key in GRPO_KEYS if ledger.has(key)), None)
        if first is not None:
            ledger.refuse(first, "a GRPOConfig key: give --rl grpo (or rloo) to answer for its trainer")
        return False
    if not typed.get("seq"):
        ledger.refuse("max_completion_length" if ledger.has("max_completion_length") else "num_generations",
                      "GRPOConfig has no prompt length: give --seq, the prompt and the completion together")
    for key, option in OPTIONS:
        if ledger.has(key) and ledger.raw(key) is not None:
            ledger.set(option, str(ledger.raw(key)), key)
    if ledger.has("beta"):
        ledger.set("beta", str(ledger.number("beta") or 0), "beta",
                   "--beta: the reference's log-probs in the batch" if ledger.number("beta") else "--beta 0: none")
    vllm_options(ledger)
    for key, what in NO_BYTES.items():
        if ledger.has(key):
            ledger.used(key, f"{what}: no bytes")
    for key, default, why in UNMODELLED:
        if ledger.has(key) and ledger.raw(key) != default:
            ledger.unmodelled(key, why)
        elif ledger.has(key):
            ledger.used(key, f"{default}, GRPOConfig's default")
    for key, refused, why in REFUSED:
        if ledger.has(key) and ledger.flag(key) is refused:
            ledger.refuse(key, why)
        elif ledger.has(key):
            ledger.used(key, f"{not refused}, GRPOConfig's default")
    generation_batch(ledger, typed)
    return True


def generation_batch(ledger: KeyLedger, typed: dict) -> None:
    """steps_per_generation, or generation_batch_size (the completions of one generation over every process:
    per_device_train_batch_size x processes x steps_per_generation): the buffered batch and the rows the policy
    generates at once are taken as the accumulation's micro-batches, GRPOConfig's default."""
    steps = ledger.count("steps_per_generation")
    accumulation = ledger.count("gradient_accumulation_steps") or 1
    batches = f"{accumulation:,} micro-batch" + ("" if accumulation == 1 else "es")
    taken = f"the buffered batch and the rows generated at once are taken as gradient_accumulation_steps' {batches}"
    if steps is not None and steps != accumulation:
        ledger.unmodelled("steps_per_generation", taken)
    elif steps is not None:
        ledger.used("steps_per_generation", "the accumulation steps, its default")
    rows = ledger.count("generation_batch_size")
    if rows is None:
        return
    per_device = ledger.count("per_device_train_batch_size") or 8  # TrainingArguments' default
    default = per_device * int(typed.get("gpus") or 1) * accumulation
    if rows != default:
        ledger.unmodelled("generation_batch_size", f"{taken} ({default:,} completions over the GPUs)")
    else:
        ledger.used("generation_batch_size", "per_device_train_batch_size x GPUs x the accumulation steps, its "
                                             "default")  # fmt: skip


def vllm_options(ledger: KeyLedger) -> None:
    """use_vllm and vllm_mode as --vllm, vllm_enable_sleep_mode as --vllm-sleep; vLLM's own tensor parallel is
    refused."""
    if not ledger.flag("use_vllm"):
        if ledger.has("use_vllm"):
            ledger.used("use_vllm", "off: the policy generates itself (model.generate: the rollout phase)")
        for key in ("vllm_mode", "vllm_enable_sleep_mode", "vllm_gpu_memory_utilization", "vllm_max_model_length",
                    "vllm_tensor_parallel_size"):  # fmt: skip
            if ledger.has(key):
                ledger.ignore(key, "use_vllm is off")
        return
    for key, option in VLLM_OPTIONS:
        if ledger.has(key) and ledger.raw(key) is not None:
            ledger.set(option, str(ledger.raw(key)), key)
    mode = ledger.text("vllm_mode") or "colocate"
    ledger.set("vllm", mode, "use_vllm", f"--vllm {mode}" + ("" if ledger.has("vllm_mode") else " (vllm_mode's "
                                                                                                   "default)"))
    if ledger.has("vllm_mode"):
        ledger.used("vllm_mode", f"--vllm {mode}")
    if ledger.flag("vllm_enable_sleep_mode"):
        ledger.set("vllm_sleep", True, "vllm_enable_sleep_mode", "--vllm-sleep")
    elif ledger.has("vllm_enable_sleep_mode"):
        ledger.used("vllm_enable_sleep_mode", "off")
    if (ledger.count("vllm_tensor_parallel_size") or 1) > 1:
        ledger.refuse("vllm_tensor_parallel_size", "vLLM split over several training GPUs is not modelled")
    elif ledger.has("vllm_tensor_parallel_size"):
        ledger.used("vllm_tensor_parallel_size", "1")
