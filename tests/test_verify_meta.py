"""The meta-device verification: memcalc.exact's prediction equals the measurement, to the byte.

At 8B width (seq 8192) for both families and the trick sets the issue names: two of them verified end to end
at full depth (36 blocks), the others three blocks deep (at 36 where MEMCALC_SLOW=1; the step grown from two
and three blocks to 36 equals the full-depth replay: tests/test_exact_depth.py); and on tiny models for every
shape feature and trick set, allocation by allocation.
"""

from __future__ import annotations

import contextlib
import inspect
import itertools
from dataclasses import dataclass, field, replace

import pytest
from typer.testing import CliRunner

torch = pytest.importorskip("torch")

from torch.utils.flop_counter import FlopCounterMode  # noqa: E402

import verify.run as verify_run  # noqa: E402
from memcalc.cli import app  # noqa: E402
from memcalc.errors import InputError  # noqa: E402
from memcalc.exact.builder.model import build as mirror_build  # noqa: E402
from memcalc.exact.base.config import StepConfig  # noqa: E402
from memcalc.exact.replay.meta import simulate  # noqa: E402
from memcalc.exact.sim.graph import Graph  # noqa: E402
from memcalc.exact.step import exact_step  # noqa: E402
from memcalc.exact.sim.tensors import LiveBytes  # noqa: E402
from memcalc.memory.estimate import Setup  # noqa: E402
from memcalc.model.params import n_params  # noqa: E402
from memcalc.model.presets import PRESETS, canonical_model  # noqa: E402
from memcalc.model.shape import Model, ModelShape  # noqa: E402
from memcalc.model.stacks import DEFAULT_STACK, Stack  # noqa: E402
from memcalc.model.tricks import Tricks, parse_tricks  # noqa: E402
from memcalc.verification.results import VerifyResult  # noqa: E402
from tests.replay import FIELDS, GPT_8B, assert_same_step  # noqa: E402
from verify.builder import Kernels, build  # noqa: E402
from verify.meta import (  # noqa: E402
    FLASH_FORMULAS,
    MetaMeasurement,
    build_model,
    inputs_for,
    measure_meta,
    measure_step,
    paths_for,
    saved_at_depth,
)
from verify.recipes import recipe_for  # noqa: E402
from verify.run import verify  # noqa: E402

LLAMA_8B = PRESETS["qwen3-8b"]  # what --params 8e9 picks
REQUIRED = ("fp32", "bf16", "bf16,flash", "bf16,flash,ckpt", "bf16,selective")

TINY = {
    "llama": ModelShape(n_layers=2, hidden=64, n_heads=4, n_kv_heads=2, ffn=160, gated_mlp=True, norm="rmsnorm",
                        vocab=200, tied_embeddings=False, positions="rope", qk_norm=True),
    "gpt": ModelShape(n_layers=2, hidden=64, n_heads=4, vocab=200, linear_bias=True, positions="learned",
                      max_positions=64, dropout=0.1),
    "llama3-like": ModelShape(n_layers=2, hidden=64, n_heads=4, n_kv_heads=2, ffn=160, gated_mlp=True,
                              norm="rmsnorm", vocab=200, tied_embeddings=False, positions="rope"),
    "mqa-tied-wide-heads": ModelShape(n_layers=2, hidden=64, n_heads=4, n_kv_heads=1, head_dim=32, ffn=96,
                                      gated_mlp=True, norm="rmsnorm", vocab=200, positions="rope", qk_norm=True),
    "qkv-bias": ModelShape(n_layers=2, hidden=64, n_heads=4, n_kv_heads=2, ffn=160, gated_mlp=True, norm="rmsnorm",
                           vocab=200, tied_embeddings=False, positions="rope", qkv_bias=True),
    "gpt-no-dropout": ModelShape(n_layers=2, hidden=64, n_heads=4, vocab=200, linear_bias=True, positions="learned",
                                 max_positions=32),
    "mixed": ModelShape(n_layers=2, hidden=64, n_heads=8, n_kv_heads=4, vocab=200, positions="rope", norm="rmsnorm",
                        tied_embeddings=False, dropout=0.2),
}  # fmt: skip
ALL_TRICKS = ("fp32", "bf16", "fp16", "bf16,flash", "bf16,flash,ckpt", "bf16,selective", "bf16,flash,selective",
              "bf16,ckpt")  # fmt: skip


def sim_vs_meta(shape: ModelShape, seq: int, batch: int, tricks: Tricks, grad_accum: int = 1):
    cfg = StepConfig(shape, seq, batch, tricks, grad_accum=grad_accum)
    phases, g, mem = simulate(cfg, timeline=True)
    step, live = measure_step(shape, seq, batch, tricks, grad_accum=grad_accum, timeline=True, count_flops=False)
    return phases, g, mem, step, live


