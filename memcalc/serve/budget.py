"""vLLM's memory budget on one GPU, and the paged KV cache it holds: blocks, requests, context.

The budget (vllm/v1/worker/gpu_worker.py@35d5cda123ec28581759b6d34cde8052314fb1e6
Worker.determine_available_memory; vllm/utils/mem_utils.py@a6d5c39009eb73797b276cc557ca9659c396ca14
memory_profiling):

    available = total x gpu_memory_utilization - (weights + activation peak + non-torch increase)

total is the device's memory (torch.cuda.mem_get_info), the activation peak the rise of torch's
allocated peak during profile_run (a forward of max_num_batched_tokens tokens and the sampler), and
non-torch what grew outside torch's allocator since start-up. The CUDA context comes before the
baseline and CUDA graphs are captured after the cache is allocated: both live in the 1 - utilization
margin, not in the budget.

The cache (vllm/v1/core/kv_cache_utils.py@001cabc1be16a59a70d720ed61a13b678c060a18): a block holds
block_size tokens of one layer (its page: block_size x bytes per token). One kind of layer: one group of
all of them, num_blocks = available // page // layers (get_num_blocks). Full and sliding layers together
(the hybrid allocator, _get_kv_cache_groups_uniform_page_size): groups of group_size layers, group_size
the fewest layers of a kind (the most, if that is under 1.5 times the fewest), each kind in
ceil(count / group_size) groups; a block is a page in each of group_size tensors, so num_blocks =
available // page // group_size, and one request takes, for each group, the blocks its kind reserves.
"""

from __future__ import annotations

import math

from memcalc.model.shape import is_moe_layer
from memcalc.model.sizes import MAX_SEQ
from memcalc.records import record

from .job import ServeJob
from .kv import KVLayer, kv_layers
from .stages import Stage
from .weights import Weights


@record(frozen=True)
class ActivationPeak:
    """The profile run's peak of live activations on one GPU, part by part (bytes): the largest wins."""

    tokens: int  # max_num_batched_tokens
    requests: int  # min(tokens, max_num_seqs): the rows the sampler runs on
    attention: int
    mlp: int
    sampler: int

    @property
    def peak(self) -> int:
        return max(self.attention, self.mlp, self.sampler)

    @property
    def at(self) -> str:
        return max(("attention", self.attention), ("mlp", self.mlp), ("sampler", self.sampler), key=lambda p: p[1])[0]


