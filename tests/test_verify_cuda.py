"""The CUDA measurement path. Where CUDA is absent it runs on CPU tensors, the tracker standing in
for the allocator (CpuStats): the same code, the same phases, the fall-back to fewer layers. The
tests marked `cuda` run only where a GPU is present and skip cleanly elsewhere."""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")

import verify.run as run  # noqa: E402
from memcalc.errors import InputError  # noqa: E402
from memcalc.memory.estimate import Setup  # noqa: E402
from memcalc.model.params import n_params  # noqa: E402
from memcalc.model.shape import Model, ModelShape  # noqa: E402
from memcalc.model.tricks import parse_tricks  # noqa: E402
from verify.cuda import CpuStats, deepest_fit  # noqa: E402

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

# RMSNorm: CPU's LayerNorm keeps bf16 statistics where CUDA (and meta) keep fp32, so the CPU
# stand-in compares 16-bit recipes on the llama family and the GPT layer in fp32.
LLAMA = ModelShape(n_layers=4, hidden=64, n_heads=4, n_kv_heads=2, ffn=160, gated_mlp=True, norm="rmsnorm",
                   vocab=200, tied_embeddings=False, positions="rope", qk_norm=True, name="tiny-llama")  # fmt: skip
GPT = ModelShape(n_layers=4, hidden=64, n_heads=4, vocab=200, linear_bias=True, positions="learned",
                 max_positions=64, dropout=0.1, name="tiny-gpt")  # fmt: skip
SETUP = Setup(32, micro_batch=2)


def model_of(shape: ModelShape) -> Model:
    return Model(shape, n_params(shape), "test")


@pytest.mark.parametrize("shape,tricks", [(LLAMA, "fp32"), (LLAMA, "bf16"), (LLAMA, "fp16"), (LLAMA, "bf16,ckpt"),
                                          (LLAMA, "bf16,selective"), (GPT, "fp32"), (GPT, "fp32,ckpt"),
                                          (GPT, "bf16")])  # fmt: skip
def test_cpu_stand_in_equals_exact(shape, tricks):
    stages = []
    r = run.verify(model_of(shape), SETUP, parse_tricks(tricks), device="cpu", steps=2,
                   progress=lambda *a: stages.append(a))  # fmt: skip
    assert r.passed and r.error is None, [(row.quantity, row.exact, row.measured) for row in r.failed]
    for row in r.rows:
        if row.unit == "bytes" and row.exact is not None:
            assert row.measured == row.exact, row.quantity  # real tensors, to the byte
    assert r.phases is not None and r.timing is not None and r.timing.steps == 2
    assert r.phases.step_peak_bytes == max(r.phases.forward_peak_bytes, r.phases.backward_peak_bytes,
                                           r.phases.optimizer_peak_bytes)  # fmt: skip
    assert [s[1:] for s in stages] == [(0, 2), (1, 2)]


def test_deepest_model_that_fits():
    """A model the prediction says will not fit is built as deep as fits, and says so."""
    limit = 3_600_000  # between the 3- and 4-layer predictions of tiny-llama in fp32
    r = run.verify(model_of(LLAMA), SETUP, parse_tricks("fp32"), device="cpu", steps=1, cpu_limit_bytes=limit)
    assert r.passed and r.layers_requested == 4 and r.layers_built == 3
    assert "3 fit" in r.layers_note


def test_out_of_memory_retries_shallower(monkeypatch):
    """The prediction believes it fits (margin lifted), the device runs out: retried with fewer layers."""
    monkeypatch.setattr(run, "FIT_MARGIN", 100.0)
    r = run.verify(model_of(LLAMA), SETUP, parse_tricks("fp32"), device="cpu", steps=1, cpu_limit_bytes=3_600_000)
    assert r.passed and r.layers_built < 4
    assert "ran out of memory" in r.layers_note


def test_matrix_reports_out_of_memory_and_goes_on():
    tricks = (parse_tricks("fp32"), parse_tricks("bf16"), parse_tricks("bf16,ckpt"))
    seen = []
    results = run.verify_matrix(model_of(LLAMA), SETUP, device="cpu", trick_sets=tricks, steps=1,
                                cpu_limit_bytes=100_000, progress=lambda *a: seen.append(a))  # fmt: skip
    assert [r.tricks for r in results] == ["fp32", "bf16", "bf16+ckpt"]
    assert all(r.error and "out of memory" in r.error and not r.passed for r in results)
    assert seen[-1] == ("done", 3, 3)


def test_matrix_runs_every_combination_on_meta():
    shape = ModelShape(n_layers=2, hidden=64, n_heads=4, vocab=200, linear_bias=True, positions="learned",
                       max_positions=64, dropout=0.1, name="tiny")  # fmt: skip
    results = run.verify_matrix(model_of(shape), Setup(32), device="meta")
    assert [r.tricks for r in results] == [t.label for t in run.MATRIX]
    assert all(r.passed for r in results)


