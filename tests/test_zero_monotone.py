"""ZeRO never costs memory: more GPUs under ZeRO >= 1, or a higher stage, never raise per-GPU memory,
for deep models and for the 1-4-layer ones whose gathered layers are most of the model (issue 10, defect 9)."""

from dataclasses import replace

from hypothesis import assume, example, given, settings
from hypothesis import strategies as st

from memcalc.memory.estimate import Setup, memory_for
from memcalc.memory.state import zero3_gather_bytes
from memcalc.model.gpus import gpu
from memcalc.model.params import layer_params, n_params
from memcalc.model.shape import Model, ModelShape
from memcalc.model.tricks import Tricks
from memcalc.model.layout import Layout
from memcalc.parallel.stage_memory import layout_memory

H100 = gpu("h100-sxm")
OPTIMIZERS = ("adamw", "sgd", "adam8bit")


@st.composite
def shapes(draw):
    """Shallow models with small vocabularies (where the gathered layers are most of the model) and deep ones."""
    head_dim = draw(st.sampled_from([8, 16, 64]))
    n_heads = draw(st.sampled_from([2, 4, 8]))
    gated = draw(st.booleans())
    return ModelShape(
        n_layers=draw(st.one_of(st.integers(1, 4), st.integers(5, 48))), hidden=head_dim * n_heads, n_heads=n_heads,
        n_kv_heads=draw(st.sampled_from([k for k in (1, 2, 4, 8) if n_heads % k == 0])),
        ffn=2 * draw(st.integers(1, 2 * head_dim * n_heads)), gated_mlp=gated, norm="rmsnorm" if gated else "layernorm",
        vocab=draw(st.one_of(st.integers(2, 64), st.integers(1000, 160_000))), tied_embeddings=draw(st.booleans()),
        positions="rope" if gated else "none",
    )  # fmt: skip


