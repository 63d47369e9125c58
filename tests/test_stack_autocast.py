"""The autocast recipe (the stock PyTorch loop: fp32 weights under torch.autocast, GradScaler for fp16)
simulated by memcalc.exact and held against torch.autocast itself.

Autocast does nothing on the meta device, so the loop runs on real CPU tensors at reduced size
(verify/autocast.py) and the simulator, given CPU's autocast lists, equals it allocation by
allocation. CUDA's lists differ from CPU's in named ops: each difference is tested term by term, and
the CUDA prediction at full size (Qwen3-8B and a GPT layer at 8B width, seq 8192) against the
reference recipe, term by term.
"""

from __future__ import annotations

import itertools
import json
from collections import Counter
from dataclasses import replace

import pytest

torch = pytest.importorskip("torch")

from torch.profiler import ProfilerActivity, profile  # noqa: E402
from typer.testing import CliRunner  # noqa: E402

from memcalc.cli import app  # noqa: E402
from memcalc.errors import InputError  # noqa: E402
from memcalc.exact.aten.cast_policy import POLICIES  # noqa: E402
from memcalc.exact.base.config import StepConfig  # noqa: E402
from memcalc.exact.replay.meta import simulate  # noqa: E402
from memcalc.exact.step import exact_step  # noqa: E402
from memcalc.model.presets import PRESETS  # noqa: E402
from memcalc.model.stacks import DEFAULT_STACK, stack_for  # noqa: E402
from memcalc.model.tricks import parse_tricks  # noqa: E402
from tests.replay import assert_same_step  # noqa: E402
from tests.test_tracker import allocator_events, check_same_events  # noqa: E402
from tests.test_verify_meta import GPT_8B, TINY  # noqa: E402
from verify.autocast import AutocastRecipe, cpu_kernels, measure_cpu  # noqa: E402
from verify.builder import build, materialise  # noqa: E402
from verify.track import LiveBytes  # noqa: E402

FAMILIES = {"llama": TINY["llama"], "gpt": TINY["gpt"]}  # Qwen3-like (GQA, qk-norm, RoPE); GPT (dropout 0.1)
AUTOCAST = stack_for("torch", impl="reference")  # torch.autocast, the reference per-tensor AdamW step


def cpu_config(shape, seq: int, batch: int, tricks: str, grad_accum: int = 1, device: str = "cpu") -> StepConfig:
    t = parse_tricks(tricks)
    return StepConfig(shape, seq, batch, t, replace(DEFAULT_STACK, recipe="autocast"), grad_accum=grad_accum,
                      device=device)


def cpu_shape(shape, tricks: str):
    """CPU's flash kernel takes no dropout: the flash runs drop it (the eager runs keep it)."""
    return replace(shape, dropout=0.0) if parse_tricks(tricks).flash else shape


def check_equal(shape, tricks: str, batch: int = 2, grad_accum: int = 1, seq: int = 24) -> None:
    """Every phase, the saved bytes, and every allocation of forward, backward and the optimizer
    step in order with the live bytes at each: the simulation (CPU's lists) = the CPU run."""
    shape = cpu_shape(shape, tricks)
    phases, g, mem = simulate(cpu_config(shape, seq, batch, tricks, grad_accum), timeline=True)
    step, live, recipe = measure_cpu(shape, seq, batch, parse_tricks(tricks), grad_accum, timeline=True)
    assert recipe.skipped == 0  # GradScaler found no inf: the measured step is a real step
    assert_same_step(phases, g, mem, step, live, tricks)


# -- the lists ------------------------------------------------------------------------------------


@pytest.mark.parametrize("device", ["cuda", "cpu"])
def test_the_lists_are_torch_2_13s(device):
    """memcalc's tables name exactly the ops the installed binary registers an autocast kernel for
    (CUDA's are registered in every build, the CPU-only one included)."""
    key = "AutocastCUDA" if device == "cuda" else "AutocastCPU"
    registered = {n.removeprefix("aten::") for n in torch._C._dispatch_get_registrations_for_dispatch_key(key)}
    assert set(POLICIES[device]) == registered


