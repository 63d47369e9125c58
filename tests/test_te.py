"""FP8 training with Transformer Engine's delayed scaling (fp8:te): te.Linear as TransformerEngine v0.10 runs it
under Composer's amp_fp8 (memcalc.exact.aten.te).

Memory: one te.Linear by hand, its saved bytes and fp8 meta tensors from the TE source; the step's saved
activations against the bf16 step's. Time: the GEMMs at the FP8 peak, the fused cast-transpose kernels
counted. Names and refusals: the trick parses and names, and is refused where it cannot run (A100, compile,
sac, the Megatron and DeepSpeed engines) or be measured (verify).
"""

from __future__ import annotations

from dataclasses import replace

import pytest
from typer.testing import CliRunner

from memcalc.cli import app
from memcalc.engine.answer import answer
from memcalc.engine.job import Job
from memcalc.errors import InputError
from memcalc.exact.aten.te import AMAX_HISTORY_LEN, CUBLAS_WORKSPACE, meta_tensors, te_linear
from memcalc.exact.base.config import StepConfig
from memcalc.exact.kernels import kernels_of
from memcalc.exact.replay.meta import simulate
from memcalc.exact.sim.graph import Graph
from memcalc.exact.sim.tensors import LiveBytes
from memcalc.memory.activations import textbook_activations
from memcalc.memory.setup import Setup
from memcalc.model.gpus import gpu
from memcalc.model.params import n_params
from memcalc.model.presets import PRESETS, gpt
from memcalc.model.shape import Model
from memcalc.model.stacks import stack_for
from memcalc.model.tricks import Tricks, parse_tricks
from memcalc.parallel.activations import layer_activations
from memcalc.model.layout import Layout

TE = Tricks("bf16", True, fp8="te")
SHAPE = replace(PRESETS["llama3-8b"], n_layers=2, vocab=2048)


def test_names_and_refusals():
    assert parse_tricks("bf16,fp8:te,flash") == TE
    assert TE.label == "bf16+fp8:te+flash" and TE.names == ["bf16", "fp8:te", "flash"]
    assert parse_tricks(TE.label) == TE  # the name round-trips (CLI, JSON)
    for bad, message in (("fp32,fp8:te", "combine it with bf16"), ("fp8,fp8:te", "one fp8 recipe"),
                         ("fp8:te,compile", "not compile or sac"), ("fp8:te,sac", "not compile or sac")):  # fmt: skip
        with pytest.raises(InputError, match=message):
            parse_tricks(bad)
    model = Model(SHAPE, n_params(SHAPE), "test")
    with pytest.raises(InputError, match="fp8:te needs FP8 tensor cores"):  # the A100 has none
        Job(model, Setup(2048), gpu("a100-80gb"), trick_sets=(TE,))
    for stack in ("megatron", "deepspeed"):
        with pytest.raises(InputError, match="Transformer Engine's te.Linear"):
            answer(Job(model, Setup(2048, stack=stack_for(stack)), gpu("h100-sxm"), Layout(dp=8, zero=1), (TE,)))


def test_verify_refuses_in_one_line():
    out = CliRunner().invoke(app, ["verify", "--model", "llama3-8b", "--layers", "2", "--tricks", "bf16,fp8:te",
                                   "--device", "meta"])  # fmt: skip
    assert out.exit_code == 2
    assert out.output.strip().count("\n") == 0 and "verify cannot measure fp8:te" in out.output


# ---- memory ---------------------------------------------------------------------------------------


def test_one_te_linear_by_hand():
    """te.Linear(x) for x (4, 64, 256) bf16 and a (512, 256) bf16 weight with bias, on its own.

    transformer_engine/pytorch/module/linear.py @ v0.10 (96ed6fc69d99a9cff49637dbc58c837c8d921ad7), _Linear.forward:
    ctx.save_for_backward(inputmat_t (fp8, in x rows), weight, weight_t_fp8 (fp8, in x out),
    scaling_fwd.scale_inv.clone()): 256·256 + 256·512 bytes of fp8 and 3 fp32; the fp8 input itself and the
    fp8 weight (module/base.py get_fp8_weights_empty_tensors, is_first_microbatch None) die with forward."""
    g = Graph(LiveBytes())
    g.kernels = []
    x = g.param((4, 64, 256), "bf16", "x")
    w, b = g.param((512, 256), "bf16", "w"), g.param((512,), "bf16", "b")
    before = g.mem.live_bytes
    y = te_linear(g, x, w, b)
    rows = 4 * 64
    saved = rows * 256 + 256 * 512 + 3 * 4  # inputmat_t, weight_t_fp8, scale_inv's clone
    assert g.mem.live_bytes - before == saved + rows * 512 * 2  # and the bf16 output
    # at the GEMM: the input and the weight in fp8 and their transposes, and the output (scale_inv is cloned after)
    assert g.mem.peak_bytes - before == 2 * rows * 256 + 2 * 256 * 512 + rows * 512 * 2
    casts = [k for k in g.kernels if k.op == "te_cast_transpose"]
    # fp8_cast_transpose_fused: reads the bf16 tensor (and the 4-byte scale), writes it and its transpose in fp8
    # and the amax into the history
    assert [(k.read_bytes, k.write_bytes) for k in casts] == [(rows * 256 * 2 + 4, 2 * rows * 256 + 4),
                                                               (512 * 256 * 2 + 4, 2 * 512 * 256 + 4)]
    (gemm,) = [k for k in g.kernels if k.op == "te_fp8_gemm"]
    assert (gemm.unit, gemm.dtype, gemm.flops) == ("tensor", "fp8-e4m3", 2 * rows * 256 * 512)
    g.backward(y)
    # backward: one cast-transpose to e5m2 fused with the bias gradient, then dgrad and wgrad in fp8
    assert [k.op for k in g.kernels if k.phase == "backward" and k.op.startswith("te_")] == [
        "te_scale_update", "te_amax_roll", "te_cast_transpose_bgrad", "te_fp8_gemm", "te_fp8_gemm"]


