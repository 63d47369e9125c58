"""RL fine-tuning as TRL 1.16's trainers run it: --rl on a stack (with_rl: DPOTrainer, GRPOTrainer, RLOOTrainer, and
what each refuses), whether a second model is held (second_model), the note that says what is replayed, and the
online trainers' settings (OnlineRL: trl/trainer/grpo_config.py GRPOConfig, and rloo_config.py RLOOConfig, which
shares its knobs) that change what a GPU holds. The record travels with the stack (memcalc.model.stacks
.Stack.online), so the training step's replay (memcalc.exact.hf.grpo, rloo), the rollout engine
(memcalc.engine.rollout) and verify read the same one.
"""

from __future__ import annotations

from dataclasses import replace

from memcalc.errors import InputError
from memcalc.records import record

from .shape import ModelShape
from .stacks import DPO_LOGITS, FUSED_HEAD, GRPO_DIV_IN_PLACE, GRPO_LOGITS, RL, Stack, releases

ONLINE = ("grpo", "rloo")  # the trainers that generate: GRPOTrainer, RLOOTrainer (their settings: Stack.online)
TRAINERS = {"dpo": "DPOTrainer", "grpo": "GRPOTrainer", "rloo": "RLOOTrainer", "ppo": "PPOTrainer"}  # TRL's, by --rl
PPO_FINETUNES = ("--rl ppo with {}: replayed for a full fine-tune and LoRA (PPOTrainer wraps the policy alone in "
                 "PEFT; the value model trains whole); QLoRA, DoRA, --modules-to-save and frozen weights are not")
# the lines whose PPOTrainer (trl.experimental.ppo, 1.0 to 1.12; removed in 1.13) is replayed: the same PPO loop in
# every release from 1.3.0 to 1.12.0 (diffed: imports, type hints, DeepSpeed's preparation, a logged mean), each
# release held to the replay (tests/test_ppo.py); PPO_LINE, the newest, is --rl ppo's default
PPO_LINES = ("1.5", "1.6", "1.7", "1.8", "1.9", "1.10", "1.12")
PPO_LINE = PPO_LINES[-1]
# GRPOConfig's max_completion_length default where it is not 512 (trl/trainer/grpo_config.py): 256 up to 1.9
COMPLETION_DEFAULT = {"1.8": 256, "1.9": 256}
VLLM_MODES = ("", "colocate", "server")  # use_vllm False (the policy's own generate), vllm_mode's two
SERVE_UTILIZATION = 0.9  # trl vllm-serve's gpu_memory_utilization default (trl/scripts/vllm_serve.py ScriptArguments)


@record(frozen=True)
class OnlineRL:
    """GRPOConfig's memory-bearing settings (RLOOConfig has the same), GRPOConfig's defaults where a field has one."""

    completion_len: int = 512  # max_completion_length: each row's last positions (the rest: its prompt)
    num_generations: int = 8  # completions per prompt: the generation batch is a multiple of it
    beta: float = 0.0  # the KL coefficient: a reference's log-probs are computed and read where it is not 0
    vllm: str = ""  # VLLM_MODES: "" generates with the trained model (use_vllm False)
    vllm_util: float = 0.3  # vllm_gpu_memory_utilization: the colocated engine's share of each GPU
    sleep: bool = False  # vllm_enable_sleep_mode: the colocated engine sleeps (level 2) while the policy trains
    max_model_len: int = 0  # vllm_max_model_length; 0: the job's sequence
    graphs_bytes: int = 0  # vLLM's CUDA graph estimate as its log prints it (--cudagraph-memory); 0: not counted

    def __post_init__(self) -> None:
        if self.completion_len < 1:
            raise InputError(f"--completion-len must be at least 1, not {self.completion_len}")
        if self.num_generations < 2:
            raise InputError(f"--num-generations must be at least 2 (GRPO's advantages compare a prompt's "
                             f"completions), not {self.num_generations}")  # fmt: skip
        if self.beta < 0:
            raise InputError(f"--beta must not be negative, not {self.beta}")
        if self.vllm not in VLLM_MODES:
            raise InputError(f"unknown --vllm {self.vllm!r}; known: colocate, server")
        if not 0 < self.vllm_util <= 1:
            raise InputError(f"--vllm-util is a fraction of the GPU's memory in (0, 1], not {self.vllm_util}")
        if self.sleep and self.vllm != "colocate":
            raise InputError("--vllm-sleep is vllm_enable_sleep_mode, for the colocated engine: give --vllm colocate")
        if (self.max_model_len or self.graphs_bytes) and not self.vllm:
            raise InputError("--vllm-max-len and --cudagraph-memory describe the engine: give --vllm colocate or "
                             "server")  # fmt: skip

    def step_key(self) -> OnlineRL:
        """What the training step's bytes depend on (the rest is the rollout's): the completion's length, whether
        a reference's log-probs and vLLM's old log-probs and ratio come with the batch."""
        return OnlineRL(self.completion_len, 2, self.beta and 1.0, "server" if self.vllm else "")

    @property
    def label(self) -> str:
        parts = [f"{self.completion_len}-token completions", f"{self.num_generations} per prompt"]
        if self.beta:
            parts.append(f"beta {self.beta:g}")
        if self.vllm:
            parts.append(f"vLLM {self.vllm}" + (f" at {self.vllm_util:g}" if self.vllm == "colocate" else "") +
                         (", sleep mode" if self.sleep else ""))  # fmt: skip
        return ", ".join(parts)