def test_cpu_policies_as_torch_runs_them():
    """The policies of the ops the models run, as CPU autocast applies them: linear casts (weight
    cached: one cast for two uses), softmax and pow are on no CPU list, cat promotes, the loss is fp32."""
    w = torch.nn.Parameter(torch.randn(8, 8))
    x, h = torch.randn(2, 8), torch.randn(2, 8).bfloat16()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y1, y2 = torch.nn.functional.linear(x, w), torch.nn.functional.linear(x, w)
        assert y1.dtype == torch.bfloat16
        casts = [y.grad_fn.next_functions[1][0].next_functions[0][0] for y in (y1, y2)]  # mm <- t <- _to_copy
        assert casts[0] is casts[1] and casts[0].name() == "ToCopyBackward0"
        assert torch.softmax(h, -1).dtype == torch.bfloat16 and h.pow(2).dtype == torch.bfloat16
        assert torch.cat([h, x]).dtype == torch.float32
        assert torch.nn.functional.cross_entropy(h, torch.tensor([0, 1])).dtype == torch.float32
    assert POLICIES["cpu"].get("softmax.int") is None and POLICIES["cuda"]["softmax.int"] == "fp32_set_opt_dtype"


# -- simulation = CPU measurement ---------------------------------------------------------------


@pytest.mark.parametrize("family,precision,attention,recompute", list(itertools.product(
    FAMILIES, ("bf16", "fp16"), ("", ",flash"), ("", ",ckpt"))))  # fmt: skip
def test_cpu_step_equals_simulation(family, precision, attention, recompute):
    check_equal(FAMILIES[family], precision + attention + recompute)


@pytest.mark.parametrize("family,tricks", [("llama", "bf16,selective"), ("gpt", "fp16,selective"),
                                           ("gpt", "bf16,flash,selective")])  # fmt: skip
def test_cpu_step_equals_simulation_selective(family, tricks):
    check_equal(FAMILIES[family], tricks)


@pytest.mark.parametrize("family,tricks", [("llama", "fp16,flash"), ("gpt", "bf16,ckpt")])
def test_cpu_step_equals_simulation_grad_accum(family, tricks):
    check_equal(FAMILIES[family], tricks, batch=1, grad_accum=3)


@pytest.mark.parametrize("family,tricks", [("llama", "bf16,flash,ckpt:2"), ("gpt", "fp16,ckpt:2"),
                                           ("llama", "bf16,ckpt:3")])  # fmt: skip
def test_cpu_step_equals_simulation_ckpt_n(family, tricks):
    """ckpt:N under autocast: only every Nth block (from 1) checkpointed, the others keep their activations and
    their weights' casts (three blocks: ckpt:2 checkpoints the second; ckpt:3 the third)."""
    check_equal(replace(FAMILIES[family], n_layers=3), tricks)


@pytest.mark.parametrize("shape", [
    pytest.param(["--model", "qwen3-0.6b"], marks=pytest.mark.slow("the same command for gpt2 and a custom shape")),
    ["--model", "gpt2"], ["--hidden", "256", "--heads", "4"]], ids=["qwen3-0.6b", "gpt2", "custom"])  # fmt: skip
@pytest.mark.parametrize("tricks", ["bf16,flash,ckpt:2", "bf16,ckpt:2"])
def test_verify_the_torch_stack_with_ckpt_n(shape, tricks):
    """`memcalc verify --device meta ... --layers 2 --seq 64 --tricks bf16,flash,ckpt:2 --stack torch`: the CPU
    run checkpoints block 1 only, as the replay does (it checkpointed both: saved bytes 91% under the replay's)."""
    args = ["verify", "--device", "meta", *shape, "--layers", "2", "--seq", "64", "--tricks", tricks, "--stack",
            "torch", "--format", "json"]  # fmt: skip
    out = CliRunner().invoke(app, args, env={"NO_COLOR": "1"})
    assert out.exit_code == 0, out.output
    rows = {r["quantity"]: r for r in json.loads(out.stdout)["rows"]}
    judged = [r for r in rows.values() if r["passed"] is not None]
    assert judged and all(r["measured"] == r["exact"] for r in judged)
    assert rows["saved for backward, all 2 layers"]["measured"] > 0