def test_deepest_fit_search():
    assert deepest_fit(LLAMA, lambda L: L <= 3) == 3
    assert deepest_fit(LLAMA, lambda L: False) == 0
    assert deepest_fit(LLAMA, lambda L: True) == 4


def test_devices_and_gpus():
    assert run.gpu_for("NVIDIA H200").key == "h200"
    assert run.gpu_for("NVIDIA H100 80GB HBM3").key == "h100-sxm"
    assert run.gpu_for("NVIDIA H100 PCIe").key == "h100-pcie"
    assert run.gpu_for("NVIDIA A100-SXM4-40GB").key == "a100-40gb"
    assert run.gpu_for("Tesla T4") is None
    with pytest.raises(InputError):
        run.pick_device("tpu")
    if not torch.cuda.is_available():
        assert run.pick_device(None)[0] == "meta"
        with pytest.raises(InputError):
            run.pick_device("cuda")
    with pytest.raises(InputError):
        run.verify(model_of(LLAMA), SETUP, parse_tricks("bf16,flash"), device="cpu")


def test_timing_carries_the_roofline_prediction():
    """On a GPU of the table, verify's timing holds the roofline's step time for the model as built,
    every op of it in the JSON, and the table and the matrix show it beside the measurement."""
    from dataclasses import replace

    from memcalc.model.gpus import GPUS
    from memcalc.report import verify as vr
    from memcalc.report.render import to_json
    from memcalc.time.calibration import calibration_for
    from memcalc.time.roofline import roofline
    from memcalc.verification.results import to_dict
    from verify.cuda import DeviceRun

    t, h100 = parse_tricks("bf16"), GPUS["h100-sxm"]
    r = run.verify(model_of(LLAMA), SETUP, t, device="cpu", steps=1, linearity=False)
    assert r.timing.predicted_seconds is None  # the CPU stand-in is no GPU of the table
    device = DeviceRun(4, r.phases, (0.010, 0.012, 0.011), ())
    timing = run.timing_of(device, run.exact_step(LLAMA, 32, 2, t), SETUP, t, h100, LLAMA)
    predicted = roofline(LLAMA, 32, 2, 1, t, h100, calibration_for("h100-sxm"))
    assert timing.predicted_seconds == predicted.step_seconds and timing.calibration == "h100-sxm.json"
    assert timing.predicted_error == pytest.approx(0.011 / predicted.step_seconds - 1)
    data = json.loads(to_json(to_dict(replace(r, timing=timing))))
    assert data["timing"]["predicted_ops"][0]["op"] == predicted.ops[0].op
    assert data["timing"]["predicted_error"] == pytest.approx(timing.predicted_error)
    shown = replace(r, timing=timing)
    assert "predicted by the roofline" in [row[0] for row in vr.timing_section(shown).rows]
    matrix = vr.matrix_sections([shown], "gb")[0]
    assert matrix.headers[6:8] == ["step time", "predicted"] and len(matrix.rows[0]) == len(matrix.headers)


def test_cpu_stats_limit():
    stats = CpuStats(limit_bytes=1000)
    with pytest.raises(torch.cuda.OutOfMemoryError):
        with stats.context():
            torch.empty(2000, dtype=torch.uint8)


# -- on a GPU -------------------------------------------------------------------------------------


@cuda
def test_cuda_stats_count():
    from verify.cuda import CudaStats

    stats = CudaStats()
    stats.reset_peak()
    base = stats.allocated()
    x = torch.empty(1 << 20, dtype=torch.uint8, device="cuda")
    assert stats.allocated() - base == 1 << 20 and stats.max_allocated() >= base + (1 << 20)
    del x


@cuda
@pytest.mark.parametrize("tricks", ["bf16", "bf16,flash", "bf16,flash,ckpt"])
def test_cuda_verify_small(tricks):
    """A small model on the GPU: the step runs, the phases are real, weights and state match."""
    shape = ModelShape(n_layers=4, hidden=1024, n_heads=8, n_kv_heads=2, ffn=2816, gated_mlp=True, norm="rmsnorm",
                       vocab=32000, tied_embeddings=False, positions="rope", qk_norm=True, name="small")  # fmt: skip
    r = run.verify(model_of(shape), Setup(2048), parse_tricks(tricks), device="cuda", steps=2, linearity=True)
    assert r.error is None, r.error
    assert r.gpu_name and r.timing is not None and r.timing.step_seconds > 0
    rows = {row.quantity: row for row in r.rows}
    weights = next(row for q, row in rows.items() if q.startswith("after build"))
    assert abs(weights.error) < 0.01  # weights: allocator rounding only
    if "flash" in tricks:
        assert "_scaled_dot_product_flash_attention" in r.attention or "flash" in r.attention
    assert r.phases.forward_peak_bytes > 0 and r.phases.reserved_peak_bytes >= r.phases.step_peak_bytes