def activation_peak(job: ServeJob, stage: Stage) -> ActivationPeak:
    """What profile_run's forward holds at once in one block, as vLLM's fused layers allocate it, and
    its sampler's logits. Inference frees each op's input when the next is done; live are the residual
    and the block's input (2·T·h), and then
      attention   the merged qkv projection and the attention output (MLA: q, kv_b's output, the
                  assembled keys, the output)
      MLP         the merged gate_up output (2f) and SiluAndMul's (f); a plain MLP f and f
      experts     fused_moe's buffers: cache13 of M·k·max(N, h) and cache2 of M·k·N/2, N = 2f_e its
                  w13 width (vllm/model_executor/layers/fused_moe/fused_moe.py fused_experts_impl), and
                  the router's logits
      sampler     the T·h hidden states, the R x vocab logits in 16 bits and their float32 copy
                  (vllm/v1/sample/sampler.py Sampler.forward: logits.to(torch.float32))."""
    shape, tp, b = job.model.shape, job.tp, job.activation_bytes
    moe_layers = sum(is_moe_layer(shape, i) for i in stage.layers())
    T, h = job.batched_tokens, shape.hidden
    R = min(T, job.seqs)
    live = 2 * T * h * b
    if shape.is_mla:
        H = shape.n_heads // tp
        widths = H * (2 * shape.head_dim + shape.qk_nope_head_dim + 2 * shape.v_head_dim)
    else:
        kv = 2 * max(1, shape.n_kv_heads // tp) * shape.head_dim
        widths = 2 * shape.q_dim // tp + kv
    attention = live + T * widths * b
    f = shape.ffn // tp
    dense = live + T * (3 * f if shape.gated_mlp else 2 * f) * b
    mlp = dense if moe_layers < len(stage.layers()) else 0
    if moe_layers:
        n = (2 if shape.gated_mlp else 1) * (shape.routed_ffn // (1 if job.expert_parallel else tp))
        k = shape.experts_per_token
        moe = live + T * k * (max(n, h) + n // 2) * b + T * shape.n_experts * b
        mlp = max(mlp, moe)
    sampler = T * h * b + R * shape.vocab * (b + 4) if stage.last else 0  # the last stage samples
    return ActivationPeak(T, R, attention, mlp, sampler)


@record(frozen=True)
class KVGroup:
    """One of vLLM's KV cache groups: a kind of layer, and the layers of it the group takes."""

    kind: KVLayer  # window and bytes per token (count: the model's layers of that kind)
    layers: tuple[int, ...]


def kv_groups(kinds: tuple[KVLayer, ...], windows: list[int]) -> tuple[int, tuple[KVGroup, ...]]:
    """(group_size, the groups) over the whole model, as vLLM groups the layers (see the module): each
    kind's layers dealt round-robin into ceil(count / group_size) groups (layers[i::num_groups])."""
    counts = [k.count for k in kinds]
    few, many = min(counts), max(counts)
    size = many if len(kinds) == 1 or many < few * 1.5 else few
    out = []
    for kind in kinds:
        layers = [i for i, w in enumerate(windows) if w == kind.window]
        n = math.ceil(len(layers) / size)
        out += [KVGroup(kind, tuple(layers[i::n])) for i in range(n)]
    return size, tuple(out)


@record(frozen=True)
class StageBudget:
    """One pipeline stage's GPU: vLLM's split of its memory (bytes), and the blocks that fill the rest."""

    stage: Stage
    weights: int
    activations: int
    available: int  # int(total x utilization - weights - activations) for the KV cache, 0 if they exceed it
    shortfall: int  # by how much they exceed it (0: they fit)
    group_size: int  # the most layers of the stage in one group: the tensors a block spans here
    num_blocks: int  # available // page // group_size (kv_cache_utils.py get_num_blocks)


@record(frozen=True)
class Budget:
    """vLLM's split of each GPU's memory and the paged KV cache; every stage keeps the fewest blocks any
    stage has (kv_cache_utils.py get_kv_cache_configs: "the smallest among all ranks")."""

    total: int
    utilization: float
    block_size: int
    page_bytes: int  # one block of one layer
    groups: tuple[KVGroup, ...]
    stages: tuple[StageBudget, ...]

    @property
    def requested(self) -> int:
        return int(self.total * self.utilization)

    @property
    def binding(self) -> StageBudget:
        """The stage with the fewest blocks: the one that decides (the only one without pipeline parallel)."""
        return min(self.stages, key=lambda s: s.num_blocks)

    @property
    def num_blocks(self) -> int:
        return self.binding.num_blocks

    @property
    def available(self) -> int:
        return self.binding.available

    @property
    def cache_tokens(self) -> int:
        """vLLM's "GPU KV cache size: N tokens": num_blocks // groups x block_size (_report_kv_cache_config)."""
        return self.num_blocks // len(self.groups) * self.block_size

    def request_blocks(self, context: int, batched: int) -> int:
        """Blocks one request of `context` tokens takes: each group's kind's reservation
        (_max_memory_usage_bytes_from_groups, every group counted on every stage)."""
        return sum(g.kind.paged_blocks(context, self.block_size, batched) for g in self.groups)

    @property
    def cache_bytes(self) -> int:
        """The binding stage's KV cache tensors."""
        return self.num_blocks * self.page_bytes * self.binding.group_size


def stage_budget(job: ServeJob, stage: Stage, weights: int, activations: int, page: int,
                 groups: tuple[KVGroup, ...]) -> StageBudget:  # fmt: skip
    """determine_available_memory and get_num_blocks on the stage's GPU, its groups being the model's
    projected onto its layers (_project_kv_cache_groups_to_worker). --kv-cache-memory is taken as given,
    as determine_available_memory returns cache_config.kv_cache_memory_bytes without profiling."""
    left = job.kv_cache_memory or int(job.gpu.memory_bytes * job.gpu_memory_utilization - (weights + activations))
    available, shortfall = max(0, left), max(0, -left)
    size = max(sum(1 for i in g.layers if stage.start <= i < stage.end) for g in groups)
    return StageBudget(stage, weights, activations, available, shortfall, size, available // page // size)


def budget(job: ServeJob, stages: tuple[tuple[Stage, Weights, ActivationPeak], ...]) -> Budget:
    """Each GPU's memory as vLLM splits it for this job. The non-torch increase vLLM measures (NCCL,
    attention backends' workspaces) is not modelled: it is left out, so the budget is an upper bound."""
    shape = job.model.shape
    windows = [shape.window_at(i) for i in range(shape.n_layers)]
    kinds = kv_layers(job, range(shape.n_layers))
    assert all(k.bytes_per_token == kinds[0].bytes_per_token for k in kinds)  # one page size (same heads)
    page = job.page_tokens * kinds[0].bytes_per_token
    _, groups = kv_groups(kinds, windows)
    per_stage = tuple(stage_budget(job, st, w.total_bytes, p.peak, page, groups) for st, w, p in stages)
    return Budget(job.gpu.memory_bytes, job.gpu_memory_utilization, job.page_tokens, page, groups, per_stage)


def longest_context(b: Budget, batched: int, limit: int = MAX_SEQ) -> int:
    """The longest request the blocks hold (estimate_max_model_len's binary search up to `limit`, the
    model's position table where it has one), 0 if not one token."""
    low, high, best = 1, limit, 0
    while low <= high:
        mid = (low + high) // 2
        if b.request_blocks(mid, batched) <= b.num_blocks:
            best, low = mid, mid + 1
        else:
            high = mid - 1
    return best
