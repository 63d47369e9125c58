"""vLLM's two model runners, as they differ in the budget: which one a release takes, and what each keeps.

V1's runner is vllm/v1/worker/gpu_model_runner.py; V2's, vllm/v1/worker/gpu/model_runner.py, is the default
for some models from 0.22 (config/vllm.py use_v2_model_runner, VLLM_USE_V2_MODEL_RUNNER unset), read from each
release's wheel:

  0.22        Qwen3ForCausalLM, neither a mixture of experts nor a quantised checkpoint
  0.23        Llama, Mistral and Qwen3 ForCausalLM, the same conditions
  0.24        those and DeepseekV2, Qwen2Moe, GraniteMoe ForCausalLM, quantised too
  0.25-0.28   every dense model that is not a hybrid, and that list's mixtures of experts
  0.29-0.33   every model (on CUDA, with no feature V2 lacks: none of those memcalc models)

Where V2 profiles otherwise (memcalc.serve.profile): its profile run samples a greedy batch, and
profile_cudagraph_memory returns 0 up to 0.28 (gpu/model_runner.py), so no CUDA graph estimate is subtracted.

What each runner keeps from its construction to the profile run (persistent_bytes) counts in the budget from
0.27 (memcalc.serve.releases: total_consumed); before, the profile's peak increase leaves it out, and it lives
in the 1 - utilization margin.
"""

from __future__ import annotations

import math

from memcalc.model.shape import ModelShape

QUANTISED = ("fp8", "fp8-block", "int8", "int4-awq", "int4-gptq")  # checkpoints with a quantization_config
V2_FROM = 22
V2_NAMED = {22: ("qwen3",), 23: ("llama", "mistral", "qwen3")}  # model_types of config/vllm.py's allow-list
V2_MOE = ("deepseek_v2", "qwen2_moe", "granitemoe")  # the list's mixtures of experts (0.24 on)
V2_EVERY_MODEL_FROM = 29
V2_GRAPH_ESTIMATE_FROM = 29  # gpu/model_runner.py profile_cudagraph_memory: 0 up to 0.28, measured from 0.29


def default_runner(minor: int, shape: ModelShape, weights: str) -> str:
    """The runner vLLM 0.`minor` takes for the model by default (see the module): "v1" or "v2"."""
    if minor < V2_FROM:
        return "v1"
    if minor in V2_NAMED:
        return "v2" if shape.arch in V2_NAMED[minor] and not shape.is_moe and weights not in QUANTISED else "v1"
    if minor == 24:
        return "v2" if shape.arch in V2_NAMED[23] + V2_MOE else "v1"
    if minor < V2_EVERY_MODEL_FROM:
        return "v2" if not shape.is_moe or shape.arch in V2_MOE else "v1"
    return "v2"


def block_table_width(context: int, block_size: int) -> int:
    """Blocks a request's row of the block table holds: cdiv(max_model_len, block_size), rounded up to a multiple
    of 128 / gcd(128, block_size) (v1/worker/block_table.py get_block_table_width)."""
    step = 128 // math.gcd(128, block_size)
    return math.ceil(math.ceil(context / block_size) / step) * step


def v1_persistent_bytes(tokens: int, seqs: int, context: int, block_size: int, hidden: int, act_bytes: int,
                        minor: int) -> int:  # fmt: skip
    """The GPU tensors V1's runner allocates before the profile run (vllm 0.27.0 to 0.33.0 gpu_model_runner.py
    GPUModelRunner.__init__, gpu_input_batch.py InputBatch, block_table.py BlockTable, one placeholder group)."""
    embeds = tokens * hidden * act_bytes  # inputs_embeds [T, h], allocated for text models too
    table = seqs * block_table_width(context, block_size) * 4  # block_table [R, W] int32
    per_token = 4 + 8 + 8 + 1 + 8 + (1 if minor >= 33 else 0)  # input_ids, positions, req_indices, is_token_ids,
    # slot_mapping; is_padding from 0.33
    query_pos = 8 * max(seqs + 1, tokens)  # int64
    per_request = 4 + 7 * 4 + 8 + 1 + 6 * 4 + 4  # query_start_loc, seven int32 counters, prev_positions,
    # discard_request_mask, six sampling parameters (InputBatch), min_p (builtin logits processor)
    return embeds + table + tokens * per_token + query_pos + seqs * per_request + 4 + 4


def v2_persistent_bytes(tokens: int, seqs: int, vocab: int) -> int:
    """The GPU tensors V2's runner allocates before the profile run (vllm 0.23.0 to 0.33.0 gpu/sample/penalties.py
    PenaltiesState, gpu/structured_outputs.py, sample/logit_bias.py, sample/bad_words.py, sample/logprob.py,
    gpu/input_batch.py InputBuffers); its block tables come after, with the KV cache."""
    words = math.ceil(vocab / 32)
    sampling = vocab * 4 + 2 * words * 4  # output_bin_counts [R, V] int32; prompt_bin_mask, grammar_bitmask
    bias = (3 * 1024 + 128) * 4 + (1024 + 129) * 4 + 128 * 4  # LogitBiasState, BadWordsState, logprob token ids
    buffers = tokens * (4 + 8 + 1) + seqs * (20 + 12) + 4  # input_ids, positions, is_padding; RequestState's
    # total_len, num_computed_tokens, last_sampled (int64), next_prefill_tokens; query_start_loc, seq_lens, dcp
    return seqs * (sampling + bias) + buffers
