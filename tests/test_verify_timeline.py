"""`memcalc verify --timeline` (issue 23): the live bytes measured at each event of the step laid over the
prediction's; on meta (and CPU tensors for the autocast stacks) every event coincides, for the reference,
torch and hf stacks."""

import importlib.util
from dataclasses import replace

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from typer.testing import CliRunner  # noqa: E402

from memcalc.cli import app  # noqa: E402
from memcalc.memory.estimate import Setup  # noqa: E402
from memcalc.model.params import n_params  # noqa: E402
from memcalc.model.shape import Model, ModelShape  # noqa: E402
from memcalc.model.stacks import stack_for  # noqa: E402
from memcalc.model.tricks import parse_tricks  # noqa: E402
from memcalc.verification.timeline import Overlay  # noqa: E402
from verify.run import verify  # noqa: E402

LLAMA = ModelShape(n_layers=2, hidden=64, n_heads=4, n_kv_heads=2, ffn=160, gated_mlp=True, norm="rmsnorm", vocab=200,
                   tied_embeddings=False, positions="rope")  # fmt: skip
TINY = ["--model", "llama3-8b", "--layers", "2", "--hidden", "64", "--heads", "4", "--kv-heads", "2", "--ffn", "160",
        "--vocab", "200", "--seq", "24"]  # fmt: skip


def overlay(stack, tricks: str, micro_batch: int = 2):
    r = verify(Model(LLAMA, n_params(LLAMA), "test"), Setup(24, micro_batch=micro_batch, stack=stack),
               parse_tricks(tricks), device="meta", timeline=True)  # fmt: skip
    assert r.passed, r.failed
    return r.timeline


@pytest.mark.parametrize("stack,tricks,device", [
    (stack_for("reference"), "bf16,flash", "meta"), (stack_for("reference"), "bf16,flash,ckpt", "meta"),
    (stack_for("torch"), "fp32", "meta"),
    (stack_for("hf", recipe="master", impl="reference"), "bf16,selective", "meta"),
    (stack_for("torch"), "bf16", "cpu"), (stack_for("hf"), "bf16", "cpu"),
])  # fmt: skip
def test_overlay_coincides_at_every_event(stack, tricks, device):
    """Each event (an allocation, or the frees between two) the same op, bytes and live bytes after it; an
    autocast stack is measured on CPU tensors beside the CPU replay."""
    o = overlay(stack, tricks)
    assert o.measured.device == device and o.differing == () and o.first_difference == ""
    assert o.coinciding == len(o.predicted.ops) == len(o.measured.ops) > 100
    assert [s.phase for s in o.measured.phases] == ["forward", "backward", "optimizer"]
    assert max(o.measured.live_bytes) == o.predicted.peak_bytes


def test_a_difference_is_found_where_it_starts():
    o = overlay(stack_for("reference"), "bf16")
    m = o.measured
    k = len(m.ops) // 2
    shifted = replace(m, live_bytes=m.live_bytes[:k] + tuple(x + 512 for x in m.live_bytes[k:]))
    moved = Overlay(o.predicted, shifted)
    assert moved.differing == tuple(range(k, len(m.ops))) and moved.first_difference.startswith(f"event {k + 1:,} ")
    assert Overlay(o.predicted, replace(m, ops=m.ops[:-1], nbytes=m.nbytes[:-1], live_bytes=m.live_bytes[:-1],
                                        )).differing == (len(m.ops) - 1,)  # fmt: skip


def test_cli_chart_and_png(tmp_path):
    png = tmp_path / "v.png"
    args = ["verify", "--device", "meta", *TINY, "--tricks", "bf16,flash", "--timeline"]
    if importlib.util.find_spec("matplotlib") is not None:
        args += ["--png", str(png)]
    out = CliRunner().invoke(app, args, env={"NO_COLOR": "1", "COLUMNS": "100"})
    assert out.exit_code == 0, out.output
    assert "predicted and measured on meta: all " in out.stdout and "events coincide" in out.stdout
    assert "predicted: peak" in out.stdout and "measured on meta: peak" in out.stdout and "differs" not in out.stdout
    assert max(len(x) for x in out.stdout.splitlines()) <= 100
    if png.exists():
        from matplotlib.image import imread

        assert imread(png).shape[:2] == (504, 1200)


@pytest.mark.parametrize("args,message", [(("--matrix",), "drop --matrix"), (("--fsdp", "2"), "drop --matrix"),
                                          (("--device", "cuda"), "--device meta")])  # fmt: skip
def test_cli_refusals(args, message):
    out = CliRunner().invoke(app, ["verify", *TINY, "--tricks", "bf16", "--timeline", *args])
    assert out.exit_code == 2 and message in out.stderr, out.output
    alone = CliRunner().invoke(app, ["verify", *TINY, "--png", "x.png"])
    assert alone.exit_code == 2 and "add --timeline" in alone.stderr
