"""The engines' own memory formulas, transcribed, against memcalc's engine stacks (issue 12).

Megatron-LM: megatron/training/theoretical_memory_usage.py at NVIDIA/Megatron-LM@d98e8a64ddf34856e74b24714e3bedb2f5a39553
(compute_weight_and_optimizer_memory, dense path: no MoE, MTP or MLA; compute_activation_memory;
compute_activation_memory_without_sp).
DeepSpeed: deepspeed/runtime/zero/stage_1_and_2.py estimate_zero2_model_states_mem_needs and
deepspeed/runtime/zero/stage3.py estimate_zero3_model_states_mem_needs at
microsoft/DeepSpeed@38327e07f6cd39b63418f60cedd1651b0be3e7c3.

Each test matches memcalc where both model the same thing, exactly, and names every remaining difference
as an identity: what the formula leaves out that memcalc counts, or the reverse.
"""

import math
from dataclasses import replace
from types import SimpleNamespace

import pytest

from memcalc.memory.estimate import Setup
from memcalc.model.gpus import gpu
from memcalc.model.params import n_params, norm_params
from memcalc.model.presets import canonical_shape, preset
from memcalc.model.shape import Model
from memcalc.model.stacks import STACKS
from memcalc.model.tricks import Tricks
from memcalc.model.layout import Layout
from memcalc.parallel.stage_memory import layout_memory

H100 = gpu("h100-sxm")
SELECTIVE = Tricks(recompute="selective")


# ---- Megatron-LM, transcribed ----------------------------------------------------------------------------


def megatron_weight_and_optimizer_memory(args):
    """compute_weight_and_optimizer_memory, the dense path (num_experts None, mtp_num_layers None)."""
    query_projection_size = args.kv_channels * args.num_attention_heads
    query_projection_to_hidden_size_ratio = query_projection_size / args.hidden_size
    if not args.group_query_attention:
        args.num_query_groups = args.num_attention_heads
    gated_linear_multiplier = 3 / 2 if args.swiglu else 1
    num_dense_layers = args.num_layers
    norm_size = 1 if args.normalization == "RMSNorm" else 2
    self_attn_term = (2 * args.hidden_size * args.hidden_size
                      * ((1 + (args.num_query_groups / args.num_attention_heads))
                         * query_projection_to_hidden_size_ratio))  # fmt: skip
    embedding_size = args.hidden_size * args.padded_vocab_size
    final_layernorm = norm_size * args.hidden_size
    attention_params = self_attn_term
    dense_mlp_params = 2 * args.hidden_size * args.ffn_hidden_size * gated_linear_multiplier
    layernorm_params = 2 * args.hidden_size * norm_size
    tp_sharded_params_in_transformer_block = (attention_params + dense_mlp_params) * num_dense_layers
    replicated_params_in_transformer_block = layernorm_params * num_dense_layers + final_layernorm
    tp_sharded_params_on_most_loaded_shard = (
        (tp_sharded_params_in_transformer_block / args.pipeline_model_parallel_size) + embedding_size
    ) / args.tensor_model_parallel_size
    replicated_params_on_most_loaded_shard = replicated_params_in_transformer_block / args.pipeline_model_parallel_size
    if args.untie_embeddings_and_output_weights and args.pipeline_model_parallel_size == 1:
        tp_sharded_params_on_most_loaded_shard += embedding_size / args.tensor_model_parallel_size

    def num_bytes_per_parameter(data_parallel_size):
        return 18 if not args.use_distributed_optimizer else 6 + (12 / data_parallel_size)

    params = tp_sharded_params_on_most_loaded_shard + replicated_params_on_most_loaded_shard
    return params * num_bytes_per_parameter(args.data_parallel_size), params