@record(frozen=True)
class Ppo:
    """PPOConfig's memory-bearing settings, its defaults (trl/experimental/ppo/ppo_config.py, trl 1.12.0)."""

    completion_len: int = 53  # response_length: every response's positions (the rest of the sequence: its prompt)
    rollout_batch: int = 64  # local_rollout_forward_batch_size: the rows generated and scored at once
    epochs: int = 4  # num_ppo_epochs: passes over the rollout, each an optimizer step per mini-batch
    critic: ModelShape | None = None  # the value and reward models' (--critic); None: the policy's

    def __post_init__(self) -> None:
        for flag, value in (("--completion-len", self.completion_len), ("--rollout-batch", self.rollout_batch),
                            ("--ppo-epochs", self.epochs)):  # fmt: skip
            if value < 1:
                raise InputError(f"{flag} must be at least 1, not {value}")

    @property
    def label(self) -> str:
        critic = f", critic {self.critic.name}" if self.critic is not None else ""
        return (f"{self.completion_len}-token responses, rollout chunks of {self.rollout_batch}, {self.epochs} epochs"
                + critic)


RLOO_DEFAULTS = OnlineRL(num_generations=2, beta=0.05)  # RLOOConfig's (trl/trainer/rloo_config.py, trl 1.16.0)


