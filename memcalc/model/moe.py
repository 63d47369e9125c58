"""How many tokens a mixture-of-experts layer's experts process: the routing assumption.

A router sends each of T tokens to k of E experts. Balanced, every expert gets T·k/E tokens (what the
load-balancing losses of Switch, Fedus et al. 2022 sec. 2.2, and DeepSeek-V3's bias-based balancing
aim at). Two departures change memory:

  capacity factor cf  each expert takes at most C = ⌈cf·T·k/E⌉ tokens (Megatron-LM
                      megatron/core/transformer/moe/moe_utils.py get_capacity); the rest are dropped,
                      and with padding (--moe-pad-expert-input-to-capacity) every expert runs exactly C
  imbalance X         the busiest GPU's experts get X times their balanced tokens (X = 1: balanced)

With expert parallelism over ep GPUs, each GPU holds E/ep experts and receives their tokens from the
ep GPUs of its group (T tokens each). Balanced it receives T·k, whatever ep: the peak moves only when
the load is uneven, and then on the GPU whose experts are busiest. On one GPU (ep = 1) the experts
share its T·k routed tokens whatever the imbalance: only a capacity factor changes its memory.
"""

from __future__ import annotations

import math

from memcalc.errors import InputError
from memcalc.records import record

from .shape import ModelShape

MAX_IMBALANCE = 1e6


@record(frozen=True)
class Routing:
    """The routing assumption: balanced unless a capacity factor or an imbalance is given."""

    capacity_factor: float | None = None  # None: no capacity, nothing dropped or padded
    imbalance: float = 1.0  # the busiest GPU's experts get this many times their balanced tokens

    def __post_init__(self) -> None:
        cf, x = self.capacity_factor, self.imbalance
        if cf is not None and not (isinstance(cf, (int, float)) and math.isfinite(cf) and 0 < cf <= MAX_IMBALANCE):
            raise InputError(f"capacity factor must be a positive number, got {cf!r}")
        if not (isinstance(x, (int, float)) and math.isfinite(x) and 1 <= x <= MAX_IMBALANCE):
            raise InputError(f"expert imbalance must be at least 1 (1: balanced; 2: the busiest GPU's experts get "
                             f"twice their share), got {x!r}")  # fmt: skip

    @property
    def balanced(self) -> bool:
        return self.capacity_factor is None and self.imbalance == 1

    @property
    def label(self) -> str:
        parts = ["balanced" if self.imbalance == 1 else f"busiest GPU's experts at {self.imbalance:g}x their share"]
        if self.capacity_factor is not None:
            parts.append(f"capacity factor {self.capacity_factor:g} (padded)")
        return ", ".join(parts)


BALANCED = Routing()


def expert_capacity(shape: ModelShape, tokens: int, routing: Routing, ep: int = 1) -> int | None:
    """C = ⌈cf · (ep·T)·k / E⌉ tokens per expert (Megatron get_capacity), or None without a capacity factor."""
    if routing.capacity_factor is None:
        return None
    return math.ceil(routing.capacity_factor * ep * tokens * shape.experts_per_token / shape.n_experts)


def routed_tokens(shape: ModelShape, tokens: int, routing: Routing = BALANCED, ep: int = 1) -> int:
    """Tokens the experts of the busiest GPU process in one MoE layer, each counted once per expert it goes to.

    Balanced: T·k (ep GPUs each send T tokens, k experts each, spread over ep GPUs). Imbalance X: X times
    that, but no more than every token of the group once per local expert, ep·T·min(k, E/ep). A capacity
    factor pads every local expert to its capacity C (and drops what is beyond it): (E/ep)·C."""
    local = shape.n_experts // ep
    capacity = expert_capacity(shape, tokens, routing, ep)
    if capacity is not None:
        return local * capacity
    balanced = tokens * shape.experts_per_token
    most = ep * tokens * min(shape.experts_per_token, local)
    return min(math.ceil(routing.imbalance * balanced), most)