@pytest.mark.parametrize("name", ["llama3-like", "mqa-tied-wide-heads", "qkv-bias", "mixed"])
def test_cpu_step_equals_simulation_shape_features(name):
    """No qk-norm (RoPE on bf16 q, k: the products are fp32), MQA with tied embeddings (the cast of
    the embedding table is the logits' weight), qkv biases (cast and cached too), GQA with dropout."""
    for tricks in ("bf16", "fp16,flash,ckpt"):
        check_equal(TINY[name], tricks, batch=1)


@pytest.mark.parametrize("name", ["qwen3-0.6b", pytest.param("qwen3-8b", marks=pytest.mark.slow(
    "the same on qwen3-0.6b's layer"))])  # fmt: skip
def test_cpu_step_equals_simulation_at_full_width(name):
    """A real model's layer at its full width (Qwen3-0.6B's: h 1024, 16 heads, 8 KV heads, head 128, qk-norm,
    SwiGLU 3072; Qwen3-8B's: h 4096, 32 heads, 8 KV heads, SwiGLU 12288, 20 s of real CPU arithmetic), one
    layer, a small vocabulary and 16 tokens: what fits a CPU test (3.6 GB at 8B)."""
    check_equal(replace(PRESETS[name], n_layers=1, vocab=1024), "bf16,flash", batch=1, seq=16)


def test_the_tracker_is_the_cpu_allocator_under_autocast():
    """tests/test_tracker.py's proof, on an autocast step: every storage the tracker counts is a real
    allocation, in order, and its live bytes are the allocator's less kernel scratch, all freed."""
    shape, t = FAMILIES["llama"], parse_tricks("fp16,ckpt")
    torch.manual_seed(0)
    model = materialise(build(shape, cpu_kernels(t), 24, torch.float32), "cpu")
    idx, targets = torch.randint(0, shape.vocab, (2, 24)), torch.randint(0, shape.vocab, (2, 24))
    recipe = AutocastRecipe(model, t.precision, "cpu")

    def step():
        loss = recipe.forward(idx, targets)
        recipe.backward(loss)
        del loss
        recipe.update()

    step()
    live = LiveBytes("cpu", addresses=True)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        with live:
            live.track(list(model.parameters()) + list(model.buffers()) + [idx, targets] + recipe.state_tensors())
            live.events.clear()
            start = live.live_bytes
            live.reset_peak()
            step()
    check_same_events(allocator_events(prof), live.events, live.live_bytes - start, live.peak_bytes - start)


def test_cpu_mixed_dtype_ops_copy_an_input_the_tracker_does_not_see():
    """A named CPU-only transient: TensorIterator on CPU copies an input of another dtype to the
    common one before the kernel (aten/src/ATen/TensorIterator.cpp compute_types: "Promotes inputs by
    creating temporaries"), below the dispatcher; CUDA kernels cast as they load. Under autocast the
    residual adds (fp32 + bf16) and the norms' `* weight` do this on CPU: scratch in the CPU
    allocator's peak, none on CUDA, none in the tracker or the simulator."""
    a, b = torch.randn(1000), torch.randn(1000).bfloat16()
    live = LiveBytes("cpu")
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        with live:
            c = a + b
            tracked = live.live_bytes
            del c  # freed while profiling: the profiler's running total ends where it began
    assert [size for size, _, _ in allocator_events(prof) if size > 0] == [4000, 4000]  # b in fp32, then c
    assert tracked == 4000


# -- CUDA's lists against CPU's -----------------------------------------------------------------


def layer_terms(cfg: StepConfig) -> tuple[Counter, int]:
    """One layer's saved tensors, (part, op, tensor, dtype) -> bytes; and what a recompute rebuilds."""
    _, g, _ = simulate(cfg)
    out: Counter = Counter()
    for t in g.saved_terms:
        if t.layer == 1:
            out[(t.scope, t.op.removesuffix("_for_cpu"), t.what, t.dtype)] += t.nbytes
    return out, g.rebuilt_bytes


