"""The Hugging Face Transformers stack: memcalc.exact.hf.model's prediction equals the measurement of
Transformers' own model classes (verify/hf.py) to the byte.

Tiny models allocation by allocation for every architecture feature and trick set, on meta and on
real CPU tensors; Llama-3-8B's, Qwen3-8B's and GPT-2's blocks at 8B width and seq 8192; and each place
where what is measured here is not what CUDA runs, named and pinned down.
"""

from __future__ import annotations

import itertools
from dataclasses import replace

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from typer.testing import CliRunner  # noqa: E402

from memcalc.cli import app  # noqa: E402
from memcalc.errors import InputError  # noqa: E402
from memcalc.exact.base.config import StepConfig  # noqa: E402
from memcalc.exact.hf.model import arch_for, param_shapes  # noqa: E402
from memcalc.exact.hf.model import build as hf_build  # noqa: E402
from memcalc.exact.replay.meta import simulate  # noqa: E402
from memcalc.exact.sim.graph import Graph  # noqa: E402
from memcalc.exact.sim.tensors import LiveBytes  # noqa: E402
from memcalc.exact.step import exact_step  # noqa: E402
from memcalc.memory.estimate import Setup  # noqa: E402
from memcalc.model.params import n_params  # noqa: E402
from memcalc.model.presets import PRESETS  # noqa: E402
from memcalc.model.shape import Model, ModelShape  # noqa: E402
from memcalc.model.stacks import DEFAULT_STACK, stack_for  # noqa: E402
from memcalc.model.tricks import Tricks, parse_tricks  # noqa: E402
from tests.replay import FIELDS, assert_same_step  # noqa: E402
from tests.replay import GPT_8B as REPLAY_GPT_8B  # noqa: E402
from tests.test_verify_meta import flops_alone  # noqa: E402
from verify.hf import build_hf, cuda_paths  # noqa: E402
from verify.meta import measure_step, saved_at_depth  # noqa: E402
from verify.run import verify  # noqa: E402

HF = stack_for("hf", recipe="master", impl="reference")  # the recipe verify/recipes.py trains
ALL_TRICKS = ("fp32", "bf16", "fp16", "bf16,flash", "bf16,flash,ckpt", "bf16,selective", "bf16,flash,selective",
              "bf16,ckpt")  # fmt: skip
GPT_8B = replace(REPLAY_GPT_8B, name="gpt2-8b-width")  # built as Transformers' GPT-2

TINY = {  # each builds as the Transformers architecture named
    "llama": ModelShape(n_layers=2, hidden=64, n_heads=4, n_kv_heads=2, ffn=160, gated_mlp=True, norm="rmsnorm",
                        vocab=200, tied_embeddings=False, positions="rope"),
    "qwen3": ModelShape(n_layers=2, hidden=64, n_heads=4, n_kv_heads=2, ffn=160, gated_mlp=True, norm="rmsnorm",
                        vocab=200, tied_embeddings=False, positions="rope", qk_norm=True),
    "gpt2": ModelShape(n_layers=2, hidden=64, n_heads=4, vocab=200, linear_bias=True, positions="learned",
                       max_positions=64, dropout=0.1),
    "qwen2": ModelShape(n_layers=2, hidden=64, n_heads=4, n_kv_heads=2, ffn=160, gated_mlp=True, norm="rmsnorm",
                        vocab=200, positions="rope", qkv_bias=True),
    "llama-mha-tied": ModelShape(n_layers=2, hidden=64, n_heads=4, ffn=160, gated_mlp=True, norm="rmsnorm",
                                 vocab=200, positions="rope"),
    "qwen3-mqa-wide-heads": ModelShape(n_layers=2, hidden=64, n_heads=4, n_kv_heads=1, head_dim=32, ffn=96,
                                       gated_mlp=True, norm="rmsnorm", vocab=200, positions="rope", qk_norm=True),
    "gpt2-untied-no-dropout": ModelShape(n_layers=2, hidden=64, n_heads=4, vocab=200, linear_bias=True,
                                         positions="learned", max_positions=32, tied_embeddings=False),
    "llama-attention-dropout": ModelShape(n_layers=2, hidden=64, n_heads=4, n_kv_heads=2, ffn=160, gated_mlp=True,
                                          norm="rmsnorm", vocab=200, tied_embeddings=False, positions="rope",
                                          dropout=0.1),
}  # fmt: skip
ARCH = {"llama": "llama", "qwen3": "qwen3", "gpt2": "gpt2", "qwen2": "qwen2", "llama-mha-tied": "llama",
        "qwen3-mqa-wide-heads": "qwen3", "gpt2-untied-no-dropout": "gpt2", "llama-attention-dropout": "llama"}  # fmt: skip


