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

From 0.17, PyTorch's path masks 8 rows or more with a Triton kernel instead of the sort (topk_topp_sampler.py
apply_top_k_top_p -> topk_topp_triton.py apply_top_k_top_p_triton): the float32 logits masked in place, their
softmax (4) and random_sample's exponential draws (4), and a buffer cached across calls of
min(next_power_of_2(min(SMs, R)), SMs) rows of the vocabulary in float32: 12 bytes an element and the buffer.

FlashInfer's sampler (--sampler flashinfer: TopKTopPSampler.forward_cuda, taken in 0.8 to 0.11 where
flashinfer is installed, as in vLLM's Docker image, in 0.13 under VLLM_USE_FLASHINFER_SAMPLER=1, by default from
0.21, where flashinfer 0.6 and 0.7 also keep a 1 MiB row-states buffer of their own) sorts
nothing: flashinfer_sample calls flashinfer.sampling.top_k_top_p_sampling_from_logits (flashinfer-python
0.2.11, 0.3.1, 0.5.3 and 0.7.2 alike, filter_apply_order "top_k_first", top_k a tensor), which holds beside the
16-bit and the float32 logits top_k_mask_logits' output (torch.empty_like, 4) and its softmax (4) while
top_p_sampling_from_probs draws R int32 samples. From 0.21 _dummy_sampler_run samples a second time with a
generator, which forward_cuda hands to PyTorch's path: the peak is the larger of the two.

V2's model runner (memcalc.serve.runners; gpu/model_runner.py profile_run and _dummy_sampler_run) keeps the
T hidden states and the R gathered ones (no rand_like copy) and samples a greedy dummy batch
(gpu/sample/sampler.py apply_sampling_params): a float32 copy of the logits up to 0.25; from 0.26 the logits as
they are; from 0.33 a second pass with SamplingParams.for_sampler_warmup() (top-k 50, top-p 0.9, penalties,
logprobs) on the float32 copy, masked and softmaxed by FlashInfer or masked in place by the Triton kernel.
"""

from __future__ import annotations

import math

from memcalc.errors import InputError
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


TRITON_FROM, TRITON_ROWS = 17, 8  # vllm 0.17.0 topk_topp_sampler.py apply_top_k_top_p: Triton from 8 rows
NATIVE_WARMUP_FROM = 21  # vllm 0.21.0 _dummy_sampler_run: a second call with a generator, through forward_native
V2_COPY_UNTIL, V2_WARMUP_FROM = 26, 33  # V2's sampler: fp32 copy up to 0.25; for_sampler_warmup's pass from 0.33


def triton_buffer_bytes(job: ServeJob, rows: int) -> int:
    """apply_top_k_top_p_triton's buffer, cached across calls (topk_topp_triton.py _TRITON_BUFFER_CACHE):
    min(next_power_of_2(min(SMs, R)), SMs) rows of the vocabulary in float32."""
    sms = job.gpu.sms
    if not sms:
        raise InputError(f"vLLM {job.vllm}'s sampler keeps a Triton buffer of a row per multiprocessor, and the "
                         f"{job.gpu.name}'s count is not known: give sms in a --gpu file")  # fmt: skip
    programs = min(sms, rows)
    return min(1 << (programs - 1).bit_length(), sms) * job.model.shape.vocab * 4


def triton_masks(job: ServeJob, rows: int) -> bool:
    """PyTorch's path masks with the Triton kernel (0.17 on, 8 rows or more), else sorts."""
    return job.minor >= TRITON_FROM and rows >= TRITON_ROWS


def native_bytes(job: ServeJob, rows: int) -> tuple[int, int]:
    """PyTorch's path (forward_native) per element of R x vocab, and the buffer it keeps (see the module): from
    0.17, for 8 rows or more, the Triton kernel masks the float32 logits in place beside their softmax and
    random_sample's exponential draws (torch.empty_like(probs)); else the sort."""
    if triton_masks(job, rows):
        return 4 + 4 + 4, triton_buffer_bytes(job, rows)
    return 4 + 4 + 8 + sort_buffer_bytes(rows), 0


def v1_sampler_bytes(job: ServeJob, rows: int) -> int:
    """V1's sampler beyond the 16-bit logits: FlashInfer's float32 logits, masked logits and softmax with its
    row-states buffer, or PyTorch's path; from 0.21 PyTorch's path runs after FlashInfer's too."""
    elements = rows * job.model.shape.vocab
    native, triton = native_bytes(job, rows)
    if job.profile_sampler != "flashinfer":
        return elements * native + triton
    kept = job.release.flashinfer_buffer  # kept across calls, so in the peak
    first = elements * (4 + 4 + 4) + kept
    return max(first, elements * native + triton + kept) if job.minor >= NATIVE_WARMUP_FROM else first


def v2_sampler_bytes(job: ServeJob, rows: int) -> int:
    """V2's sampler beyond the 16-bit logits (gpu/sample/sampler.py apply_sampling_params, on a greedy dummy
    batch): a float32 copy up to 0.25; the logits as they are from 0.26 (mutated in place in 0.26, left alone
    where no request needs processing from 0.27); from 0.33 a second pass with for_sampler_warmup's parameters,
    the float32 copy masked by FlashInfer (and softmaxed) or in place by the Triton kernel."""
    elements = rows * job.model.shape.vocab
    if job.minor < V2_COPY_UNTIL:
        return elements * 4
    if job.minor < V2_WARMUP_FROM:
        return 0
    if job.profile_sampler == "flashinfer":
        return elements * (4 + 4 + 4) + job.release.flashinfer_buffer
    return elements * 4 + triton_buffer_bytes(job, rows)


def sampler_bytes(job: ServeJob, tokens: int, rows: int) -> int:
    """The sampler's peak (see the module): the kept hidden states, the R last ones (and V1's rand_like copy),
    the 16-bit logits, and what the sampler holds beyond them."""
    shape, b = job.model.shape, job.activation_bytes
    padded = math.ceil(shape.vocab / VOCAB_PADDING) * VOCAB_PADDING  # vocab_parallel_embedding.py pad_vocab_size
    v2 = job.runner == "v2"
    hidden = (tokens + (1 if v2 else 2) * rows) * shape.hidden * b  # _dummy_run's hidden states; last ones; rand_like
    held = v2_sampler_bytes(job, rows) if v2 else v1_sampler_bytes(job, rows)
    return hidden + rows * padded * b + held


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