DIFFERENCES = ("bf16", "fp16", "bf16,flash", "bf16,selective", "fp16,flash,selective")


@pytest.mark.parametrize("family,tricks", list(itertools.product(FAMILIES, DIFFERENCES)))
def test_cuda_prediction_differs_from_cpu_where_named(family, tricks):
    """Where CUDA's lists and kernels differ from CPU's, per layer (b·a·s² the scores' elements):
      softmax.int  CUDA: fp32_set_opt_dtype, the probabilities saved in fp32 (4 bytes, not 2), and the
                   matmul with V then casts them (or their dropout) to 16 bits, saved by bmm; CPU: not
                   listed. Llama (no dropout): +4·b·a·s²; GPT (dropout): +2·b·a·s² (its bmm saved the
                   16-bit dropout output on CPU already)
      flash        CUDA's _scaled_dot_product_flash_attention saves its Philox seed and offset (24 bytes);
                   CPU's _for_cpu kernel has no dropout and saves neither
    and nowhere else: pow, rsqrt, layer_norm (fp32 on CUDA only), nll_loss and cross_entropy_loss,
    cat (promote on CPU only) find their inputs in the dtype they would cast to. With selective
    recompute the attention core saves nothing in forward: the difference moves to what its
    recompute rebuilds."""
    shape = cpu_shape(FAMILIES[family], tricks)
    (cuda, cuda_rebuilt), (cpu, cpu_rebuilt) = (layer_terms(cpu_config(shape, 24, 2, tricks, device=d))
                                                for d in ("cuda", "cpu"))  # fmt: skip
    t, scores, low = parse_tricks(tricks), 2 * shape.n_heads * 24 * 24, parse_tricks(tricks).precision
    if t.flash:
        named = {("attention core", "_scaled_dot_product_flash_attention", "philox_seed", "uint64"): 16,
                 ("attention core", "_scaled_dot_product_flash_attention", "philox_offset", "uint64"): 8}  # fmt: skip
        cpu_only = {}
    else:
        named = {("attention core", "_softmax", "result", "fp32"): 4 * scores}
        if shape.dropout == 0:  # bmm saves the cast of the probabilities; with dropout it saved its output anyway
            named[("attention core", "bmm", "self", low)] = 2 * scores
        cpu_only = {("attention core", "_softmax", "result", low): 2 * scores}
    named_bytes = sum(named.values()) - sum(cpu_only.values())
    assert named_bytes == (24 if t.flash else (4 if shape.dropout == 0 else 2) * scores)
    if t.recompute == "selective":
        assert cuda == cpu and cuda_rebuilt - cpu_rebuilt == named_bytes
    else:
        assert cuda - cpu == named and cpu - cuda == cpu_only and cuda_rebuilt == cpu_rebuilt == 0


@pytest.mark.parametrize("tricks,per_layer", [("bf16,flash", 24), ("bf16", 4 * 32 * 8192 * 8192)])
def test_cuda_prediction_differs_from_cpu_where_named_at_8b(tricks, per_layer):
    """Qwen3-8B at seq 8192: flash, CUDA's kernel's RNG state (24 bytes a layer); eager, CUDA's fp32
    softmax (+4·b·a·s² a layer: 8.6 GB). Retained bytes differ by L times that, nothing else."""
    shape = PRESETS["qwen3-8b"]
    (cuda, _), (cpu, _) = (layer_terms(cpu_config(shape, 8192, 1, tricks, device=d)) for d in ("cuda", "cpu"))
    assert sum(cuda.values()) - sum(cpu.values()) == per_layer
    (cuda_phases, _, _), (cpu_phases, _, _) = (simulate(cpu_config(shape, 8192, 1, tricks, device=d))
                                               for d in ("cuda", "cpu"))  # fmt: skip
    assert cuda_phases.retained_bytes - cpu_phases.retained_bytes == shape.n_layers * per_layer
    assert cuda_phases.state_bytes == cpu_phases.state_bytes


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_cuda_softmax_upcast_bf16_copies_fp16_does_not(precision):
    """SoftMax.cpp softmax(input, dim, dtype=float): a CUDA fp16 input runs the half_to_float kernel
    (fp32 out, no copy); a bf16 one is copied to fp32 first: a transient 4·b·a·s² in forward."""
    shape = FAMILIES["llama"]
    _, _, mem = simulate(cpu_config(shape, 24, 2, precision, device="cuda"), timeline=True)
    scores = 2 * shape.n_heads * 24 * 24
    forward = [(op, d) for p, op, d, _ in mem.timeline if p == "forward" and d > 0]
    copies = forward.count(("_to_copy", 4 * scores))
    assert copies == (2 if precision == "bf16" else 0)  # one per layer
    assert forward.count(("_softmax", 4 * scores)) == 2


