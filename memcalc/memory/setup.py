"""What is trained per step (Setup; how the GPUs share it is the job's Layout, memcalc.model.layout), one GPU's
share of its node's host memory (host_share), and whether a result fits (Fits)."""

from __future__ import annotations

import math

from memcalc.errors import InputError
from memcalc.model.gpus import HOST_MEMORY_BYTES
from memcalc.model.layout import Layout
from memcalc.model.moe import BALANCED, Routing
from memcalc.model.sizes import MAX_BATCH, MAX_SEQ, check_size
from memcalc.model.stacks import DEFAULT_STACK, Stack
from memcalc.records import record


# Default MFU: Llama 3 trained at 38-43% BF16 MFU on 16K H100s (Dubey et al. 2024, Table 4);
# Korthikanti et al. 2022 Table 5 reports 41-56% on A100s. 0.4 sits at the low end of both.
DEFAULT_MFU = 0.4
MAX_HOST_BYTES = 10**15  # a petabyte of CPU memory in one node: beyond any machine


@record(frozen=True)
class Setup:
    """What is trained per step, by whose code (the stack), and at what assumed utilisation; not on how many GPUs:
    that is the job's Layout."""

    seq_len: int
    micro_batch: int = 1
    grad_accum: int = 1
    optimizer: str = "adamw"
    mfu: float = DEFAULT_MFU
    host_memory: int = HOST_MEMORY_BYTES  # CPU memory of one node, which offload fills
    stack: Stack = DEFAULT_STACK  # whose code trains: model, precision recipe, optimizer implementation
    routing: Routing = BALANCED  # how many tokens a mixture-of-experts layer's experts get (memcalc.model.moe)

    def __post_init__(self) -> None:
        check_size("seq", self.seq_len, limit=MAX_SEQ)
        check_size("host memory", self.host_memory, limit=MAX_HOST_BYTES)
        check_size("micro-batch", self.micro_batch, limit=MAX_BATCH)
        check_size("grad-accum", self.grad_accum, limit=MAX_BATCH)
        if not (isinstance(self.mfu, (int, float)) and math.isfinite(self.mfu) and 0 < self.mfu <= 1):
            raise InputError(f"mfu must be a fraction in (0, 1], got {self.mfu!r}")
        if self.micro_batch % self.per_sample:  # a bug: --micro-batch counts samples (CLI's StepOptions)
            raise InputError(f"micro-batch {self.micro_batch} sequences is not a whole number of DPO pairs")

    @property
    def per_sample(self) -> int:
        """Sequences per sample (per_sample_of): micro_batch counts sequences, the rows the model runs; --micro-batch
        counts samples."""
        return per_sample_of(self.stack)

    @property
    def samples(self) -> int:
        """The micro-batch in samples (--micro-batch): DPO's pairs."""
        return self.micro_batch // self.per_sample

    @property
    def shortest_seq(self) -> int:
        """The shortest sequence the job has: GRPO's completion (PPO's response) and a prompt of one token; else one
        token."""
        generated = self.stack.online or self.stack.ppo
        return 1 if generated is None else generated.completion_len + 1

    @property
    def tokens_per_micro_batch(self) -> int:
        return self.seq_len * self.micro_batch

    @property
    def tokens_per_step(self) -> int:
        """Tokens one GPU processes per optimizer step (all accumulated micro-batches)."""
        return self.tokens_per_micro_batch * self.grad_accum


def per_sample_of(stack: Stack) -> int:
    """Sequences per sample the stack trains on: DPO's pair, chosen and rejected (memcalc.exact.hf.dpo); else one."""
    return 2 if stack.rl == "dpo" else 1


def group_rows(setup: Setup, world: int) -> int:
    """The micro-batch's unit under --rl grpo: GRPOConfig takes a generation batch (micro-batch x accumulation x
    processes) of whole prompt groups (generation_batch_size % num_generations == 0), so the micro-batch is a
    multiple of num_generations / gcd(num_generations, accumulation x processes); 1 otherwise."""
    online = setup.stack.online
    if online is None:
        return 1
    return online.num_generations // math.gcd(online.num_generations, setup.grad_accum * world)


def host_share(setup: Setup, layout: Layout) -> int:
    """One GPU's share of its node's host memory, which offload fills: the job's GPUs on a node split it."""
    return setup.host_memory // min(layout.world, layout.gpus_per_node)


class Fits:
    """For results with total_bytes and usable_bytes (the GPU), host_bytes and host_usable_bytes (its share
    of the node's CPU memory, which offload fills): does it fit, and by how much."""

    __slots__ = ()

    @property
    def fits(self) -> bool:
        return self.total_bytes <= self.usable_bytes and self.host_fits

    @property
    def host_fits(self) -> bool:
        return self.host_bytes <= self.host_usable_bytes

    @property
    def free_bytes(self) -> int:
        """What is left of the usable memory at the peak (negative: over by that much)."""
        return self.usable_bytes - self.total_bytes
