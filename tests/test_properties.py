"""Invariants that hold for every shape and size (hypothesis)."""

from dataclasses import replace

from hypothesis import given, settings
from hypothesis import strategies as st

from memcalc.exact.kernels import step_flops
from memcalc.memory.activations import textbook_activations
from memcalc.memory.estimate import Setup, estimate, memory_for
from memcalc.memory.state import StateSharding, model_state
from memcalc.model.gpus import GPUS
from memcalc.model.headroom import usable_bytes
from memcalc.model.params import n_params
from memcalc.model.shape import Model, ModelShape
from memcalc.model.tricks import Tricks

PRECISIONS = ("fp32", "fp16", "bf16")


@st.composite
def shapes(draw):
    head_dim = draw(st.sampled_from([32, 64, 128]))
    n_heads = draw(st.sampled_from([1, 2, 4, 8, 16, 32]))
    kv = draw(st.sampled_from([k for k in (1, 2, 4, 8, 16, 32) if n_heads % k == 0]))
    gated = draw(st.booleans())
    return ModelShape(
        n_layers=draw(st.integers(1, 96)), hidden=head_dim * n_heads, n_heads=n_heads, n_kv_heads=kv,
        ffn=draw(st.integers(1, 4 * head_dim * n_heads)), gated_mlp=gated, norm="rmsnorm" if gated else "layernorm",
        vocab=draw(st.integers(1, 200_000)), tied_embeddings=draw(st.booleans()),
    )  # fmt: skip


tricks_sets = st.builds(
    lambda p, f, r: Tricks("bf16" if f and p == "fp32" else p, f, r),
    st.sampled_from(PRECISIONS), st.booleans(), st.sampled_from(["none", "selective", "full"]),
)  # fmt: skip
seqs = st.integers(1, 1 << 17)
batches = st.integers(1, 64)


def peak(shape, seq, b, tricks):
    return textbook_activations(shape, seq, b, tricks).peak_bytes


@given(shapes(), seqs, batches, tricks_sets)
def test_adding_a_trick_never_increases_memory(shape, seq, b, tricks):
    # with a single layer, checkpointing adds its input (2sbh) to a peak that rebuilds the whole layer
    shape = replace(shape, n_layers=max(shape.n_layers, 2))
    before = peak(shape, seq, b, tricks)
    if tricks.precision == "fp32":
        assert peak(shape, seq, b, replace(tricks, precision="bf16")) <= before
    if not tricks.flash:
        assert peak(shape, seq, b, replace(tricks, flash=True, precision=tricks.precision.replace("fp32", "bf16"))) <= before
    if tricks.recompute == "none":
        assert peak(shape, seq, b, replace(tricks, recompute="selective")) <= before
    if tricks.recompute != "full":
        assert peak(shape, seq, b, replace(tricks, recompute="full")) <= before


@given(shapes(), seqs, batches, tricks_sets, st.integers(1, 8))
def test_activations_are_linear_in_layers(shape, seq, b, tricks, k):
    one = textbook_activations(replace(shape, n_layers=1), seq, b, tricks)
    many = textbook_activations(replace(shape, n_layers=k), seq, b, tricks)
    assert many.total_bytes == k * one.total_bytes
    assert many.peak_bytes - many.rebuilt_bytes == k * (one.peak_bytes - one.rebuilt_bytes)


@given(shapes(), seqs, batches, tricks_sets, st.integers(1, 8))
def test_activations_are_linear_in_micro_batch(shape, seq, b, tricks, k):
    assert peak(shape, seq, k * b, tricks) == k * peak(shape, seq, b, tricks)


@given(shapes(), st.integers(1, 1 << 14))
def test_without_flash_the_s_squared_term_dominates_as_s_grows(shape, seq):
    a = textbook_activations(shape, seq, 1, Tricks("bf16"))
    scores = next(t.value for t in a.terms if "s×s" in t.name)
    # 5as²b > 34sbh once s > 34h/(5a): the crossover is linear in h/a
    crossover = 34 * shape.hidden // (5 * shape.n_heads)
    assert (scores > a.per_layer_bytes - scores) == (seq > crossover)


@given(shapes())
def test_gqa_with_kv_heads_equal_to_heads_is_mha(shape):
    mha = replace(shape, n_kv_heads=shape.n_heads)
    default = replace(shape, n_kv_heads=None)
    assert n_params(mha) == n_params(default)
    assert peak(mha, 1024, 1, Tricks()) == peak(default, 1024, 1, Tricks())


@given(st.integers(1, 10**13), st.sampled_from(PRECISIONS), st.sampled_from(["adamw", "sgd", "adam8bit"]),
       st.integers(1, 4096), st.integers(0, 3))  # fmt: skip
def test_zero_never_increases_state_and_more_gpus_never_hurt(params, precision, optimizer, gpus, stage):
    base = model_state(params, precision, optimizer, StateSharding(gpus, 0)).total_bytes
    sharded = model_state(params, precision, optimizer, StateSharding(gpus, stage)).total_bytes
    more = model_state(params, precision, optimizer, StateSharding(gpus * 2, stage)).total_bytes
    assert sharded <= base and more <= sharded
    assert model_state(params, precision, optimizer, StateSharding(1, stage)).total_bytes == base


@given(shapes(), st.integers(1, 1 << 16), tricks_sets)
def test_recompute_never_reduces_flops(shape, seq, tricks):
    f = step_flops(shape, seq, tricks)
    assert f.hardware_per_token >= f.model_per_token
    if tricks.recompute != "full":
        assert step_flops(shape, seq, replace(tricks, recompute="full")).hardware_per_token >= f.hardware_per_token


@settings(max_examples=50)
@given(shapes(), st.integers(1, 1 << 15), batches, st.sampled_from(sorted(GPUS)))
def test_memory_total_is_the_sum_of_its_parts(shape, seq, b, key):
    model = Model(shape, n_params(shape), "test")
    est = estimate(model, Setup(seq_len=seq, micro_batch=b), GPUS[key])
    for a, lg, m in zip(est.activations, est.logits, est.memory):
        st_bytes = memory_for(model, est.setup, GPUS[key], a.tricks)[0].total_bytes
        assert m.total_bytes == st_bytes + a.peak_bytes + lg.total_bytes
        assert m.fits == (m.total_bytes <= usable_bytes(GPUS[key]))  # one GPU: no NCCL communicator