# -- the full-size prediction against the reference recipe ---------------------------------------


def by_term(terms) -> Counter:
    return Counter({(t.name, t.symbolic()): t.value for t in terms})


def test_qwen3_8b_autocast_against_the_reference_recipe():
    """Qwen3-8B, seq 8192, bf16+flash, CUDA's lists, term by term (s·b·h = 33,554,432):
    per layer +10·s·b·h of activations and the layer's weights cast to bf16, saved by their matmuls:
      norm1, norm2   the normed x · rstd kept in fp32 (its input, the fp32 residual, stays fp32): +2·s·b·h each
      q, k, v        each linear casts the fp32 norm output itself (not cached: no leaf): 6·s·b·h for 2
      gate, up       the same, twice: 4·s·b·h for 2
      weights        wq, wk, wv, wo, gate, up, down cast once per forward and cached: 2 bytes each
    outside: the RoPE tables in fp32 (+4·s·d), the final norm (+2·s·b·h), the lm_head's cast (2·v·h);
    model state -2 bytes/param (fp32 weights are the master); the step peak (backward, the loss's
    gradient) is the retained difference plus the state difference."""
    shape, t = PRESETS["qwen3-8b"], parse_tricks("bf16,flash")
    ref, ac = exact_step(shape, 8192, 1, t), exact_step(shape, 8192, 1, t, stack=AUTOCAST)
    s, h, d, v, L = 8192, shape.hidden, shape.head_dim, shape.vocab, shape.n_layers
    layer_weights = 2 * h * shape.q_dim + 2 * h * shape.kv_dim + 3 * h * shape.ffn
    diff = by_term(ac.activations.terms)
    diff.subtract(by_term(ref.activations.terms))
    assert {k: x for k, x in diff.items() if x} == {
        ("norm1: mul saves self (bf16)", "2·b·s·h"): -2 * s * h,
        ("norm1: mul saves self (fp32)", "4·b·s·h"): 4 * s * h,
        ("norm2: mul saves self (bf16)", "2·b·s·h"): -2 * s * h,
        ("norm2: mul saves self (fp32)", "4·b·s·h"): 4 * s * h,
        ("attention: mm saves self (bf16)", "2·b·s·h"): -2 * s * h,
        ("attention: mm saves self (bf16)", "6·b·s·h"): 6 * s * h,
        ("mlp: mm saves self (bf16)", "2·b·s·h"): -2 * s * h,
        ("mlp: mm saves self (bf16)", "4·b·s·h"): 4 * s * h,
        ("attention: mm saves mat2 (bf16)", "2·h·a·d"): 2 * h * shape.q_dim,
        ("attention: mm saves mat2 (bf16)", "4·h·k·d"): 4 * h * shape.kv_dim,
        ("attention: mm saves mat2 (bf16)", "2·a·d·h"): 2 * h * shape.q_dim,
        ("mlp: mm saves mat2 (bf16)", "4·h·f"): 4 * h * shape.ffn,
        ("mlp: mm saves mat2 (bf16)", "2·f·h"): 2 * h * shape.ffn,
    }
    per_layer = ac.activations.per_layer_bytes - ref.activations.per_layer_bytes
    assert per_layer == 10 * s * h + 2 * layer_weights == 721_420_288
    outside = ac.activations.outside_bytes - ref.activations.outside_bytes
    assert outside == 4 * s * d + 2 * s * h + 2 * v * h == 1_315_962_880
    state = ac.phases.state_bytes - ref.phases.state_bytes
    assert state == -2 * ac.n_params
    assert ac.phases.retained_bytes - ref.phases.retained_bytes == L * per_layer + outside
    assert ac.phases.backward_peak_at == ref.phases.backward_peak_at == "backward: _log_softmax_backward_data"
    assert ac.peak_bytes - ref.peak_bytes == L * per_layer + outside + state == 10_905_622_528
    assert (ac.activations.per_layer_bytes, ac.peak_bytes) == (2_485_452_824, 204_289_799_016)


