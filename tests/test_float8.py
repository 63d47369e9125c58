"""FP8 training (torchao's float8 linears) and torch.compile's fused kernels.

Memory: memcalc.exact.aten.float8 replays torchao's Float8Linear op by op; held here to torchao itself
(convert_to_float8_training on verify/builder.py's model, measured on meta: every op the float8 subclass
runs reaches the counter) for both recipes, with checkpointing and torchtitan's per-op SAC, under the
reference recipe, torch.autocast (on CPU tensors) and FSDP2 on the fake process group.
Time: the float8 matmuls at the FP8 peak; compile's fused kernels read and write less than eager's.
"""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from memcalc.engine.answer import answer
from memcalc.engine.job import Job
from memcalc.errors import InputError
from memcalc.exact.base.config import StepConfig
from memcalc.exact.base.kernel import STEP_PHASES
from memcalc.exact.kernels import kernels_of
from memcalc.exact.replay.meta import simulate
from memcalc.memory.setup import Setup
from memcalc.model.gpus import gpu
from memcalc.model.params import n_params
from memcalc.model.presets import PRESETS
from memcalc.model.shape import Model
from memcalc.model.stacks import stack_for
from memcalc.model.tricks import Tricks, parse_tricks
from memcalc.model.layout import Layout

# 8B's width, two blocks, a small vocabulary: the peaks fall inside the blocks, where float8's casts add to them
SHAPE = replace(PRESETS["llama3-8b"], n_layers=2, vocab=2048)
FIELDS = ("weights_bytes", "state_bytes", "retained_bytes", "grads_bytes", "forward_peak_bytes",
          "backward_peak_bytes", "optimizer_peak_bytes")  # fmt: skip


def test_names_and_refusals():
    assert parse_tricks("bf16,fp8,flash") == Tricks("bf16", True, fp8="tensorwise")
    assert parse_tricks("fp8:rowwise").label == "bf16+fp8:rowwise"
    assert parse_tricks("fp8:tensorwise,compile") == Tricks("bf16", fp8="tensorwise", compile=True)
    for bad, message in (("fp32,fp8", "combine it with bf16"), ("fp8,fp8:rowwise", "one fp8 recipe"),
                         ("fp8:blockwise", "unknown trick")):  # fmt: skip
        with pytest.raises(InputError, match=message):
            parse_tricks(bad)
    model = Model(SHAPE, n_params(SHAPE), "test")
    with pytest.raises(InputError, match="FP8 tensor cores"):
        Job(model, Setup(2048), gpu("a100-80gb"), trick_sets=(parse_tricks("bf16,fp8"),))
    for stack in ("megatron", "deepspeed"):
        with pytest.raises(InputError, match="Transformer Engine"):
            answer(Job(model, Setup(2048, stack=stack_for(stack)), gpu("h100-sxm"), Layout(dp=8, zero=1),
                       (parse_tricks("bf16,fp8"),)))  # fmt: skip


def test_saved_activations_are_the_16_bit_recipes():
    """Float8Linear saves its bf16 input and the weight: only temporaries differ (the forward peak rises)."""
    plain = simulate(StepConfig(SHAPE, 4096, 2, Tricks("bf16", True)))[0]
    for recipe in ("tensorwise", "rowwise"):
        fp8 = simulate(StepConfig(SHAPE, 4096, 2, Tricks("bf16", True, fp8=recipe)))[0]
        assert fp8.retained_bytes == plain.retained_bytes
        assert fp8.forward_peak_bytes > plain.forward_peak_bytes


torch = pytest.importorskip("torch")
pytest.importorskip("torchao")


@pytest.mark.parametrize("tricks", ["bf16,flash,fp8", "bf16,fp8:rowwise", "bf16,flash,fp8,ckpt",
                                    "bf16,flash,fp8:rowwise,sac"])  # fmt: skip
def test_reference_recipe_equals_torchao_on_meta(tricks):
    from verify.meta import measure_step

    t = parse_tricks(tricks)
    phases = simulate(StepConfig(SHAPE, 4096, 2, replace(t, compile=False)))[0]
    step, _ = measure_step(SHAPE, 4096, 2, t, count_flops=False)
    for f in FIELDS:
        assert getattr(phases, f) == getattr(step, f), f