def assert_exact_equals_meta(shape: ModelShape, tricks: Tricks, step) -> None:
    """Every byte count of the step at seq 8192, and its FLOPs, predicted = measured (no tolerance needed)."""
    e = exact_step(shape, 8192, 1, tricks)
    for f in FIELDS:
        assert getattr(e.phases, f) == getattr(step, f), f
    assert e.activations.total_bytes == step.saved_bytes
    assert step.flops == e.flops.counted


# Two of the pairs are measured by verify's runs end to end at full depth (the tests after this one): each of
# those asserts the step verify measured, so that an 8B step is measured once per pair. The others are measured
# three blocks deep (every byte of a block full size), at all 36 where MEMCALC_SLOW=1.
VERIFIED = (("llama", "bf16,flash,ckpt"), ("gpt", "bf16"))
DEPTHS = [3, pytest.param(36, marks=pytest.mark.slow("the same three blocks deep, and "
                                                     "tests/test_exact_depth.py's growth to 36"))]  # fmt: skip


@pytest.mark.parametrize("layers", DEPTHS)
@pytest.mark.parametrize("family,tricks", [p for p in itertools.product(("llama", "gpt"), REQUIRED)
                                           if p not in VERIFIED])
def test_full_size_exact_equals_meta(family, tricks, layers):
    """8B width, seq 8192: every byte count of the step, predicted = measured (no tolerance needed)."""
    shape, t = replace(LLAMA_8B if family == "llama" else GPT_8B, n_layers=layers), parse_tricks(tricks)
    step, _ = measure_step(shape, 8192, 1, t)
    assert_exact_equals_meta(shape, t, step)


@dataclass
class Recorded:
    """One run of verify seen from inside: its arguments by name, the stages it reported (progress's
    (done, total)), its result, and measure_meta's arguments (shape, seq, batch, tricks) and measurement."""

    call: dict = field(default_factory=dict)
    stages: list = field(default_factory=list)
    result: VerifyResult | None = None
    meta_args: tuple = ()
    measured: MetaMeasurement | None = None


@contextlib.contextmanager
def spying_on_verify():
    """verify.run.verify and verify.run.measure_meta run as they would, with the arguments they are
    given; spies in their place note those and what comes back. (progress is wrapped to note each
    stage, and still called where the caller gave one.)"""
    rec = Recorded()
    real_verify, real_measure = verify_run.verify, verify_run.measure_meta

    def verify_spy(*args, **kwargs):
        bound = inspect.signature(real_verify).bind(*args, **kwargs)
        bound.apply_defaults()
        rec.call, given = dict(bound.arguments), bound.arguments["progress"]

        def progress(what, done, total):
            rec.stages.append((done, total))
            if given is not None:
                given(what, done, total)

        bound.arguments["progress"] = progress
        rec.result = real_verify(*bound.args, **bound.kwargs)
        return rec.result

    def measure_spy(*args, **kwargs):
        rec.measured = real_measure(*args, **kwargs)
        rec.meta_args = args[:4]
        return rec.measured

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(verify_run, "verify", verify_spy)
        mp.setattr(verify_run, "measure_meta", measure_spy)
        yield rec


def assert_verified_end_to_end(run: Recorded, model: Model, tricks: str) -> None:
    """verify --device meta at 8B, seq 8192: called as asked, every row passes, the FLOPs exactly; and
    the step it measured equals the exact prediction byte for byte (as test_full_size_exact_equals_meta)."""
    call, t = run.call, parse_tricks(tricks)
    assert (call["model"], call["setup"], call["tricks"], call["device"]) == (model, Setup(8192), t, "meta")
    assert call["layers"] is None and call["tol"] is None
    r = run.result
    assert r.passed, [(row.quantity, row.exact, row.measured) for row in r.failed]
    assert r.device == "meta" and r.layers_built == r.layers_requested == 36
    assert run.stages == [(0, 2), (1, 2)]
    flops = next(row for row in r.rows if row.quantity.startswith("FLOPs, forward"))
    assert flops.measured == flops.exact  # FlopCounterMode's count, exactly
    assert any("causal" in row.quantity for row in r.rows)  # both conventions reported
    assert all(row.textbook is not None for row in r.rows if row.quantity.startswith("saved for backward"))
    assert run.meta_args == (model.shape, 8192, 1, t)  # measure_meta's step is measure_step(shape, 8192, 1, t)
    assert_exact_equals_meta(model.shape, t, run.measured.step)