def test_meta_tensors():
    """module/base.py @ v0.10 set_meta_tensor: per GEMM 3 fp8 tensors forward (input, weight, output) and 2
    backward (grad_output, grad_input); scale and scale_inv (n fp32), amax_history (amax_history_len x n
    fp32), the non-weight mask (n bools). Composer's amp_fp8: amax_history_len = 16."""
    g = Graph(LiveBytes())
    metas = meta_tensors(g)
    assert AMAX_HISTORY_LEN == 16
    assert [t.shape for t in metas] == [(3,), (3,), (16, 3), (3,), (2,), (2,), (16, 2), (2,)]
    assert g.mem.live_bytes == 4 * (3 + 3 + 48) + 3 + 4 * (2 + 2 + 32) + 2 == 365


def test_the_step_saves_fp8_inputs_and_weight_transposes():
    """One block of Llama 3 8B's width: each of its 7 linears saves its input as an fp8 transpose (the bf16 step
    saves q/k/v's and gate/up's shared input once, in bf16), and the fp8 transpose of its weight."""
    seq, b = 1024, 1
    plain, te = (simulate(StepConfig(replace(SHAPE, n_layers=1), seq, b, Tricks("bf16", True, fp8=f)))
                 for f in ("", "te"))
    saved = {t.what: 0 for t in te[1].saved_terms}
    for t in te[1].saved_terms:
        saved[t.what] += t.nbytes
    h, kv, f = SHAPE.hidden, SHAPE.kv_dim, SHAPE.ffn
    tokens = seq * b
    assert saved["inputmat_t (fp8)"] == tokens * (3 * h + h + 2 * h + f)  # q, k, v; o; gate, up; down
    assert saved["weight_t_fp8"] == h * h + 2 * h * kv + h * h + 3 * h * f
    assert saved["scale_inv"] == 7 * 3 * 4
    metas = 7 * 365 + CUBLAS_WORKSPACE  # the block's 7 modules' fp8 meta, one cuBLAS workspace
    assert te[0].state_bytes - plain[0].state_bytes == metas


def test_textbook_layers_count_the_fp8_copies():
    """Korthikanti et al.'s Table 2 under fp8:te (a GPT layer, f = 4h): 34·s·b·h less the halved linear inputs
    (QKV 1, MLP 1, projection 1, GeLU output 4), plus one byte per weight of the layer's linears."""
    shape = gpt("gpt", 24, 2048, 16, 2048)
    s, b, h = 2048, 4, 2048
    plain = layer_activations(shape, s, b, Tricks("bf16", True))
    te = layer_activations(shape, s, b, TE)
    assert plain.per_layer_bytes == 34 * s * b * h
    assert te.per_layer_bytes == 27 * s * b * h + 12 * h * h
    ckpt = layer_activations(shape, s, b, replace(TE, recompute="full"))
    assert ckpt.per_layer_bytes == 2 * s * b * h and ckpt.rebuilt_bytes == te.per_layer_bytes
    one_gpu = textbook_activations(shape, s, b, TE)  # the one-GPU textbook (sec. 4.1's terms) counts the same
    assert one_gpu.per_layer_bytes == te.per_layer_bytes


# ---- time -----------------------------------------------------------------------------------------


def test_gemms_at_the_fp8_peak_and_the_casts_counted():
    """Every linear of a block: forward, dgrad and wgrad as fp8 GEMMs with the bf16 step's FLOPs; its casts: the
    input's and the weight's in forward, the gradient's in backward; and two scale updates per module."""
    def block(t):
        return [k for k in kernels_of(PRESETS["llama3-8b"], 8192, 1, t) if k.layer == 0 and k.phase != "recompute"]

    bf16, te = block(Tricks("bf16", True)), block(TE)
    linear = [[k for k in ks if k.unit == "tensor" and k.count_kind == "linear"] for ks in (bf16, te)]
    assert sum(k.flops * k.count for k in linear[0]) == sum(k.flops * k.count for k in linear[1])
    assert {k.op for k in linear[1]} == {"te_fp8_gemm"} and {k.dtype for k in linear[1]} == {"fp8-e4m3"}
    def count(op):  # kernels_of merges equal kernels into one with a count
        return sum(k.count for k in te if k.op == op)

    assert count("te_cast_transpose") == 7 * 2 + 7  # no biases: the gradient's cast has no bgrad
    assert count("te_scale_update") == 7 * 2


def test_fp8_te_step_is_faster_than_bf16_when_matmul_bound():
    """Llama 3 8B at seq 8192 on an H100: the linears' GEMMs dominate, so fp8:te is faster, by less than the
    2x of the peaks (attention, the casts and the rest stay)."""
    model = Model(PRESETS["llama3-8b"], n_params(PRESETS["llama3-8b"]), "test")
    bf16, te = answer(Job(model, Setup(8192), gpu("h100-sxm"), trick_sets=(Tricks("bf16", True), TE))).roofline
    assert 0.5 < te.step_seconds / bf16.step_seconds < 0.85

