"""vLLM's profile run on one GPU: the peak of torch's allocated bytes above the weights, part by part.

gpu_model_runner.py profile_run (vllm 0.10.1.1, 1da94e673; the same in 0.8.5, 0.11.0 and 0.13.0) runs
_dummy_run(max_num_batched_tokens): a forward of T tokens over R = min(max_num_seqs, T) requests, whose
hidden states [T, h] it keeps; then, on the last pipeline stage, _dummy_sampler_run on the R last hidden
states: compute_logits (R x the padded vocabulary, all-gathered under tensor parallel: every rank samples)
and the Sampler with top_k = vocab - 1 and top_p = 0.9 for every row, so that PyTorch's top-k/top-p path
sorts the logits (vllm/v1/sample/ops/topk_topp_sampler.py forward_native -> apply_top_k_top_p:
logits.sort). What is live when the sort runs is the sampler's peak (bytes per element of R x vocab):

  2   the logits in the model's 16 bits (the padded vocabulary's columns: the slice to vocab is a view)
  4   their float32 copy (vllm/v1/sample/sampler.py Sampler.forward: logits.to(torch.float32))
  4   the sorted values, and 8 the int64 indices (torch.sort's outputs)
  and the sort's own buffers (pytorch aten/src/ATen/native/cuda/SortStable.cu launch_stable_sort_kernel,
  a row of more than 4,096 columns): R >= 128 rows, segmented_sort_pairs: int64 reverse indices (8) and
  cub DeviceSegmentedRadixSort's alternate key and value buffers (4 + 8); 1 < R < 128,
  segmented_sort_pairs_by_full_sort: two int2 arrays (8 + 8), the keys' output (4), cub's alternates (4 + 8);
  R = 1, segmented_sort_large_segments: the indices (8), cub's alternates (4 + 8).

After the sort the reverse indices and cub's buffers are freed before anything as large is allocated
(the masks are bool, the softmax and the scatter 4 bytes each: 26 bytes and the 16-bit logits at most).

FlashInfer's sampler (--sampler flashinfer: TopKTopPSampler.forward_cuda, taken in 0.8 to 0.11 where
flashinfer is installed, as in vLLM's Docker image, in 0.13 under VLLM_USE_FLASHINFER_SAMPLER=1, by default from
0.21, where flashinfer 0.6 also keeps a 1 MiB row-states buffer of its own) sorts
nothing: flashinfer_sample calls flashinfer.sampling.top_k_top_p_sampling_from_logits (flashinfer-python
0.2.11, 0.3.1 and 0.5.3 alike, filter_apply_order "top_k_first"), which holds beside the 16-bit and the
float32 logits top_k_mask_logits' output (torch.empty_like, 4) and its softmax (4) while
top_p_sampling_from_probs draws R int32 samples.
"""

from __future__ import annotations

import math

from memcalc.model.shape import is_moe_layer
from memcalc.records import record

from .job import ServeJob
from .stages import Stage
from .weights import VOCAB_PADDING


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


def sort_buffer_bytes(rows: int) -> int:
    """The sort's own bytes per element of rows x vocab (SortStable.cu, see the module)."""
    if rows >= 128:
        return 8 + 4 + 8  # segmented_sort_pairs: reverse indices, cub's alternate keys and values
    if rows > 1:
        return 8 + 8 + 4 + 4 + 8  # segmented_sort_pairs_by_full_sort: two int2 arrays, keys out, cub's alternates
    return 8 + 4 + 8  # segmented_sort_large_segments: the indices, cub's alternates


def per_logit_bytes(sampler: str, rows: int) -> int:
    """What the sampler holds at its peak per element of R x vocab, the 16-bit logits aside (see the
    module): PyTorch's float32 logits, sorted values, int64 indices and the sort's buffers; FlashInfer's
    float32 logits, masked logits and their softmax."""
    if sampler == "flashinfer":
        return 4 + 4 + 4
    return 4 + 4 + 8 + sort_buffer_bytes(rows)


def sampler_bytes(job: ServeJob, tokens: int, rows: int) -> int:
    """The sampler's peak (see the module): the kept hidden states, the R last ones and their rand_like
    copy, the 16-bit logits, and what the sampler holds per element of R x vocab."""
    shape, b = job.model.shape, job.activation_bytes
    padded = math.ceil(shape.vocab / VOCAB_PADDING) * VOCAB_PADDING  # vocab_parallel_embedding.py pad_vocab_size
    hidden = (tokens + 2 * rows) * shape.hidden * b  # _dummy_run's hidden states; last ones; torch.rand_like
    sampler = job.profile_sampler
    buffer = job.release.flashinfer_buffer if sampler == "flashinfer" else 0  # kept across calls, so in the peak
    return hidden + rows * padded * b + rows * shape.vocab * per_logit_bytes(sampler, rows) + buffer


def activation_peak(job: ServeJob, stage: Stage) -> ActivationPeak:
    """What profile_run's forward holds at once in one block, as vLLM's fused layers allocate it, and
    its sampler (above). Inference frees each op's input when the next is done; live are the residual
    and the block's input (2·T·h), and then
      attention   the merged qkv projection and the attention output (MLA: q, kv_b's output, the
                  assembled keys, the output)
      MLP         the merged gate_up output (2f) and SiluAndMul's (f); a plain MLP f and f
      experts     fused_moe's buffers: cache13 of M·k·max(N, h) and cache2 of M·k·N/2, N = 2f_e its
                  w13 width (vllm/model_executor/layers/fused_moe/fused_moe.py fused_experts_impl), and
                  the router's logits."""
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
    sampler = sampler_bytes(job, T, R) if stage.last else 0  # the last stage samples
    return ActivationPeak(T, R, attention, mlp, sampler)