def config(shape: ModelShape, seq: int, batch: int, tricks: Tricks, grad_accum: int = 1,
           device: str = "meta") -> StepConfig:  # fmt: skip
    """The replay's job; on CPU tensors it is told so (Transformers makes some tensors on the device)."""
    stack = replace(DEFAULT_STACK, model="hf", use_cache=HF.use_cache)
    return StepConfig(shape, seq, batch, replace(tricks, ckpt_every=1), stack, grad_accum=grad_accum,
                      device="cpu" if device == "cpu" else "cuda")  # fmt: skip


def assert_replayed(shape: ModelShape, seq: int, batch: int, tricks: Tricks, device: str = "meta",
                    grad_accum: int = 1) -> None:  # fmt: skip
    """Every phase's bytes, the saved bytes, and every allocation with the live bytes at it. The FLOPs are
    not counted here (FlopCounterMode is a third of a tiny step's time): the full-size tests check them."""
    phases, g, mem = simulate(config(shape, seq, batch, tricks, grad_accum, device), timeline=True)
    model = build_hf(shape, tricks, seq, device=device, use_cache=HF.use_cache) if device != "meta" else None
    step, live = measure_step(shape, seq, batch, tricks, device=device, model=model, grad_accum=grad_accum,
                              timeline=True, stack=HF, count_flops=False)  # fmt: skip
    assert_same_step(phases, g, mem, step, live, tricks.label)


def test_shapes_build_as_their_architecture():
    for name, arch in ARCH.items():
        assert arch_for(TINY[name]) == arch
    assert arch_for(PRESETS["llama3-8b"]) == "llama" and arch_for(PRESETS["qwen3-8b"]) == "qwen3"
    assert arch_for(PRESETS["gpt2"]) == "gpt2"
    with pytest.raises(InputError, match="no Transformers architecture"):
        arch_for(replace(TINY["gpt2"], linear_bias=False))  # GPT-2's Conv1D layers always have biases