def with_rl(stack: Stack, rl: str | None, precompute_ref: bool = False, online: OnlineRL | None = None,
            ppo: Ppo | None = None) -> Stack:  # fmt: skip
    """--rl dpo: TRL 1.16's DPOTrainer in place of its SFTTrainer (memcalc.exact.hf.dpo); --precompute-ref: its
    precompute_ref_log_probs (no reference in the step). --rl grpo and rloo: its GRPOTrainer and RLOOTrainer
    (memcalc.exact.hf.grpo, rloo), online their settings. Refused where the step is not replayed: other stacks and
    TRL lines (before 1.15 the loss came from the logits), --modules-to-save (the reference runs the original
    modules, not the trained copies), activation offloading, Liger beside DPO's second model (its forward runs in the
    step, through Liger's RoPE too), vLLM beside a 4-bit model."""
    key = (rl or "").strip().lower()
    if precompute_ref and key != "dpo":
        raise InputError("--precompute-ref is DPOConfig.precompute_ref_log_probs: give --rl dpo")
    if online is not None and key not in ONLINE:
        raise InputError("--completion-len, --num-generations, --beta and --vllm are GRPOConfig's and RLOOConfig's: "
                         "give --rl grpo or rloo")  # fmt: skip
    if rl is None:
        return stack
    if key not in RL or not key:
        raise InputError(f"unknown --rl {rl!r}; known: dpo, grpo, rloo, ppo")
    if key == "ppo":
        return with_ppo(stack, ppo or Ppo())
    lines = {"dpo": DPO_LOGITS, "grpo": GRPO_LOGITS}.get(key, ()) + FUSED_HEAD  # the lines whose trainer is replayed
    if stack.trl not in lines:
        raise InputError(f"--rl {key} is TRL's {TRAINERS[key]}, replayed on --stack "
                         f"{', '.join('trl:' + x for x in lines)}, not --stack {stack.key}")  # fmt: skip
    if stack.savers.offload:
        raise InputError(f"--rl {key} with --offload-activations is not replayed")
    if stack.savers.liger is not None and key == "dpo" and not stack.finetune.lora and not precompute_ref:
        raise InputError("--rl dpo with --liger and a second model as the reference: Liger patches the trained model's "
                         "norms and MLP, but the modeling module's RoPE for every model, the reference's too, which "
                         "is not replayed; --precompute-ref or --lora")  # fmt: skip
    if stack.finetune.modules_to_save:
        raise InputError(f"--rl {key} with --modules-to-save: the reference then runs the original modules beside the "
                         "trained copies, which is not replayed")  # fmt: skip
    if key in ONLINE and online is not None and online.vllm and stack.finetune.quantize:
        raise InputError("--vllm with --quantize: TRL starts vLLM on the 4-bit model with quantization='bitsandbytes', "
                         "whose weights memcalc serve does not size; drop --vllm (the policy generates "
                         "itself)")  # fmt: skip
    if key == "grpo" and stack.trl in GRPO_LOGITS:
        logits_refusals(stack, online)
    if key in ONLINE:  # GRPOConfig's and RLOOConfig's disable_dropout is False: LoRA's dropout stays; the model is
        # called without labels (the log-probabilities from its logits or its fused head): no loss_type chunked_nll
        online = online or (OnlineRL() if key == "grpo" else RLOO_DEFAULTS)
        return replace(stack, rl=key, online=online, loss="full")
    finetune = replace(stack.finetune, lora_dropout=0.0)  # DPOConfig.disable_dropout: every nn.Dropout's p = 0
    # DPOTrainer calls the model without labels (its log-probabilities from the logits): no loss_type chunked_nll
    return replace(stack, rl=key, finetune=finetune, precompute_ref=precompute_ref, loss="full")


def logits_refusals(stack: Stack, online: OnlineRL | None) -> None:
    """What GRPOTrainer before 1.15 (its log-probabilities from the logits: memcalc.exact.hf.grpo_logits) is not
    replayed with: vLLM (each release's own generation code, not diffed), Liger's fused GRPO loss (use_liger_kernel),
    LoRA on the head."""
    lines = f"--stack trl:{stack.trl} ({releases(stack.trl)})"
    if online is not None and online.vllm:
        raise InputError(f"--rl grpo --vllm on {lines}: its vLLM generation is not replayed; the policy's own "
                         "generate is (drop --vllm), and vLLM beside the trainer on --stack trl:1.16")  # fmt: skip
    if stack.savers.liger is not None:
        raise InputError(liger_refused(stack.trl))
    if "lm_head" in stack.finetune.targets:
        raise InputError(f"--rl grpo on {lines} with LoRA on lm_head: the head's adapter over logits_to_keep's "
                         "positions is not replayed")  # fmt: skip


def liger_refused(line: str) -> str:
    """--liger under --rl grpo before 1.15 (the CLI says it before stack_for's SFTTrainer reason)."""
    return (f"--liger with --rl grpo on --stack trl:{line}: its GRPOTrainer's LigerFusedLinearGRPOLoss is not "
            "replayed; on trl:1.16 Liger's layers beside the fused head are")


def with_ppo(stack: Stack, ppo: Ppo) -> Stack:
    """--rl ppo: TRL 1.3-1.12's PPOTrainer (trl.experimental.ppo; memcalc.exact.hf.ppo) in place of its SFTTrainer, on
    the models as its example script loads them in the trick set's dtype: its Accelerator has no mixed_precision,
    so nothing autocasts (the pure recipe), and the models' config.use_cache stays on (forward passes none); under
    LoRA the policy alone is PEFT's, its dropout disabled like every model's. Refused where the step is not
    replayed: other lines, QLoRA, DoRA, --modules-to-save and frozen weights, activation offloading, Liger."""
    if stack.trl not in PPO_LINES:
        lines = ", ".join("trl:" + x for x in PPO_LINES)
        raise InputError(f"--rl ppo is TRL's PPOTrainer (trl.experimental.ppo, removed in 1.13), replayed on --stack "
                         f"{lines} (1.3 to 1.12), not --stack {stack.key}")
    ft = stack.finetune
    if not ft.trains_all and not ft.lora or ft.quantize or ft.dora or ft.modules_to_save:
        raise InputError(PPO_FINETUNES.format(ft.label))
    if stack.savers.offload or stack.savers.liger is not None:
        raise InputError("--rl ppo with --offload-activations or --liger: PPOTrainer applies neither")
    finetune = replace(ft, lora_dropout=0.0)  # disable_dropout_in_model after get_peft_model: LoRA's dropout too
    return replace(stack, rl="ppo", recipe="pure", use_cache=True, loss="full", ppo=ppo, finetune=finetune)