def megatron_activation_memory(args, num_microbatches=None):
    """compute_activation_memory: Korthikanti et al. 2022 Table 2 with SP and selective recompute, first stage."""
    activation_memory = (args.seq_length * args.micro_batch_size * args.hidden_size) * (
        18 + (4 * (args.ffn_hidden_size / args.hidden_size)))
    activation_memory *= args.num_layers
    activation_memory += 8 * args.seq_length * args.micro_batch_size * args.pipeline_model_parallel_size
    activation_memory += (args.seq_length * args.micro_batch_size * args.hidden_size
                          * args.pipeline_model_parallel_size)  # fmt: skip
    if args.virtual_pipeline_model_parallel_size is not None:
        interleaved_schedule_memory_penalty = 1 + ((args.pipeline_model_parallel_size - 1) / (
            args.pipeline_model_parallel_size * args.virtual_pipeline_model_parallel_size))
        activation_memory *= interleaved_schedule_memory_penalty
    if args.virtual_pipeline_model_parallel_size is None and args.pipeline_model_parallel_size > 1:
        if num_microbatches is not None:
            activation_memory *= min(1, num_microbatches / args.pipeline_model_parallel_size)
    if args.pipeline_model_parallel_size == 1:
        activation_memory += (args.seq_length * args.micro_batch_size * args.hidden_size * 4
                              * (1 + (args.padded_vocab_size / args.hidden_size)))  # fmt: skip
    return activation_memory / args.tensor_model_parallel_size


def megatron_activation_memory_without_sp(args, num_microbatches=None):
    """compute_activation_memory_without_sp: s·b·h·(10 + 24/t) per layer, embeddings, a 5% overhead."""
    per_layer_memory = (args.seq_length * args.micro_batch_size * args.hidden_size
                        * (10 + (24 / args.tensor_model_parallel_size)))  # fmt: skip
    total_activation_memory = per_layer_memory * args.num_layers
    total_activation_memory += 8 * args.seq_length * args.micro_batch_size * args.pipeline_model_parallel_size
    total_activation_memory += (args.seq_length * args.micro_batch_size * args.hidden_size
                                * args.pipeline_model_parallel_size)  # fmt: skip
    if args.virtual_pipeline_model_parallel_size is not None:
        total_activation_memory *= 1 + ((args.pipeline_model_parallel_size - 1) / (
            args.pipeline_model_parallel_size * args.virtual_pipeline_model_parallel_size))
    if args.virtual_pipeline_model_parallel_size is None and args.pipeline_model_parallel_size > 1:
        if num_microbatches is not None:
            total_activation_memory *= min(1, num_microbatches / args.pipeline_model_parallel_size)
    if args.pipeline_model_parallel_size == 1:
        logits_size = args.seq_length * args.micro_batch_size * args.padded_vocab_size
        logits_size /= args.tensor_model_parallel_size
        final_ln_output = args.seq_length * args.micro_batch_size * args.hidden_size
        total_activation_memory += (logits_size + final_ln_output) * 2
    return total_activation_memory * 1.05


def megatron_args(shape, tp, pp, dp, seq, distributed=False, vpp=None):
    """Megatron's arguments for a memcalc shape (its vocab already padded as Megatron pads it)."""
    return SimpleNamespace(
        kv_channels=shape.head_dim, num_attention_heads=shape.n_heads, hidden_size=shape.hidden,
        group_query_attention=shape.n_kv_heads != shape.n_heads, num_query_groups=shape.n_kv_heads,
        swiglu=shape.gated_mlp, num_layers=shape.n_layers, normalization="RMSNorm" if shape.norm == "rmsnorm"
        else "LayerNorm", padded_vocab_size=shape.vocab, untie_embeddings_and_output_weights=not shape.tied_embeddings,
        ffn_hidden_size=shape.ffn, pipeline_model_parallel_size=pp, tensor_model_parallel_size=tp,
        use_distributed_optimizer=distributed, data_parallel_size=dp, seq_length=seq, micro_batch_size=1,
        virtual_pipeline_model_parallel_size=vpp,
    )  # fmt: skip


def megatron_stage0(shape, tricks, tp, pp, dp, seq, m, zero=0, sp=True, vpp=1):
    model = Model(shape, n_params(shape), shape.name)
    setup = Setup(seq_len=seq, grad_accum=m, stack=STACKS["megatron"])
    lay = Layout(tp=tp, pp=pp, dp=dp, zero=zero, sp=sp, vpp=vpp)
    return layout_memory(model, setup, H100, tricks, lay).stages[0]


# GPT-3 175B as Megatron-LM trains it: the GPT-2 vocabulary padded to a multiple of 128·t = 1,024 (51,200)
GPT3 = replace(preset("gpt3-175b"), vocab=51200)