@pytest.mark.parametrize("name", TINY)
def test_parameters_and_buffers_as_transformers_registers_them(name):
    """named_parameters() of Transformers' model, names, shapes and order: what the optimizer walks."""
    shape = TINY[name]
    model = build_hf(shape, parse_tricks("bf16"), 24).model
    assert [(n, tuple(p.shape)) for n, p in model.named_parameters()] == param_shapes(shape, ARCH[name])
    sim = hf_build(Graph(LiveBytes()), config(shape, 24, 1, parse_tricks("bf16")))
    assert [p.name for p in sim.params] == [n for n, _ in model.named_parameters()]
    buffers = [(tuple(b.shape), b.dtype) for b in model.buffers()]
    assert buffers == [((shape.head_dim // 2,), torch.float32)] * len(sim.rope)  # inv_freq, original_inv_freq
    assert sum(p.numel() for p in model.parameters()) == n_params(shape)


@pytest.mark.parametrize("name,batch", [(n, 1) for n in TINY] + [(n, 2) for n in ("llama", "qwen3", "gpt2")])
def test_tiny_models_allocation_by_allocation(name, batch):
    """Every trick set, every allocation of forward, backward and the optimizer step, in order."""
    for tricks in ALL_TRICKS:
        assert_replayed(TINY[name], 24, batch, parse_tricks(tricks))


@pytest.mark.parametrize("tricks", ["bf16", "bf16,flash,ckpt"])
def test_grad_accumulation(tricks):
    for name in ("llama", "gpt2"):
        assert_replayed(TINY[name], 24, 1, parse_tricks(tricks), grad_accum=3)


# At 8B width the steps are measured three blocks deep (every byte of a block full size: what is measured is the
# stack's bytes), but for one at full depth; the step grown from two and three blocks to the full depth equals
# the full-depth replay for each trick set here (tests/test_exact_depth.py, test_grown_phases_with_transformers_model).


@pytest.mark.parametrize("name", ["llama3-8b", "qwen3-8b"])
def test_full_size_flash_ckpt(name):
    """8B's blocks at seq 8192, three deep, bf16 + flash + full checkpointing: every byte count of the step."""
    shape, t = replace(PRESETS[name], n_layers=3), parse_tricks("bf16,flash,ckpt")
    step, _ = measure_step(shape, 8192, 1, t, stack=HF)
    e = exact_step(shape, 8192, 1, t, stack=HF)
    for f in FIELDS:
        assert getattr(e.phases, f) == getattr(step, f), f
    assert e.activations.total_bytes == step.saved_bytes
    assert e.activations.per_layer_bytes == 2 * 8192 * 4096  # the layer's input, kept by the checkpoint
    assert step.flops == e.flops.counted


def test_full_size_llama3_flash_depths_and_flops():
    """Llama-3-8B, seq 8192, bf16 + flash, the report's case: per-layer and outside saved bytes from
    depths 1 and 2, and FlopCounterMode's count (the step's: the tests beside it)."""
    shape, t = PRESETS["llama3-8b"], parse_tricks("bf16,flash")
    e = exact_step(shape, 8192, 1, t, stack=HF)
    one, two = saved_at_depth(shape, 8192, 1, t, 1, HF), saved_at_depth(shape, 8192, 1, t, 2, HF)
    assert two - one == e.activations.per_layer_bytes == 1_645_281_304
    assert 2 * one - two == e.activations.outside_bytes
    assert flops_alone(shape, 8192, 1, t, HF)[0] == e.flops.counted


@pytest.mark.parametrize("shape,tricks", [(replace(GPT_8B, n_layers=3), "bf16,flash,ckpt"),
                                          (GPT_8B, "bf16,flash"),  # the hf stack's step at full depth, 36 blocks
                                          (replace(PRESETS["qwen3-8b"], n_layers=3), "bf16,selective")])  # fmt: skip
def test_full_size_other_cases(shape, tricks):
    assert_same_phases(shape, 8192, tricks)


def assert_parameters(shape: ModelShape) -> None:
    """named_parameters() of Transformers' model for this shape, names, shapes and order, as the replay
    registers them (arch_for the shape's own architecture), and its count."""
    t = parse_tricks("bf16")
    model = build_hf(shape, t, 24).model
    assert arch_for(shape) == shape.arch
    assert [(n, tuple(p.shape)) for n, p in model.named_parameters()] == param_shapes(shape, shape.arch)
    sim = hf_build(Graph(LiveBytes()), config(shape, 24, 1, t))
    assert [p.name for p in sim.params] == [n for n, _ in model.named_parameters()]
    assert sum(p.numel() for p in model.parameters()) == n_params(shape)


def assert_same_phases(shape: ModelShape, seq: int, tricks: str) -> None:
    """Every phase's bytes as measured on meta (micro-batch 1), and FlopCounterMode's count."""
    t = parse_tricks(tricks)
    step, _ = measure_step(shape, seq, 1, t, stack=HF)
    e = exact_step(shape, seq, 1, t, stack=HF)
    for f in FIELDS:
        assert getattr(e.phases, f) == getattr(step, f), f
    assert step.flops == e.flops.counted


# -- against memcalc's reference layer ---------------------------------------------------------------


def test_llama3_8b_against_the_reference_layer():
    """bf16 + flash: the same bytes per layer (the reference layer was written after LlamaRMSNorm and
    Llama's RoPE); outside the layers Transformers saves the shifted labels (a view of the (B, T + 1)
    padded labels: F.pad, then [..., 1:] is contiguous for one row) and the Trainer's token count;
    its weights add the rotary inv_freq and original_inv_freq buffers (fp32, d/2 each)."""
    shape, t, s, d = PRESETS["llama3-8b"], parse_tricks("bf16,flash"), 8192, 128
    ref, hf = exact_step(shape, s, 1, t), exact_step(shape, s, 1, t, stack=HF)
    assert hf.activations.per_layer_bytes == ref.activations.per_layer_bytes
    assert hf.activations.outside_bytes - ref.activations.outside_bytes == 8 * (s + 1) + 8
    assert hf.phases.weights_bytes - ref.phases.weights_bytes == 2 * 4 * d // 2
    assert hf.phases.step_peak_bytes - ref.phases.step_peak_bytes == 2 * 4 * d // 2


def test_eager_attention_saves_fp32_probabilities():
    """Llama's eager_attention_forward runs softmax in fp32 and casts back: it saves the fp32 softmax
    and the bf16 probabilities (6 bytes per score) where the reference saves 2; its additive
    (B, 1, T, T) mask is not saved but lives through forward."""
    shape, t, s = PRESETS["llama3-8b"], parse_tricks("bf16"), 8192
    ref, hf = exact_step(shape, s, 1, t), exact_step(shape, s, 1, t, stack=HF)
    scores = shape.n_heads * s * s
    assert hf.activations.per_layer_bytes - ref.activations.per_layer_bytes == 4 * scores
    terms = {term.name: term.value for term in hf.activations.terms}
    assert terms["attention core: _softmax saves result (fp32)"] == 4 * scores
    assert terms["attention core: bmm saves self (bf16)"] == 2 * scores


def test_gpt2_new_gelu_saves_five_tensors():
    """GPT-2's gelu_new is NewGELUActivation, eight elementwise ops: the MLP saves its input, 0.5·x,
    tanh, 1 + tanh and the product (c_proj's input), where the reference's F.gelu saves one and
    c_proj the output: 3 more (B, T, f) tensors per layer. GPT-2 also drops out the embeddings. (Called
    without a cache: with one, tests/test_hf_cache.py.)"""
    shape, t, s, h = GPT_8B, parse_tricks("bf16,flash"), 8192, GPT_8B.hidden
    ref, hf = exact_step(shape, s, 1, t), exact_step(shape, s, 1, t, stack=replace(HF, use_cache=False))
    gelu = [term for term in hf.activations.terms if term.name.startswith("mlp:") and "addmm" not in term.name]
    assert sum(term.value for term in gelu) == 4 * 2 * s * shape.ffn  # pow's x, both of mul's, tanh's result
    assert hf.activations.per_layer_bytes - ref.activations.per_layer_bytes == 3 * 2 * s * shape.ffn
    dropout = [term for term in hf.activations.outside if term.name.startswith("embedding dropout")]
    assert sum(term.value for term in dropout) == s * h  # its bool mask


# -- what meta runs differently from CUDA, pinned down ----------------------------------------------------


def test_real_cpu_tensors():
    """On real CPU tensors, without the meta shims' help: masking_utils.find_packed_sequence_indices
    reads its value and returns None, allocating what the shim allocates. Eager attention (no flash
    kernel on CPU); F.dropout routed to aten.native_dropout as on CUDA."""
    for name, tricks in itertools.product(("llama", "qwen3"), ("fp32", "bf16", "bf16,ckpt", "bf16,selective")):
        assert_replayed(TINY[name], 24, 2, parse_tricks(tricks), device="cpu")
    assert_replayed(TINY["gpt2"], 24, 2, parse_tricks("fp32"), device="cpu")


def test_cpu_layer_norm_keeps_16_bit_statistics():
    """A CPU-only difference: native_layer_norm on CPU returns mean and rstd in bf16 (CUDA: fp32), so
    GPT-2 on CPU in bf16 saves 2 bytes less per row and statistic, in each of 2L + 1 LayerNorms."""
    shape, t, B, T = TINY["gpt2"], parse_tricks("bf16"), 2, 24
    step, _ = measure_step(shape, T, B, t, device="cpu", model=build_hf(shape, t, T, device="cpu", use_cache=True),
                           stack=HF)  # fmt: skip
    _, g, _ = simulate(config(shape, T, B, t))
    norms = 2 * shape.n_layers + 1
    assert sum(x.nbytes for x in g.saved_terms) - step.saved_bytes == norms * 2 * (4 - 2) * B * T


def test_dropout_routed_to_the_cuda_kernel():
    """F.dropout on meta saves a mask of the input's dtype; CUDA's aten.native_dropout a bool mask.
    cuda_paths() routes it: GPT-2's three dropouts (embeddings, attention probabilities, both
    residual branches) save one byte less per element with it."""
    shape, t, T = replace(TINY["gpt2"], n_layers=1), parse_tricks("bf16"), 24
    routed, _ = measure_step(shape, T, 1, t, stack=HF, count_flops=False)
    with cuda_paths(dropout=False):
        stock, _ = measure_step(shape, T, 1, t, model=build_hf(shape, t, T, use_cache=HF.use_cache), count_flops=False)
    masks = T * shape.hidden + shape.n_heads * T * T + 2 * T * shape.hidden
    assert stock.saved_bytes - routed.saved_bytes == masks


def test_flash_output_laid_out_as_cuda_lays_it_out():
    """CUDA's flash kernel (attention.cu, _scaled_dot_product_flash_attention_cuda) transposes q to
    (B, T, n, d) and writes its output so: sdpa_attention_forward's transpose(1, 2).contiguous() is a
    view. The meta function's empty_like(query) keeps q's dimension order, so it is a view on meta
    too, even for GPT-2's q, a strided slice of c_attn's output, whose gradient is laid out alike."""
    B, T, n, d = 2, 24, 4, 16
    qkv = torch.empty(B, T, 3 * n * d, dtype=torch.bfloat16, device="meta")
    q, k, v = (x.view(B, T, n, d).transpose(1, 2) for x in qkv.split(n * d, dim=2))
    out = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, True)[0]
    assert out.transpose(1, 2).is_contiguous()


def test_fp16_eager_softmax_upcast_is_a_meta_copy():
    """Named, not closable here: F.softmax(x, dtype=float32) of a Half CUDA tensor is one kernel
    (aten._softmax with half_to_float); on meta (and for bf16 everywhere) it is a cast to fp32, then
    _softmax. memcalc replays what was measured: the transient fp32 copy of the scores."""
    shape, t, T = TINY["llama"], parse_tricks("fp16"), 24
    _, live = measure_step(shape, T, 1, t, timeline=True, stack=HF, count_flops=False)
    scores = 4 * shape.n_heads * T * T
    forward = [(op, d) for p, op, d, _ in live.timeline if p == "forward" and d > 0]
    at = forward.index(("_softmax", scores))
    assert forward[at - 1] == ("_to_copy", scores)


def test_mistral_builds_what_llama_builds():
    """Mistral's modeling file runs Llama's ops (sliding_window None: full attention); memcalc's shape
    cannot tell them apart, and need not."""
    shape, t = TINY["llama"], parse_tricks("bf16,flash")
    with cuda_paths():
        llama, _ = measure_step(shape, 24, 1, t, model=build_hf(shape, t, 24, arch="llama"), count_flops=False)
        mistral, _ = measure_step(shape, 24, 1, t, model=build_hf(shape, t, 24, arch="mistral"), count_flops=False)
    assert llama == mistral


# -- verify --stack hf ---------------------------------------------------------------------------------


def test_verify_stack_hf_end_to_end():
    shape = TINY["qwen3"]
    r = verify(Model(shape, n_params(shape), "test"), Setup(24, stack=HF), parse_tricks("bf16,flash,ckpt"),
               device="meta")  # fmt: skip
    assert r.passed, [(row.quantity, row.exact, row.measured) for row in r.failed]
    assert "Transformers" in r.attention


def test_verify_stack_hf_cli():
    runner = CliRunner()
    ok = runner.invoke(app, ["verify", "--model", "gpt2", "--layers", "2", "--seq", "64", "--tricks", "bf16,flash",
                             "--stack", "hf", "--recipe", "master", "--optimizer-impl", "reference", "--device",
                             "meta"])  # fmt: skip
    assert ok.exit_code == 0, ok.output
    # the stack's defaults (autocast): meta casts nothing, so verify measures real CPU tensors at reduced size
    autocast = runner.invoke(app, ["verify", "--model", "gpt2", "--layers", "2", "--seq", "64", "--stack", "hf",
                                   "--device", "meta"])  # fmt: skip
    assert autocast.exit_code == 0, autocast.output
    assert "real CPU tensors at reduced size" in autocast.output and "Pass:" in autocast.output


@pytest.mark.parametrize("command", ["estimate --model llama3-8b --tricks bf16,flash,ckpt:2",
                                     "estimate --model qwen3-0.6b --tricks bf16,sac --gpus 8 --zero 3",
                                     "verify --device meta --model gpt2 --layers 2 --seq 64 --tricks bf16,sac"])
def test_what_transformers_does_not_run_is_refused(command):
    """Transformers checkpoints every decoder layer or none: ckpt:N and sac were replayed as plain ckpt or none
    under their own labels."""
    out = CliRunner().invoke(app, [*command.split(), "--stack", "hf"])
    assert out.exit_code == 2 and "checkpoints every decoder layer or none" in out.stderr