def test_torch_autocast_equals_torchao_on_cpu():
    """The stock torch loop (autocast over fp32 weights) on CPU tensors at reduced size, as verify runs it."""
    from typer.testing import CliRunner

    from memcalc.cli import app

    out = CliRunner().invoke(app, ["verify", "--model", "llama3-8b", "--layers", "2", "--hidden", "256", "--heads",
                                   "4", "--kv-heads", "2", "--ffn", "512", "--vocab", "512", "--seq", "256",
                                   "--tricks", "bf16,fp8:rowwise,ckpt", "--stack", "torch", "--device", "meta"])  # fmt: skip
    assert out.exit_code == 0, out.output
    assert "Pass" in out.output


def test_fsdp2_equals_torchao_on_the_fake_process_group():
    from verify.distributed import verify_distributed

    result = verify_distributed(Model(SHAPE, n_params(SHAPE), "test"), Setup(2048, stack=stack_for("fsdp2")),
                                parse_tricks("bf16,flash,fp8"), Layout(dp=4, zero=3), ranks=(0,))  # fmt: skip
    for rc in result.ranks:
        for r in rc.rows:
            if r.checked:
                assert r.unexplained_bytes == 0, (r.quantity, r.error_bytes)
    assert result.passed


# ---- time ---------------------------------------------------------------------------------------


def step_seconds(tricks: str, shape=PRESETS["llama3-8b"]) -> float:
    model = Model(shape, n_params(shape), "test")
    (step,) = answer(Job(model, Setup(8192), gpu("h100-sxm"), trick_sets=(parse_tricks(tricks),))).roofline
    return step.step_seconds


def test_float8_matmuls_run_at_the_fp8_peak():
    """The same FLOPs, on the FP8 tensor cores: the linears' matmul time halves (same efficiency, twice the peak)."""
    def linear(t):
        ks = kernels_of(PRESETS["llama3-8b"], 8192, 1, t)
        return [k for k in ks if k.unit == "tensor" and k.count_kind == "linear" and k.layer is not None]

    bf16, fp8 = linear(Tricks("bf16", True)), linear(Tricks("bf16", True, fp8="tensorwise"))
    assert sum(k.flops * k.count for k in bf16) == sum(k.flops * k.count for k in fp8)
    assert {k.op for k in fp8} == {"_scaled_mm"} and {k.dtype for k in fp8} == {"fp8-e4m3", "fp8-e5m2"}


@pytest.mark.slow("test_plan_keeps_fp8_and_compile (compile's kernels, in the plan's step)")
def test_compile_fuses_the_elementwise_kernels():
    """One block's kernels: the matmuls and attention unchanged, fewer elementwise kernels moving fewer bytes;
    eager float8 is slower than bf16 (torchao's casts), compiled float8 faster than compiled bf16."""
    for base in (Tricks("bf16", True), Tricks("bf16", True, fp8="tensorwise")):
        eager, fused = (kernels_of(PRESETS["llama3-8b"], 8192, 1, replace(base, compile=c)) for c in (False, True))
        block = [[k for k in ks if k.layer is not None and k.phase in STEP_PHASES] for ks in (eager, fused)]
        mm = [sorted((k.op, k.flops, k.count) for k in ks if k.unit != "vector") for ks in block]
        assert mm[0] == mm[1]
        vec = [[k for k in ks if k.unit == "vector"] for ks in block]
        assert sum(k.count for k in vec[1]) < sum(k.count for k in vec[0]) / 5
        moved = [sum((k.read_bytes + k.write_bytes) * k.count for k in ks) for ks in vec]
        assert moved[1] < moved[0] / 2
    eager_bf16, eager_fp8 = step_seconds("bf16,flash"), step_seconds("bf16,flash,fp8")
    compiled_bf16, compiled_fp8 = step_seconds("bf16,flash,compile"), step_seconds("bf16,flash,fp8,compile")
    assert eager_fp8 > eager_bf16 > compiled_bf16 > compiled_fp8


def test_plan_keeps_fp8_and_compile():
    """plan searches the recompute modes of the trick set it is given, float8 and compile kept."""
    from typer.testing import CliRunner

    from memcalc.cli import app

    args = ["plan", "--model", "llama3-8b", "--gpus", "8", "--seq", "8192", "--global-batch", "16", "--stack", "fsdp2"]
    out = CliRunner().invoke(app, args + ["--tricks", "bf16,fp8,flash,compile", "--format", "json"])
    assert out.exit_code == 0, out.output
    text = CliRunner().invoke(app, args + ["--tricks", "bf16,fp8,flash,compile"]).output
    assert "bf16 + fp8 + flash + compile" in " ".join(text.split())
    assert json.loads(out.output)["tricks"] == ["bf16", "fp8", "flash", "compile"]