def test_gpt_layer_at_8b_width_autocast_against_the_reference_recipe():
    """The textbook GPT layer at 8B width, eager, bf16: CUDA's fp32 softmax (+2·b·a·s²: its 16-bit
    probabilities become fp32, the dropout's 16-bit cast is what bmm saves, as it saved the dropout's
    output before), LayerNorm's inputs fp32 (+2·s·b·h each), q, k, v's own casts of the fp32 norm
    output (+4·s·b·h), and the layer's weights in bf16 (2·(4·h² + 2·h·f)); biases are cast but not saved."""
    t = parse_tricks("bf16")
    ref, ac = exact_step(GPT_8B, 8192, 1, t), exact_step(GPT_8B, 8192, 1, t, stack=AUTOCAST)
    s, h, f, a = 8192, GPT_8B.hidden, GPT_8B.ffn, GPT_8B.n_heads
    per_layer = ac.activations.per_layer_bytes - ref.activations.per_layer_bytes
    assert per_layer == 2 * a * s * s + 4 * s * h + 4 * s * h + 2 * (4 * h * h + 2 * h * f) == 4_966_055_936
    assert ac.activations.outside_bytes - ref.activations.outside_bytes == 2 * s * h + 2 * GPT_8B.vocab * h


def test_estimate_with_the_torch_stack():
    """The torch stack's step with the reference optimizer step prints the per-layer bytes that differ
    from the reference stack's by the named terms; its default (torch.optim's foreach) saves the same
    activations (tests/test_stack_amp.py holds its optimizer step)."""
    run = CliRunner().invoke
    env = {"COLUMNS": "200", "TERMINAL_WIDTH": "200", "NO_COLOR": "1"}
    args = ["estimate", "--params", "8e9", "--seq", "8192", "--tricks", "bf16,flash", "--exact", "--bytes"]
    torch_stack = run(app, args + ["--stack", "torch", "--optimizer-impl", "reference"], env=env)
    reference = run(app, args, env=env)
    assert torch_stack.exit_code == 0 and reference.exit_code == 0, torch_stack.output
    assert "2.485 GB" in torch_stack.stdout and "1.764 GB" in reference.stdout  # per layer, in the exact section
    assert 2_485_452_824 - 1_764_032_536 == 10 * 8192 * 4096 + 2 * 192_937_984  # test_qwen3_8b_...'s terms
    default = run(app, args + ["--stack", "torch"], env=env)
    assert default.exit_code == 0 and "2.485 GB" in default.stdout, default.output
    assert "torch.optim AdamW (foreach; fp32 weights and state)" in " ".join(default.stdout.split())
    every = run(app, ["estimate", "--params", "8e9", "--seq", "8192", "--exact", "--stack", "torch",
                      "--optimizer-impl", "reference"], env=env)  # fmt: skip
    text = " ".join(every.stdout.split())
    assert every.exit_code == 0 and "exact (fp32): AdamW (fp32 m, v)" in text  # fp32 never autocasts
    assert "exact (bf16, bf16+flash, bf16+flash+ckpt, bf16+selective): torch.autocast over fp32 weights" in text


def test_refusals():
    with pytest.raises(InputError, match="no dropout"):
        simulate(cpu_config(TINY["gpt"], 24, 1, "bf16,flash"))
    with pytest.raises(InputError, match="device 'tpu'"):
        simulate(replace(cpu_config(TINY["llama"], 24, 1, "bf16"), device="tpu"))