def test_gpt3_175b_tp8_pp8_sp_selective_is_megatrons_60_6_gb():
    args = megatron_args(GPT3, tp=8, pp=8, dp=1, seq=2048)
    weights, params = megatron_weight_and_optimizer_memory(args)
    acts = megatron_activation_memory(args)
    assert round((weights + acts) / 1e9, 1) == 60.6  # the issue's number
    st = megatron_stage0(GPT3, SELECTIVE, 8, 8, 1, 2048, m=64)
    h, t, p, L = GPT3.hidden, 8, 8, GPT3.n_layers
    # weights and optimizer: 18 bytes/param on both sides; the parameters differ by what Megatron leaves out:
    # the learned position table (replicated on TP ranks), the linear biases (the column-parallel 7h split
    # over t, the row-parallel 2h replicated), and it spreads the final LayerNorm over the stages
    positions, biases, final_norm_share = 2048 * h, L // p * (7 * h // t + 2 * h), norm_params(GPT3) / p
    assert st.state.bytes_per_param == 18
    assert st.params == params + positions + biases - final_norm_share
    assert st.state.total_bytes == 18 * st.params
    # activations: the same Table 2 layers (34·s·b·h/t), the same p micro-batches in flight, the same
    # embedding dropout mask (s·b·h/t with SP); Megatron divides the int64 token ids by t too, memcalc not:
    # every TP rank holds them whole
    ids = 8 * 2048 * p
    assert st.activation_bytes == acts + ids - ids / t
    # memcalc adds what the formula leaves out: the one layer whose s×s scores selective recompute rebuilds
    # in its backward (5·a·s²·b/t)
    assert st.layer.rebuilt_bytes == 5 * 96 * 2048**2 // t
    assert round(st.total_bytes / 1e9, 2) == 61.35