def second_model(stack: Stack) -> bool:
    """Whether TRL keeps a reference model beside the policy: a full fine-tune (under PEFT the reference is the policy
    with its adapters disabled) whose DPO reference is not precomputed, or whose GRPO beta is not 0."""
    if stack.finetune.lora:
        return False
    return (stack.rl == "dpo" and not stack.precompute_ref) or (stack.online is not None and stack.online.beta != 0)


def dpo_reference(stack: Stack) -> str:
    """Where DPOTrainer's reference comes from, for the note (memcalc.exact.hf.dpo)."""
    if stack.precompute_ref:
        return "the reference's log-probs from the batch (precompute_ref_log_probs: computed before training)"
    ref = "the adapters disabled" if stack.finetune.lora else "a second copy of the model"
    return f"the reference's forward ({ref}, no_grad, no checkpointing) beside the policy's saved activations"


OWN_GENERATE = ("; without --vllm the policy generates itself (model.generate over the generation batch, its KV "
                "cache: the rollout phase below)")  # fmt: skip


def online_note(stack: Stack) -> str:
    """GRPOTrainer's and RLOOTrainer's step in a line (memcalc.exact.hf.grpo, rloo; before 1.15 grpo_logits)."""
    g, held = stack.online, "; a second model held" if second_model(stack) else ""
    C = g.completion_len
    if stack.trl in GRPO_LOGITS:
        divided = "in place (logits.div_)" if stack.trl in GRPO_DIV_IN_PLACE else "into a new tensor"
        scored = (f"each completion's {C} positions scored from the logits (logits_to_keep {C + 1}, Accelerate's fp32 "
                  f"copy under autocast, divided by the temperature {divided}, selective_log_softmax, the entropy "
                  "without grad); the generation batch buffered with its advantages")  # fmt: skip
    else:
        scored = (f"each completion's {C} positions scored through add_fused_lm_head (no logits), the prompt masked; "
                  "the generation batch buffered with its advantages")  # fmt: skip
    if stack.rl == "rloo":
        kl = f" (beta {g.beta:g}{held})" if g.beta else ""
        return (f"TRL 1.16's RLOOTrainer: {scored} and old sequence log-probs; the loss per sequence, the "
                f"reference's KL in the rewards{kl}{OWN_GENERATE if not g.vllm else ''}")  # fmt: skip
    ref = f", the reference's log-probs (beta > 0{held})" if g.beta else ""
    read = ("vLLM's old log-probs and importance-sampling ratio" if g.vllm else "no old log-probs") + ref
    trl = f"TRL {'1.16' if stack.trl in FUSED_HEAD else releases(stack.trl)}'s GRPOTrainer"  # 1.16.0's: held to it
    return f"{trl} (loss_type dapo): {scored}, {read}{OWN_GENERATE if not g.vllm else ''}"


def ppo_note(stack: Stack) -> str:
    """PPOTrainer's step in a line (memcalc.exact.hf.ppo)."""
    C = stack.ppo.completion_len
    critic = stack.ppo.critic.name if stack.ppo.critic is not None else "the policy's architecture"
    reference = "" if stack.finetune.lora else "a reference and "
    return (f"TRL {releases(stack.trl)}'s PPOTrainer (trl.experimental.ppo): the policy and a value model "
            f"({critic}) trained under one optimizer (no clipping, no autocast, no checkpointing), {reference}a reward "
            f"model ({critic}) "
            f"held; each micro-batch the policy's full logits (temperature in place), its {C}-token responses' "
            f"log-probs, the clipped value and policy losses, softmax entropy after backward; the loop's locals kept "
            f"to the next micro-batch; the rollout's fp32 scores of every response token held through the update "
            f"(the rollout itself: the phases below)")  # fmt: skip

