"""The weights one GPU of a server holds, at their serving precision.

Quantized formats store the decoder blocks' linear matrices (attention's projections, the MLPs, every
expert) and keep the rest in 16 bits: embedding, output head, norms, biases and routers (AutoAWQ and
GPTQ checkpoints leave lm_head and Qwen3-MoE's `gate` unquantized; vLLM quantizes ParallelLMHead only on
request). One matrix of in x out weights takes, by format:

  bf16, fp16  2 bytes a weight
  fp8         1 byte a weight + two float32 per-tensor scales, weight_scale and input_scale
              (vllm/model_executor/layers/quantization/fp8.py Fp8LinearMethod.create_weights)
  fp8-block   1 byte a weight + a float32 weight_scale_inv per block of 128 x 128 (weight_block_size
              [128, 128], dynamic activation scales: no input_scale; DeepSeek-V3's and Qwen3's -FP8
              checkpoints). Below compute capability 8.9 (no FP8 tensor cores) vLLM runs them through Marlin,
              which turns the block scales into one 16-bit scale per 128 inputs and output column
              (utils/marlin_utils_fp8.py prepare_fp8_layer_for_marlin: repeat_interleave(block_n))
  int8        GPTQ 8-bit, group 128: qweight int32 of 4 weights (1 byte a weight), per group of 128 inputs
              and column an fp16 scale and a zero (qzeros, 4 to an int32: 1 byte), g_idx int32 per input
              (vllm/model_executor/layers/quantization/gptq.py GPTQLinearMethod.create_weights)
  int4-gptq   the same at 4 bits: 8 weights to an int32 (0.5 byte), zeros 8 to an int32
  int4-awq    AWQ GEMM, group 128: qweight [in, out/8] int32, qzeros [in/128, out/8] int32, scales
              [in/128, out] fp16, no g_idx (AutoAWQ awq/modules/linear/gemm.py WQLinear_GEMM;
              vllm/model_executor/layers/quantization/awq.py AWQLinearMethod.create_weights)

Split over GPUs as vLLM lays a model out: tensor parallel splits every projection's heads or width
(column- and row-parallel linears), the vocabulary (VocabParallelEmbedding, padded to a multiple of 64)
and, without expert parallel, each expert's width; k and v keep at least one head each on a GPU, the
heads replicated where tp exceeds the KV heads (vllm/model_executor/layers/linear.py
QKVParallelLinear: num_kv_head_replicas); latent attention's q_a and kv_a projections are replicated
(vllm/model_executor/models/deepseek_v2.py). Expert parallel gives each of the tp x dp GPUs n_experts/ep
whole experts. Pipeline parallel gives a stage its layers (memcalc.serve.stages), the first the embedding,
the last the final norm and the output head: a tied head is a copy of the embedding there.
"""

from __future__ import annotations

import math

from memcalc.model.params import layer_params, moe_layer_params, norm_params
from memcalc.model.shape import ModelShape, is_moe_layer
from memcalc.records import record

from .job import ServeJob
from .stages import Stage

GROUP = 128  # the group size of GPTQ and AWQ checkpoints (q_group_size / group_size 128)
VOCAB_PADDING = 64  # vllm/model_executor/layers/vocab_parallel_embedding.py DEFAULT_VOCAB_PADDING_SIZE
BITS = {"int8": 8, "int4-gptq": 4, "int4-awq": 4}


@record(frozen=True)
class Matrix:
    """A linear layer's weight on one GPU: in_features x out_features, count of them per block."""

    name: str
    inputs: int
    outputs: int
    count: int = 1

    @property
    def params(self) -> int:
        return self.inputs * self.outputs * self.count