def test_gpt3_with_the_distributed_optimizer_is_6_plus_12_over_d():
    # 512 GPUs: dp 8; the distributed optimizer shards master and Adam state over dp (memcalc: dp × cp)
    args = megatron_args(GPT3, tp=8, pp=8, dp=8, seq=2048, distributed=True)
    weights, params = megatron_weight_and_optimizer_memory(args)
    st = megatron_stage0(GPT3, SELECTIVE, 8, 8, 8, 2048, m=64, zero=1)
    assert weights == pytest.approx(params * (6 + 12 / 8), rel=1e-15)
    assert st.state.total_bytes == 2 * st.params + 4 * st.params + 3 * -(-4 * st.params // 8)
    assert st.state.total_bytes - weights == pytest.approx((st.params - params) * (6 + 12 / 8), abs=3)


def test_gpt3_interleaved_and_with_few_micro_batches():
    # the interleaving penalty 1 + (p − 1)/(p·v), and min(1, m/p) of the micro-batches in flight
    for vpp, m in ((2, 64), (None, 4)):
        args = megatron_args(GPT3, tp=8, pp=8, dp=1, seq=2048, vpp=vpp)
        acts = megatron_activation_memory(args, num_microbatches=m)
        st = megatron_stage0(GPT3, SELECTIVE, 8, 8, 1, 2048, m=m, vpp=vpp or 1)
        flight = st.held / st.layers  # micro-batches in flight on stage 0
        ids = 8 * 2048 * flight
        assert st.activation_bytes == pytest.approx(acts + ids - ids / 8, rel=1e-12)


def test_without_sequence_parallel_megatron_adds_5_percent():
    # compute_activation_memory_without_sp: s·b·h·(10 + 24/t) per layer, embeddings undivided, then x 1.05
    args = megatron_args(GPT3, tp=8, pp=8, dp=1, seq=2048)
    st = megatron_stage0(GPT3, SELECTIVE, 8, 8, 1, 2048, m=64, sp=False)
    assert st.layer.per_layer_bytes == 2048 * GPT3.hidden * (10 + 24 // 8)
    assert megatron_activation_memory_without_sp(args) == pytest.approx(1.05 * st.activation_bytes, rel=1e-12)


def test_llama3_70b_the_mlp_width_and_gqa():
    # SwiGLU and GQA: Megatron's 18 + 4·f/h per layer, memcalc the same; its weights count GQA's K, V exactly.
    # Megatron pads the vocabulary to a multiple of 128·t: 128,256 -> 129,024 at t = 8
    shape = replace(preset("llama3-70b"), vocab=129024)
    args = megatron_args(shape, tp=8, pp=4, dp=1, seq=8192)
    weights, params = megatron_weight_and_optimizer_memory(args)
    acts = megatron_activation_memory(args)
    st = megatron_stage0(shape, Tricks(flash=True), 8, 4, 1, 8192, m=8)
    assert st.layer.per_layer_bytes == 8192 * shape.hidden * (18 + 4 * shape.ffn / shape.hidden) / 8
    assert st.params == params - norm_params(shape) / 4  # the final norm: on the last stage, not spread
    ids = 8 * 8192 * 4  # Llama has no dropout: Megatron's formula charges an embedding dropout mask anyway
    dropout_mask = 8192 * shape.hidden * 4
    assert st.activation_bytes == pytest.approx(acts + ids - ids / 8 - dropout_mask / 8, rel=1e-15)
    assert st.state.total_bytes == pytest.approx(weights - 18 * norm_params(shape) / 4, rel=1e-15)


# ---- DeepSpeed, transcribed ----------------------------------------------------------------------------------


def estimate_zero2_model_states_mem_needs(total_params, num_gpus_per_node=1, num_nodes=1, cpu_offload=True,
                                          additional_buffer_factor=1.5):  # fmt: skip
    total_gpus = num_nodes * num_gpus_per_node
    if cpu_offload:
        gpu_mem = 2 * total_params
        cpu_mem = total_params * max(4 * total_gpus, 16) * additional_buffer_factor
    else:
        # 2 = params_16bit, 18 = 2_grads_16bit + 4_grads_32bit + 4_params_32bit + 8_optimizer_states_32bit
        gpu_mem = 2 * total_params + int(18 * total_params / total_gpus)
        cpu_mem = total_params * 4 * num_gpus_per_node * additional_buffer_factor
    return int(cpu_mem), int(gpu_mem)


def estimate_zero3_model_states_mem_needs(total_params, largest_layer_params, num_gpus_per_node=1, num_nodes=1,
                                          cpu_offload=True, cpu_offload_params=True, zero_init=True,
                                          additional_buffer_factor=1.5):  # fmt: skip
    total_gpus = num_nodes * num_gpus_per_node
    gpus_factor = 1 / num_nodes
    largest_layer_memory = 4 * largest_layer_params
    if cpu_offload:
        if cpu_offload_params:
            gpu_mem = largest_layer_memory
            if zero_init:
                cpu_mem = total_params * 18 * gpus_factor * additional_buffer_factor
            else:
                cpu_mem = total_params * max(4 * num_gpus_per_node, 18 * gpus_factor) * additional_buffer_factor
        else:
            gpu_mem = largest_layer_memory + int(2 * total_params / total_gpus)
            if zero_init:
                cpu_mem = total_params * 16 * gpus_factor * additional_buffer_factor
            else:
                cpu_mem = total_params * max(4 * num_gpus_per_node, 16 * gpus_factor) * additional_buffer_factor
    else:
        gpu_mem = largest_layer_memory + int(18 * total_params / total_gpus)
        if zero_init:
            cpu_mem = largest_layer_params * 4 * num_gpus_per_node * additional_buffer_factor
        else:
            cpu_mem = total_params * 4 * num_gpus_per_node * additional_buffer_factor
    return int(cpu_mem), int(gpu_mem), largest_layer_memory


PSI = 7_500_000_000  # the ZeRO paper's 7.5B model (Rajbhandari et al. 2019, Fig. 1)
SHAPE_7B = canonical_shape(PSI)  # Qwen3-8B's shape: its embedding (151,936 x 4,096) is the largest module
LARGEST = SHAPE_7B.vocab * SHAPE_7B.hidden
BUCKET = 2 * 500_000_000  # DeepSpeed's reduce bucket, 5e8 16-bit elements (stage_1_and_2.py, stage3.py ipg buffer)


def deepspeed_gpu(gpus, zero, offload=False, params=False):
    model = Model(SHAPE_7B, PSI, "7.5B")
    setup = Setup(seq_len=4096, stack=STACKS["deepspeed"])
    lay = Layout(dp=gpus, zero=zero, offload_optimizer=offload, offload_params=params)
    (st,) = layout_memory(model, setup, H100, Tricks(flash=True), lay).stages
    return st


@pytest.mark.parametrize("gpus", [8, 64])
def test_zero2_is_2_plus_18_over_n(gpus):
    _, estimator = estimate_zero2_model_states_mem_needs(PSI, 8, gpus // 8, cpu_offload=False)
    st = deepspeed_gpu(gpus, 2)
    assert st.state.total_bytes == estimator  # 2Ψ + 18Ψ/N: 31.9 GB on 8 GPUs, 17.1 GB on 64
    # memcalc adds the reduce bucket the estimator leaves out: contiguous_gradients' ipg buffer, 1 GB
    assert [b.value for b in st.buffers] == [BUCKET]
    # memcalc's generic ZeRO-2 (the paper's 2Ψ + 14Ψ/N) is 4Ψ/N low: DeepSpeed's fp32 gradient partition
    generic = layout_memory(Model(SHAPE_7B, PSI, "7.5B"), Setup(seq_len=4096), H100, Tricks(flash=True),
                            Layout(dp=gpus, zero=2)).stages[0]  # fmt: skip
    assert estimator - generic.state.total_bytes == 4 * PSI // gpus


@pytest.mark.parametrize("gpus", [8, 64])
def test_zero2_offload_keeps_the_16_bit_weights(gpus):
    cpu, estimator = estimate_zero2_model_states_mem_needs(PSI, 8, gpus // 8, cpu_offload=True)
    st = deepspeed_gpu(gpus, 2, offload=True)
    assert st.state.total_bytes == estimator == 2 * PSI
    # host: the estimator's per node Ψ·max(4·N, 16)·1.5 counts what every process builds on the CPU before
    # partitioning, with a 1.5 buffer; memcalc counts the partitions kept: 18Ψ/N per GPU (16-bit and fp32
    # gradients, fp32 master, m, v)
    assert st.state.host_bytes == 18 * PSI // gpus
    assert cpu == PSI * max(4 * gpus, 16) * 1.5


@pytest.mark.parametrize("gpus", [8, 64])
def test_zero3_is_18_over_n_plus_the_largest_layer_twice(gpus):
    _, estimator, largest_memory = estimate_zero3_model_states_mem_needs(PSI, LARGEST, 8, gpus // 8, cpu_offload=False)
    st = deepspeed_gpu(gpus, 3)
    bucket, gathered, grad, persistent = (b.value for b in st.buffers)
    # the largest layer, gathered in 16 bits with its 16-bit gradient: the estimator's 4·largest
    prefetch = 2 * 50_000_000  # stage3_prefetch_bucket_size: the estimator leaves it out
    assert gathered - prefetch + grad == largest_memory
    # model state: the estimator's 18Ψ/N has one 16-bit partition too few; DeepSpeed keeps both the 16-bit
    # parameter partition and the 16-bit gradient partition (stage3.py grad_partitions_flat_buffer)
    assert st.state.total_bytes == 20 * PSI // gpus
    assert st.state.total_bytes + gathered + grad == estimator + 2 * PSI // gpus + prefetch
    # and the reduce bucket and the persistent small parameters, which the estimator leaves out
    assert bucket == BUCKET and 0 < persistent < 1e7


@pytest.mark.parametrize("gpus", [8, 64])
def test_zero3_offload(gpus):
    _, opt_only, largest = estimate_zero3_model_states_mem_needs(PSI, LARGEST, 8, gpus // 8, cpu_offload=True,
                                                                 cpu_offload_params=False)  # fmt: skip
    st = deepspeed_gpu(gpus, 3, offload=True)
    assert st.state.total_bytes == opt_only - largest == 2 * PSI // gpus  # the 16-bit parameter partition
    _, both, largest = estimate_zero3_model_states_mem_needs(PSI, LARGEST, 8, gpus // 8)
    st = deepspeed_gpu(gpus, 3, offload=True, params=True)
    assert st.state.total_bytes == 0 and both == largest
    assert st.buffers[1].value + st.buffers[2].value == largest + 2 * 50_000_000


def test_the_issue_gaps_are_closed():
    # the issue: memcalc's generic ZeRO was 12% to 34% under DeepSpeed's estimators for 7.5B on 8 and 64 GPUs
    for gpus in (8, 64):
        _, z2 = estimate_zero2_model_states_mem_needs(PSI, 8, gpus // 8, cpu_offload=False)
        generic = layout_memory(Model(SHAPE_7B, PSI, "7.5B"), Setup(seq_len=4096), H100, Tricks(flash=True),
                                Layout(dp=gpus, zero=2)).stages[0].state.total_bytes  # fmt: skip
        assert math.isclose(generic / z2 - 1, -(4 / gpus) / (2 + 18 / gpus), rel_tol=1e-9)  # -12% on 8 GPUs
        assert deepspeed_gpu(gpus, 2).state.total_bytes == z2