def test_the_issue_command_end_to_end():
    """The issue's done-when command, `memcalc verify --device meta --tricks bf16,flash,ckpt --params 8e9
    --seq 8192`: the CLI prints every row passing, verify inside it ran end to end, and the step it
    measured is exact = meta to the byte. (One 8B measurement for the three checks.)"""
    with spying_on_verify() as run:
        args = ["verify", "--device", "meta", "--tricks", "bf16,flash,ckpt", "--params", "8e9", "--seq", "8192", "--bytes"]
        out = CliRunner().invoke(app, args, env={"NO_COLOR": "1"})
    assert out.exit_code == 0, out.output
    assert "textbook" in out.stdout and "exact prediction" in out.stdout and "FAIL" not in out.stdout
    assert "3,556,769,792" not in out.stdout  # the rows compare whole steps; the golden peak is estimate's
    assert "134,785,875,968 B" in out.stdout  # the whole-step peak, predicted = measured
    assert run.call["model"].shape == LLAMA_8B  # what --params 8e9 picks
    assert_verified_end_to_end(run, canonical_model(8_000_000_000), "bf16,flash,ckpt")


def test_verify_meta_end_to_end_gpt():
    """verify --device meta on the textbook GPT layer at 8B width, seq 8192, bf16: every row passes, and
    the step it measured is exact = meta to the byte."""
    model = Model(GPT_8B, n_params(GPT_8B), "test")
    with spying_on_verify() as run:
        verify_run.verify(model, Setup(8192), parse_tricks("bf16"), device="meta")
    assert_verified_end_to_end(run, model, "bf16")


def test_full_size_flops_and_depths():
    """FLOPs under FlopCounterMode in a pass of their own three blocks deep, and per-layer saved bytes from
    depths 1 and 2, at 8B width (the step's FLOPs: the tests above; grown from two and three blocks to 36 they
    equal the full-depth replay's: tests/test_exact_depth.py; the verify runs above count them at 36)."""
    for shape, tricks in ((LLAMA_8B, "bf16,flash,selective"), (GPT_8B, "bf16,ckpt")):
        t = parse_tricks(tricks)
        short = replace(shape, n_layers=3)
        assert flops_alone(short, 8192, 1, t)[0] == exact_step(short, 8192, 1, t).flops.counted
        e = exact_step(shape, 8192, 1, t)
        one, two = saved_at_depth(shape, 8192, 1, t, 1), saved_at_depth(shape, 8192, 1, t, 2)
        assert two - one == e.activations.per_layer_bytes
        assert 2 * one - two == e.activations.outside_bytes


def test_textbook_layer_is_exact_plus_layernorm_stats():
    """The GPT layer at 8B saves the textbook's sbh(34 + 5as/h) plus LayerNorm's fp32 mean and rstd
    (the feasibility probe's 11,878,400,000 bytes)."""
    e = exact_step(GPT_8B, 8192, 1, parse_tricks("bf16"))
    assert e.activations.per_layer_bytes == 11_878_268_928 + 131_072 == 11_878_400_000


@pytest.mark.parametrize("name,batch", [(n, 1) for n in TINY] + [("llama", 2), ("gpt", 2), ("mqa-tied-wide-heads", 2)])
def test_tiny_models_allocation_by_allocation(name, batch):
    """Every allocation of forward, backward and the optimizer step, in order, with the live bytes
    at each: the simulation replays the meta run exactly, for every shape feature and trick set. (The FLOPs of
    the same models and trick sets are test_tiny_flops's, and those counted inside a measured step
    test_flops_counted_in_the_measured_step's: FlopCounterMode beneath the tracker changes no allocation.)"""
    for tricks in ALL_TRICKS:
        t = parse_tricks(tricks)
        phases, g, mem, step, live = sim_vs_meta(TINY[name], 24, batch, t)
        assert_same_step(phases, g, mem, step, live, tricks)


@pytest.mark.parametrize("tricks", ["bf16", "fp16,flash", "bf16,flash,ckpt", "fp32,selective"])
def test_grad_accumulation(tricks):
    """Micro-batches after the first add into existing grads: a higher backward peak, also exact."""
    for name in ("llama", "gpt"):
        phases, _, _, step, _ = sim_vs_meta(TINY[name], 24, 1, parse_tricks(tricks), grad_accum=3)
        for f in FIELDS:
            assert getattr(phases, f) == getattr(step, f), (name, f)


def flops_alone(shape: ModelShape, seq: int, batch: int, tricks: Tricks,
                stack: Stack = DEFAULT_STACK) -> tuple[int, tuple[tuple[str, int], ...]]:  # fmt: skip
    """FlopCounterMode as documented (its module tracker on) around one forward and backward of a fresh model:
    the pass of its own verify counted FLOPs in before it counted them inside the measured step."""
    model, (idx, targets) = build_model(shape, seq, tricks, stack), inputs_for(shape, seq, batch, "meta")
    recipe = recipe_for(model, tricks.precision, stack)
    with paths_for(stack), FlopCounterMode(display=False, custom_mapping=FLASH_FORMULAS) as counter:
        recipe.backward(recipe.forward(idx, targets))
    counts = counter.get_flop_counts()["Global"]
    return counter.get_total_flops(), tuple(sorted((str(k).removeprefix("aten."), v) for k, v in counts.items()))


