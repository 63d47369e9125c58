"""vLLM's memory budget on one GPU, and the paged KV cache it holds: blocks, requests, context.

The budget (vllm/v1/worker/gpu_worker.py@35d5cda123ec28581759b6d34cde8052314fb1e6
Worker.determine_available_memory; vllm/utils/mem_utils.py@a6d5c39009eb73797b276cc557ca9659c396ca14
memory_profiling; each release's variant in memcalc.serve.releases):

    available = total x gpu_memory_utilization - (weights + activation peak + non-torch memory)
                (- CUDA graph memory's estimate, 0.20 on) (- the runner's kept tensors, 0.27 on)

total is what torch.cuda.mem_get_info reports (GPU.cuda_total_bytes), the activation peak the rise of
torch's allocated peak during profile_run (memcalc.serve.profile: a forward of max_num_batched_tokens
tokens and the sampler), and non-torch what the release counts outside torch's allocator
(releases.non_torch_bytes). CUDA graphs are captured after the cache is allocated: up to 0.19 they live in
the 1 - utilization margin, not in the budget; from 0.20 vLLM subtracts its own estimate of them, as given.

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

from memcalc.model.headroom import CONTEXT_BYTES
from memcalc.model.sizes import MAX_SEQ
from memcalc.records import record

from .job import ServeJob
from .kv import KVLayer, kv_layers
from .profile import ActivationPeak
from .releases import non_torch_bytes
from .runners import v1_persistent_bytes, v2_persistent_bytes
from .stages import Stage
from .weights import Weights


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
    non_torch: int  # what the release's profile counts outside torch's tensors (releases.non_torch_bytes)
    cudagraphs: int  # the CUDA graph estimate the release subtracts (0.20 on, as given), else 0
    kept: int  # the model runner's tensors kept from its construction, counted from 0.27 (memcalc.serve.runners)
    available: int  # int(total x utilization - weights - activations - non_torch), 0 if they exceed it
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
    other = non_torch_bytes(job.release, job.tp * job.pp, job.gpu.intra, CONTEXT_BYTES)
    graphs = job.cudagraph_memory or 0
    kept = kept_bytes(job) if job.counts_kept else 0
    total = job.gpu.cuda_total_bytes
    left = job.kv_cache_memory or int(total * job.utilization - (weights + activations + other + graphs + kept))
    available, shortfall = max(0, left), max(0, -left)
    size = max(sum(1 for i in g.layers if stage.start <= i < stage.end) for g in groups)
    return StageBudget(stage, weights, activations, other, graphs, kept, available, shortfall, size,
                       available // page // size)  # fmt: skip


def kept_bytes(job: ServeJob) -> int:
    """The tensors the job's model runner allocates before the profile run (memcalc.serve.runners)."""
    shape = job.model.shape
    if job.runner == "v2":
        return v2_persistent_bytes(job.batched_tokens, job.seqs, shape.vocab)
    return v1_persistent_bytes(job.batched_tokens, job.seqs, job.context, job.page_tokens, shape.hidden,
                               job.activation_bytes, job.minor)  # fmt: skip


def budget(job: ServeJob, stages: tuple[tuple[Stage, Weights, ActivationPeak], ...]) -> Budget:
    """Each GPU's memory as vLLM's release splits it for this job."""
    shape = job.model.shape
    windows = [shape.window_at(i) for i in range(shape.n_layers)]
    kinds = kv_layers(job, range(shape.n_layers))
    assert all(k.bytes_per_token == kinds[0].bytes_per_token for k in kinds)  # one page size (same heads)
    page = job.page_tokens * kinds[0].bytes_per_token
    _, groups = kv_groups(kinds, windows)
    per_stage = tuple(stage_budget(job, st, w.total_bytes, p.peak, page, groups) for st, w, p in stages)
    return Budget(job.gpu.cuda_total_bytes, job.utilization, job.page_tokens, page, groups, per_stage)


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
