"""Online RL fine-tuning as TRL 1.16's GRPOTrainer and RLOOTrainer run it (trl/trainer/grpo_config.py GRPOConfig,
rloo_config.py RLOOConfig, which shares these knobs): the settings that change what a GPU holds. The record travels
with the stack (memcalc.model.stacks.Stack.online), so the training step's replay (memcalc.exact.hf.grpo, rloo), the
rollout engine (memcalc.engine.rollout) and verify read the same one.
"""

from __future__ import annotations

from memcalc.errors import InputError
from memcalc.records import record

VLLM_MODES = ("", "colocate", "server")  # use_vllm False (the policy's own generate), vllm_mode's two


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


RLOO_DEFAULTS = OnlineRL(num_generations=2, beta=0.05)  # RLOOConfig's (trl/trainer/rloo_config.py, trl 1.16.0)