@pytest.mark.parametrize("name", TINY)
def test_tiny_flops(name):
    """FlopCounterMode in a pass of its own counts the exact replay's FLOPs: the conventions the step is counted by."""
    for tricks in ALL_TRICKS:
        t = parse_tricks(tricks)
        assert flops_alone(TINY[name], 24, 2, t)[0] == exact_step(TINY[name], 24, 2, t).flops.counted, tricks


@pytest.mark.parametrize("family", ["llama", "gpt"])
def test_flops_counted_in_the_measured_step(family):
    """measure_meta's FLOPs, counted inside its measured step, are what FlopCounterMode counts in a pass of its
    own, op by op."""
    for tricks in ("bf16,flash,ckpt", "fp16,selective", "fp32,ckpt:2"):
        t = parse_tricks(tricks)
        m = measure_meta(TINY[family], 24, 2, t)
        assert (m.flops, m.flops_by_op) == flops_alone(TINY[family], 24, 2, t), tricks


@pytest.mark.parametrize("name", TINY)
def test_parameters_as_built(name):
    """The builder makes memcalc.model's parameter count, in the order the mirror assumes."""
    shape = TINY[name]
    model = build(shape, Kernels(), 24, torch.bfloat16)
    assert sum(p.numel() for p in model.parameters()) == n_params(shape)
    sim = mirror_build(Graph(LiveBytes()), StepConfig(shape, 24, 1, Tricks("bf16")))
    assert [tuple(p.shape) for p in model.parameters()] == [p.shape for p in sim.params]
    assert [n for n, _ in model.named_parameters()] == [p.name for p in sim.params]


def test_presets_build_with_their_parameter_count():
    for name in ("gpt2", "llama3-8b", "qwen3-0.6b", "qwen3-8b"):
        shape = PRESETS[name]
        model = build(shape, Kernels(attention="aten-flash"), 1024, torch.bfloat16)
        assert sum(p.numel() for p in model.parameters()) == n_params(shape)


@pytest.mark.parametrize("family", ["llama", "gpt"])
@pytest.mark.parametrize("layers,tricks", [(1, "bf16,flash,ckpt:2"), (1, "bf16,ckpt:2"), (2, "fp32,ckpt:3")])
def test_depths_beside_fewer_blocks_than_n(family, layers, tricks):
    """ckpt:N over fewer than N blocks checkpoints none (memcalc.exact.growth.as_run), nor do the depths verify
    builds beside it: one layer and outside are exact's (depth 2 under ckpt:2 checkpointed its block 1)."""
    shape, t = replace(TINY[family], n_layers=layers), parse_tricks(tricks)
    m, a = measure_meta(shape, 24, 1, t), exact_step(shape, 24, 1, t).activations
    assert (m.saved_one_layer_bytes, m.saved_outside_bytes, m.n_checkpointed) == (a.per_layer_bytes, a.outside_bytes, 0)
    assert m.linear_in_depth and m.step.saved_bytes == a.total_bytes


def test_dropout_and_flash_routing_on_meta():
    """Stock PyTorch on meta would save a 2-byte dropout mask and the s×s math path; the explicit
    routing saves what CUDA saves: a bool mask, and flash's logsumexp instead of the scores."""
    shape = replace(TINY["gpt"], n_layers=1)
    t = parse_tricks("bf16")
    native, _ = measure_step(shape, 24, 1, t, kernels=Kernels("eager", "native"), count_flops=False)
    stock, _ = measure_step(shape, 24, 1, t, kernels=Kernels("eager", "functional"), count_flops=False)
    masks = 4 * 24 * 24 + 2 * 24 * 64  # attention probabilities' mask and both residual branches'
    assert stock.saved_bytes - native.saved_bytes == masks  # one byte more per element
    flash, _ = measure_step(shape, 24, 1, parse_tricks("bf16,flash"), count_flops=False)
    assert ("_scaled_dot_product_flash_attention float32 [1, 4, 24]", 384) in flash.saved_by_op


def test_bad_input():
    with pytest.raises(InputError):
        Kernels(attention="magic")
    with pytest.raises(InputError):
        build(replace(TINY["gpt"], max_positions=16), Kernels(), 24, torch.float32)
    with pytest.raises(InputError):
        exact_step(TINY["gpt"], 100, 1, parse_tricks("bf16"))
    with pytest.raises(InputError):
        verify(canonical_model(8_000_000_000), Setup(8192, optimizer="sgd"), parse_tricks("bf16"), device="meta")
    with pytest.raises(InputError):
        verify(canonical_model(8_000_000_000), Setup(8192), parse_tricks("bf16"), device="meta", layers=0)