@st.composite
def models(draw):
    """A shape with its own count, or with --params' N (the shape scaled to another count)."""
    shape = draw(shapes())
    own = n_params(shape)
    return Model(shape, draw(st.sampled_from([own, max(1, own // 3), own * 3])), "test")


# the counterexample before the fix: one layer, a tiny vocabulary, so the layer is nearly the whole model
ONE_LAYER = ModelShape(n_layers=1, hidden=16, n_heads=2, n_kv_heads=1, ffn=2, vocab=2, tied_embeddings=False,
                       positions="none")  # fmt: skip
TINY = Model(ONE_LAYER, n_params(ONE_LAYER), "test")

tricks_sets = st.sampled_from([Tricks("fp32"), Tricks("bf16"), Tricks("fp16"), Tricks("bf16", True, "full")])
gpu_counts = st.sampled_from([1, 2, 3, 4, 8, 16, 64, 1024])


def total(model, tricks, optimizer, gpus: int, zero: int, offload: bool) -> int:
    layout = Layout(dp=gpus, zero=zero, offload_optimizer=offload)
    return memory_for(model, Setup(seq_len=64, optimizer=optimizer), H100, tricks, layout)[3].total_bytes


@settings(max_examples=300, deadline=None)
@given(models(), tricks_sets, st.sampled_from(OPTIMIZERS), gpu_counts, st.integers(1, 8), st.integers(1, 3),
       st.booleans())  # fmt: skip
@example(TINY, Tricks("fp32"), "adamw", 1, 1, 3, False)  # 1 -> 2 GPUs under ZeRO-3
def test_more_gpus_never_raise_per_gpu_memory(model, tricks, optimizer, gpus, factor, zero, offload):
    """Defect 9: under ZeRO >= 1 (with or without optimizer offload), per-GPU memory never grows with the GPUs."""
    fewer = total(model, tricks, optimizer, gpus, zero, offload)
    more = total(model, tricks, optimizer, gpus * factor + 1, zero, offload)
    assert more <= fewer


@settings(max_examples=300, deadline=None)
@given(models(), tricks_sets, st.sampled_from(OPTIMIZERS), gpu_counts, st.integers(0, 2), st.booleans())
@example(TINY, Tricks("bf16"), "adamw", 2, 2, False)  # ZeRO-2 -> ZeRO-3 on 2 GPUs
def test_a_higher_zero_stage_never_raises_per_gpu_memory(model, tricks, optimizer, gpus, zero, offload):
    """Defect 9: ZeRO-3's gathered layers (two layers' weights + one layer's gradients) never cost more than
    the stage saves; before the fix a 1-4-layer model on 2 GPUs held more under ZeRO-3 than under ZeRO-2."""
    assume(not offload or zero >= 1 or gpus == 1)  # offload over several GPUs needs ZeRO >= 1
    lower = total(model, tricks, optimizer, gpus, zero, offload)
    higher = total(model, tricks, optimizer, gpus, zero + 1, offload)
    assert higher <= lower


def layout_total(model, tricks, optimizer, layout) -> int:
    return layout_memory(model, Setup(seq_len=64, optimizer=optimizer), H100, tricks, layout).total_bytes


@settings(max_examples=200, deadline=None)
@given(models(), tricks_sets, st.sampled_from(OPTIMIZERS), st.sampled_from([1, 2, 4, 8, 16, 64]),
       st.sampled_from([1, 2]), st.integers(1, 3), st.sampled_from(["none", "optimizer", "params"]), st.booleans())
@example(TINY, Tricks("fp32"), "adamw", 1, 1, 3, "none", False)  # dp 1 -> 2 under ZeRO-3
def test_layouts_more_data_parallel_gpus_never_raise_memory(model, tricks, optimizer, dp, tp, zero, offload, hybrid):
    """Defect 9, per layout (memcalc.parallel.stage_memory): doubling dp under ZeRO >= 1 never raises a GPU's memory,
    with tensor parallelism, hybrid shard and optimizer or parameter offload."""
    assume(model.shape.n_kv_heads % tp == 0 and model.shape.ffn % tp == 0)
    assume(offload != "params" or zero == 3)
    opt, params = offload != "none", offload == "params"
    hybrid = hybrid and dp > 8 // tp  # hybrid shard applies where dp spans more than a node (8 GPUs, tp first)
    fewer = Layout(tp=tp, dp=dp, zero=zero, hybrid=hybrid, offload_optimizer=opt, offload_params=params)
    more = replace(fewer, dp=2 * dp)
    assert layout_total(model, tricks, optimizer, more) <= layout_total(model, tricks, optimizer, fewer)


@settings(max_examples=200, deadline=None)
@given(models(), tricks_sets, st.sampled_from(OPTIMIZERS), st.sampled_from([1, 2, 4, 8, 64]), st.sampled_from([1, 2]),
       st.integers(0, 2), st.booleans())  # fmt: skip
@example(TINY, Tricks("bf16"), "adamw", 2, 1, 2, False)  # ZeRO-2 -> ZeRO-3 on dp 2
def test_layouts_higher_zero_stage_never_raises_memory(model, tricks, optimizer, dp, tp, zero, offload):
    """Defect 9, per layout: ZeRO stage z + 1 never holds more per GPU than stage z."""
    assume(model.shape.n_kv_heads % tp == 0 and model.shape.ffn % tp == 0)
    assume(not offload or zero >= 1 or dp == 1)
    lower = Layout(tp=tp, dp=dp, zero=zero, offload_optimizer=offload)
    higher = replace(lower, zero=zero + 1)
    assert layout_total(model, tricks, optimizer, higher) <= layout_total(model, tricks, optimizer, lower)


def test_never_more_gathered_layers_than_the_model_has():
    """Defect 9: a 1-layer model gathers its one layer (and holds its gradients), not two layers and a third's."""
    one = ModelShape(n_layers=1, hidden=4096, n_heads=32, vocab=8)
    p = layer_params(one)
    assert zero3_gather_bytes(p, 1, "bf16", held_elsewhere=10**15) == 2 * 2 * p  # 1 layer's weights + gradients
    assert zero3_gather_bytes(p, 2, "bf16", held_elsewhere=10**15) == 3 * 2 * p  # 2 layers' weights + 1 gradient
    assert zero3_gather_bytes(p, 36, "fp32", held_elsewhere=10**15) == 3 * 4 * p  # deep models: unchanged
    assert zero3_gather_bytes(p, 36, "bf16", held_elsewhere=1000) == 1000  # never more than the others hold


def test_deep_models_keep_their_buffers():
    """Defect 9: the 8B golden job's ZeRO-3 buffer stays 3·2·P_layer."""
    from memcalc.model.presets import canonical_model

    model = canonical_model(8_000_000_000)
    memory = memory_for(model, Setup(8192), H100, Tricks("bf16"), Layout(dp=8, zero=3))[3]
    assert memory.buffer_bytes == 3 * 2 * layer_params(model.shape)