def matrix_bytes(m: Matrix, fmt: str, fp8_cores: bool = True) -> int:
    """One GPU's bytes of these matrices in the format (see the module's table); fp8_cores: the card runs
    FP8 matmuls (else vLLM's Marlin holds fp8-block's scales per group of inputs)."""
    n, groups = m.inputs * m.outputs, math.ceil(m.inputs / GROUP) * m.outputs
    if fmt in ("bf16", "fp16"):
        one = 2 * n
    elif fmt == "fp8":
        one = n + 2 * 4  # weight_scale and input_scale, float32 each, per tensor
    elif fmt == "fp8-block":  # fp8.py create_weights: weight_scale_inv [ceil(out/128), ceil(in/128)] float32
        blocks = math.ceil(m.outputs / GROUP) * math.ceil(m.inputs / GROUP)
        one = n + (4 * blocks if fp8_cores else 2 * groups)
    else:
        bits = BITS[fmt]
        g_idx = 4 * m.inputs if fmt != "int4-awq" else 0  # GPTQ's int32 group index of every input row
        one = n * bits // 8 + groups * 2 + groups * bits // 8 + g_idx  # weights, fp16 scales, packed zeros
    return one * m.count


def tp_split(width: int, tp: int) -> int:
    return width // tp


def attention_matrices(shape: ModelShape, tp: int) -> list[Matrix]:
    """One block's attention projections on one TP rank."""
    h = shape.hidden
    if shape.is_mla:
        H, rq, rkv = shape.n_heads, shape.q_lora_rank, shape.kv_lora_rank
        q = [Matrix("q_a", h, rq), Matrix("q_b", rq, tp_split(H * shape.head_dim, tp))] if rq else \
            [Matrix("q", h, tp_split(H * shape.head_dim, tp))]  # fmt: skip
        return q + [Matrix("kv_a", h, rkv + shape.qk_rope_head_dim),
                    Matrix("kv_b", rkv, tp_split(H * (shape.qk_nope_head_dim + shape.v_head_dim), tp)),
                    Matrix("o", tp_split(H * shape.v_head_dim, tp), h)]  # fmt: skip
    kv_heads = max(1, shape.n_kv_heads // tp)  # vLLM replicates a KV head where tp > n_kv_heads
    return [Matrix("q", h, tp_split(shape.q_dim, tp)), Matrix("k", h, kv_heads * shape.head_dim),
            Matrix("v", h, kv_heads * shape.head_dim), Matrix("o", tp_split(shape.q_dim, tp), h)]  # fmt: skip


def mlp_matrices(shape: ModelShape, width: int, split: int, name: str = "mlp", count: int = 1) -> list[Matrix]:
    """An MLP of this width, split over `split` GPUs: gate and up (or in), then down (or out)."""
    w = tp_split(width, split)
    ins = [Matrix(f"{name} gate", shape.hidden, w, count), Matrix(f"{name} up", shape.hidden, w, count)] \
        if shape.gated_mlp else [Matrix(f"{name} in", shape.hidden, w, count)]  # fmt: skip
    return ins + [Matrix(f"{name} down", w, shape.hidden, count)]


def block_matrices(shape: ModelShape, moe: bool, tp: int = 1, ep: int = 1) -> list[Matrix]:
    """Every linear matrix of one block on one GPU: attention, and the dense MLP or the experts."""
    out = attention_matrices(shape, tp)
    if not moe:
        return out + mlp_matrices(shape, shape.ffn, tp)
    if ep > 1:  # whole experts, n_experts / ep of them
        out += mlp_matrices(shape, shape.routed_ffn, 1, "experts", shape.n_experts // ep)
    else:
        out += mlp_matrices(shape, shape.routed_ffn, tp, "experts", shape.n_experts)
    if shape.n_shared_experts:
        out += mlp_matrices(shape, shape.shared_ffn, tp, "shared experts")
    return out


def block_rest(shape: ModelShape, moe: bool) -> int:
    """A block's parameters outside its linear matrices (norms, biases, router), replicated on every GPU."""
    whole = moe_layer_params(shape) if moe else layer_params(shape)
    rest = whole - sum(m.params for m in block_matrices(shape, moe))
    assert rest >= 0, f"{shape.name}: a block's matrices exceed its parameters"
    return rest


@record(frozen=True)
class Weights:
    """One GPU's weights: the blocks' linear matrices in the format, and what stays 16-bit."""

    fmt: str
    layers: int  # blocks on this GPU (its pipeline stage's)
    moe_layers: int  # of them, blocks whose MLP is a mixture of experts
    matrices_bytes: int  # the blocks' linear weights, with their scales and zeros
    sixteen_bit_bytes: int  # embedding, output head, norms, biases, routers
    params: int  # parameters on this GPU (weights, not scales)
    local_experts: int  # routed experts per MoE block on this GPU
    expert_bytes: int  # one of them, in the format
    expert_params: int
    table_bytes: int  # the token (and position) table a decode step reads only B rows of; 0 when tied
    table_params: int

    @property
    def total_bytes(self) -> int:
        return self.matrices_bytes + self.sixteen_bit_bytes

    def read_bytes(self, experts_touched: float) -> float:
        """Bytes one forward step reads: every weight but the embedding table, and of each MoE block's
        experts only the experts_touched its tokens go to."""
        idle = self.moe_layers * (self.local_experts - experts_touched) * self.expert_bytes
        return self.total_bytes - self.table_bytes - idle

    def active_params(self, experts_touched_per_token: float) -> float:
        """Parameters one token's forward multiplies by: all but the table and the experts it skips."""
        idle = self.moe_layers * (self.local_experts - experts_touched_per_token) * self.expert_params
        return self.params - self.table_params - idle


def serving_weights(job: ServeJob, stage: Stage) -> Weights:
    """One GPU's weights in the job's format: its pipeline stage's blocks and tables, split by tp and ep."""
    shape, fmt, tp = job.model.shape, job.weights, job.tp
    moe = sum(is_moe_layer(shape, i) for i in stage.layers())
    dense = len(stage.layers()) - moe
    vocab = math.ceil(shape.vocab / VOCAB_PADDING) * VOCAB_PADDING // tp
    table = vocab * shape.hidden
    positions = shape.max_positions * shape.hidden if shape.positions == "learned" and stage.first else 0
    head = table if stage.last and (not shape.tied_embeddings or not stage.first) else 0  # a tied copy apart
    embedding = table if stage.first else 0
    tables = embedding + positions + head + (norm_params(shape) if stage.last else 0)
    blocks = [(dense, block_matrices(shape, False, tp), block_rest(shape, False))]
    if moe:
        blocks.append((moe, block_matrices(shape, True, tp, job.ep), block_rest(shape, True)))
    cores = bool(job.gpu.fp8_tflops)
    matrices = sum(n * sum(matrix_bytes(m, fmt, cores) for m in ms) for n, ms, _ in blocks)
    params = sum(n * (sum(m.params for m in ms) + rest) for n, ms, rest in blocks) + tables
    one = mlp_matrices(shape, shape.routed_ffn, 1 if job.ep > 1 else tp) if moe else []
    unread = positions + (embedding if head or not stage.last else 0)  # an embedding that is not the head
    return Weights(fmt, dense + moe, moe, matrices, 2 * (sum(n * r for n, _, r in blocks) + tables), params,
                   shape.n_experts // job.ep if moe else 0, sum(matrix_bytes(m, fmt, cores) for m in one),
                   sum(m.params for m in one), 2 * unread, unread)  # fmt: skip


def experts_touched(local: int, n_experts: int, per_token: int, tokens: int) -> float:
    """Expected distinct experts of `local` that `tokens` tokens reach, each token choosing per_token of
    n_experts uniformly: local x (1 - (1 - k/E)^T) (balanced routing, memcalc.model.moe's assumption)."""
    if not local:
        return 0.0
    return local * (1 - (1 - per_token / n_experts) ** tokens)
