"""The stock loops' defaults: torch.autocast over fp32 weights driving the libraries' optimizers (torch.optim's
AdamW loop, foreach and fused, SGD with momentum, bitsandbytes' AdamW8bit; GradScaler for fp16), and
Transformers' model under autocast as the Trainer runs it through Accelerate. memcalc.exact replays both;
the replay (CPU's lists) equals real CPU runs allocation by allocation; every CPU/CUDA difference is named
and tested; the full-size torch and hf stacks stand against the reference stack term by term.

    with torch.autocast(device, dtype):          # Transformers: accelerate's prepared forward
        loss = model(idx, targets)
    scaler.scale(loss).backward()                # fp16; bf16 calls loss.backward()
    scaler.step(optimizer); scaler.update()      # fused AdamW: the scaler's grad_scale/found_inf path
    optimizer.zero_grad(set_to_none=True)
"""

from __future__ import annotations

import importlib.util
import itertools
from collections import Counter
from dataclasses import replace

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from torch.profiler import ProfilerActivity, profile  # noqa: E402
from typer.testing import CliRunner  # noqa: E402

from memcalc.cli import app  # noqa: E402
from memcalc.exact.base.config import StepConfig  # noqa: E402
from memcalc.exact.replay.meta import simulate  # noqa: E402
from memcalc.exact.step import exact_step  # noqa: E402
from memcalc.model.presets import PRESETS  # noqa: E402
from memcalc.model.shape import ModelShape  # noqa: E402
from memcalc.model.stacks import STACKS, stack_for  # noqa: E402
from memcalc.model.tricks import Tricks, parse_tricks  # noqa: E402
from tests.replay import assert_same_step  # noqa: E402
from tests.test_stack_hf import TINY as HF_TINY  # noqa: E402
from tests.test_tracker import allocator_events  # noqa: E402
from tests.test_verify_meta import TINY  # noqa: E402
from verify.autocast import measure_autocast, measure_cpu  # noqa: E402
from verify.hf import build_hf  # noqa: E402
from verify.recipes import bitsandbytes, library_optimizer  # noqa: E402
from verify.track import LiveBytes  # noqa: E402

HAS_BNB = importlib.util.find_spec("bitsandbytes") is not None
needs_bnb = pytest.mark.skipif(not HAS_BNB, reason="bitsandbytes not installed (pip install 'memcalc[bnb]')")
OPTIMIZERS = [("adamw", "loop"), ("adamw", "foreach"), ("adamw", "fused"), ("sgd", "loop"), ("sgd", "foreach"),
              pytest.param("adam8bit", "loop", marks=needs_bnb)]  # fmt: skip
HOSTED = (("adamw", "loop"), ("adamw", "foreach"))  # torch.optim keeps their step counters on the CPU
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def cpu_config(shape: ModelShape, seq: int, batch: int, tricks: str, stack, optimizer: str = "adamw",
               grad_accum: int = 1, device: str = "cpu") -> StepConfig:  # fmt: skip
    t = parse_tricks(tricks)
    return StepConfig(shape, seq, batch, replace(t, ckpt_every=1, fp8=""), stack, optimizer, grad_accum, device)


def cpu_shape(shape: ModelShape, tricks: str) -> ModelShape:
    """CPU's flash kernel takes no dropout: the flash runs drop it."""
    return replace(shape, dropout=0.0) if parse_tricks(tricks).flash else shape


def check_equal(shape: ModelShape, tricks: str, stack, optimizer: str = "adamw", batch: int = 2, seq: int = 24,
                grad_accum: int = 1) -> None:  # fmt: skip
    """Every phase, the saved bytes, and every allocation of forward, backward and the optimizer step
    in order with the live bytes at each: the replay (CPU's lists and CPU-hosted counters) = the CPU run."""
    shape = cpu_shape(shape, tricks)
    phases, g, mem = simulate(cpu_config(shape, seq, batch, tricks, stack, optimizer, grad_accum), timeline=True)
    step, live, recipe = measure_cpu(shape, seq, batch, parse_tricks(tricks), grad_accum, timeline=True, stack=stack,
                                     optimizer=optimizer)  # fmt: skip
    assert recipe.skipped == 0  # GradScaler found no inf: the measured step is a real step
    assert_same_step(phases, g, mem, step, live, tricks)


# -- the reference model under autocast, stepped by the libraries' optimizers --------------------------


@pytest.mark.parametrize("optimizer,impl", OPTIMIZERS)
@pytest.mark.parametrize("tricks", ["bf16", "fp16", "fp16,flash,ckpt", "bf16,selective"])
def test_cpu_library_optimizers_under_autocast(optimizer, impl, tricks):
    """GradScaler.unscale_ then the step (loop, foreach, SGD, AdamW8bit), or fused AdamW's own path
    (_check_inf_per_device, found_inf = 0 + it, grad_scale = scale * 1, _fused_adamw_ reading both),
    then scaler.update() and zero_grad: the llama family (GQA, qk-norm, RoPE)."""
    check_equal(TINY["llama"], tricks, stack_for("torch", impl=impl), optimizer)


@pytest.mark.parametrize("impl", ["foreach", "fused"])
def test_cpu_library_optimizers_gpt_and_grad_accum(impl):
    """The GPT layer (LayerNorm, biases, dropout) and three micro-batches per step."""
    stack = stack_for("torch", impl=impl)
    check_equal(TINY["gpt"], "fp16", stack)
    check_equal(TINY["llama"], "fp16,flash", stack, batch=1, grad_accum=3)


# -- Transformers' model under autocast, as the Trainer runs it ----------------------------------------

HF_TRICKS = ["bf16", "fp16", "bf16,flash", "fp16,flash,ckpt", "bf16,selective", "fp16,ckpt"]


@pytest.mark.parametrize("name", ["llama", "qwen3", "gpt2", "qwen2", "llama-mha-tied", "qwen3-mqa-wide-heads",
                                  "llama-attention-dropout"])  # fmt: skip
def test_cpu_transformers_under_autocast(name):
    """The hf stack's default (autocast, fused AdamW) on Transformers' own classes: the forward
    Accelerate prepares (autocast, then its fp16/bf16 outputs .float(): the logits copied to fp32),
    RMSNorm's upcast (its fp32 input stays fp32: .to(input_dtype) copies nothing), fp32 rotary tables
    (the hidden states' dtype is fp32), q_norm's bf16 product promoted by its fp32 weight, GPT-2's
    Conv1D addmm cast by autocast and its probabilities .type(value.dtype), eager masks in fp32, and
    SDPA's flash kernel reached through Transformers' own sdpa_attention_forward."""
    for tricks in HF_TRICKS:
        shape = HF_TINY[name]
        if parse_tricks(tricks).flash and shape.positions != "rope" and shape.dropout:
            continue  # CPU's flash kernel has no dropout: GPT-2 with dropout runs eager here
        check_equal(shape, tricks, STACKS["hf"])


@pytest.mark.parametrize("optimizer,impl", [("adamw", "foreach"), ("adamw", "reference"), ("sgd", "loop"),
                                            pytest.param("adam8bit", "loop", marks=needs_bnb)])  # fmt: skip
def test_cpu_transformers_with_other_optimizers(optimizer, impl):
    for tricks in ("bf16,flash", "fp16"):
        check_equal(HF_TINY["qwen3"], tricks, stack_for("hf", impl=impl), optimizer)


def test_cpu_transformers_grad_accum():
    check_equal(HF_TINY["llama"], "fp16,flash", STACKS["hf"], batch=1, grad_accum=3)
    check_equal(HF_TINY["gpt2"], "bf16,ckpt", STACKS["hf"], batch=1, grad_accum=3)


@pytest.mark.parametrize("name", ["qwen3-0.6b", pytest.param("qwen3-8b", marks=pytest.mark.slow(
    "the same on qwen3-0.6b's layer"))])  # fmt: skip
def test_cpu_transformers_at_full_width(name):
    """A real model's layer at its full width (Qwen3-0.6B's: h 1024, 16 heads, 8 KV heads, head 128, qk-norm,
    SwiGLU 3072; Qwen3-8B's: h 4096, 32 heads, 8 KV heads, SwiGLU 12288, 20 s of real CPU arithmetic), one
    layer, a small vocabulary and 16 tokens, fp32 weights, grads, m and v: what fits a CPU test."""
    check_equal(replace(PRESETS[name], n_layers=1, vocab=1024), "bf16,flash", STACKS["hf"], batch=1, seq=16)


# -- CPU against CUDA: every difference named ------------------------------------------------------------


def optimizer_allocations(cfg: StepConfig) -> Counter:
    _, _, mem = simulate(cfg, timeline=True)
    return Counter((op, d) for p, op, d, _ in mem.timeline if p == "optimizer" and d > 0)


@pytest.mark.parametrize("optimizer,impl", OPTIMIZERS)
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_step_counters_are_device_memory_on_cpu_only(optimizer, impl, precision):
    """Named CPU-only state: torch.optim's loop and foreach AdamW host their step counters on the CPU
    (torch/optim/adam.py Adam._init_group, torch.tensor(0.0, device="cpu")), which on CPU tensors is
    the device: 4 bytes per parameter tensor of state there, none on CUDA. foreach advances them by
    torch.tensor(1.0, device="cpu") (_multi_tensor_adam): a 4-byte transient in each CPU step. Fused
    AdamW keeps its counters on the device everywhere; SGD and AdamW8bit's counters are Python ints."""
    stack, shape = stack_for("torch", impl=impl), TINY["llama"]
    cuda, cpu = (cpu_config(shape, 24, 2, precision, stack, optimizer, device=d) for d in ("cuda", "cpu"))
    (cuda_phases, _, _), (cpu_phases, _, _) = simulate(cuda), simulate(cpu)
    hosted = 4 * len(param_elements(shape, "reference")) if (optimizer, impl) in HOSTED else 0
    assert cpu_phases.state_bytes - cuda_phases.state_bytes == hosted
    more = optimizer_allocations(cpu)
    more.subtract(optimizer_allocations(cuda))
    assert +more == (Counter({("lift_fresh", 4): 1}) if (optimizer, impl) == ("adamw", "foreach") else Counter())


@needs_bnb
def test_bitsandbytes_cpu_backend_allocates_below_the_dispatcher():
    """Named CPU-only transients: bitsandbytes' CPU backend runs the 8-bit update as Python tensor ops
    inside its custom op (backends/default/ops.py _optimizer_update_8bit_blockwise: p.float(), the
    dequantised states, their updates), below the dispatcher: the CPU allocator sees them, the tracker
    and the replay do not, and CUDA's kernel (kOptimizerStatic8bit2StateBlockwise) makes none. Its
    quantile maps are made on the CPU when the optimizer is (fill_qmap) and .to(p.device) copies
    nothing there, where CUDA copies them at the first 8-bit tensor's init_state: the same 2 KiB of
    state, made earlier. (Its module-level 4-bit tables, backends/utils.py, are CPU tensors made at
    import: verify imports it before tracking.)"""
    bitsandbytes()
    params = [torch.nn.Parameter(torch.randn(64, 64)), torch.nn.Parameter(torch.randn(64))]
    opt = library_optimizer(params, "adam8bit", "loop")
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()  # the state made
    state = [t for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    live = LiveBytes("cpu")
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        with live:
            live.track(params + [p.grad for p in params] + state)
            start = live.live_bytes
            live.reset_peak()
            opt.step()
    real = [size for size, _, _ in allocator_events(prof) if size > 0]
    assert live.peak_bytes == start and live.live_bytes == start  # the tracker: in place, nothing made
    assert 4 * 64 * 64 in real  # the CPU allocator: p.float() of the 64 x 64 weight, among others


def hf_layer_terms(shape: ModelShape, tricks: str, device: str) -> tuple[Counter, int]:
    _, g, _ = simulate(cpu_config(cpu_shape(shape, tricks), 24, 2, tricks, STACKS["hf"], device=device))
    out: Counter = Counter()
    for t in g.saved_terms:
        if t.layer == 1:
            out[(t.scope, t.op.removesuffix("_for_cpu"), t.what, t.dtype)] += t.nbytes
    return out, g.rebuilt_bytes


@pytest.mark.parametrize("name,tricks", list(itertools.product(["llama", "qwen3", "gpt2"],
                                                               ["bf16", "fp16", "bf16,flash", "bf16,selective"])))
def test_transformers_cuda_prediction_differs_from_cpu_where_named(name, tricks):
    """Transformers' model under autocast, CUDA's lists against CPU's, per layer (b·s·f the MLP's
    elements):
      flash         CUDA's _scaled_dot_product_flash_attention saves its Philox seed and offset (24
                    bytes); CPU's _for_cpu kernel has no dropout and saves neither
      gelu_new      GPT-2's NewGELU: torch.pow(x, 3.0) is on CUDA's fp32 list (pow.Tensor_Scalar), so
                    pow saves x cast to fp32 and the chain after it runs in fp32: tanh saves an fp32
                    result, the last product an fp32 (1 + tanh): +2·b·s·f each, +6·b·s·f
    and nowhere else: Transformers' norms, softmax (dtype=torch.float32) and loss (logits.float())
    upcast explicitly, so CUDA's fp32 lists find fp32 inputs. With selective recompute the attention
    core saves nothing in forward, and its flash op keeps no RNG state apart."""
    shape = HF_TINY[name]
    (cuda, cuda_rebuilt), (cpu, cpu_rebuilt) = (hf_layer_terms(shape, tricks, d) for d in ("cuda", "cpu"))
    t, low, bsf = parse_tricks(tricks), parse_tricks(tricks).precision, 2 * 24 * shape.ffn
    named, cpu_only = {}, {}
    if t.flash:
        core = "_scaled_dot_product_flash_attention"
        named = {("attention core", core, "philox_seed", "uint64"): 16, ("attention core", core, "philox_offset",
                                                                          "uint64"): 8}  # fmt: skip
    if name == "gpt2":
        for op, what in (("pow", "self"), ("tanh", "result"), ("mul", "other")):
            named[("mlp", op, what, "fp32")] = 4 * bsf
            cpu_only[("mlp", op, what, low)] = 2 * bsf
    if t.recompute == "selective":
        named = {k: v for k, v in named.items() if k[0] != "attention core"}
    assert cuda - cpu == named and cpu - cuda == cpu_only and cuda_rebuilt == cpu_rebuilt


# -- on a GPU: the CUDA prediction against CUDA tensors ---------------------------------------------------


def check_cuda(shape: ModelShape, tricks: str, stack, optimizer: str = "adamw", batch: int = 2, seq: int = 24) -> None:
    """The stock loop under torch.autocast("cuda") on a GPU's tensors, tracked at the dispatcher as on meta
    (the flash op and aten.native_dropout called by name, as meta calls them), equals the replay with
    CUDA's lists to the byte, allocation by allocation: CUDA's fp32 softmax, pow and norms, the flash
    kernel's RNG state, torch.optim's counters on the host, GradScaler's and fused AdamW's scalars."""
    t = parse_tricks(tricks)
    phases, g, mem = simulate(cpu_config(shape, seq, batch, tricks, stack, optimizer, device="cuda"), timeline=True)
    step, live, recipe = measure_autocast(shape, seq, batch, t, 1, True, stack, optimizer, "cuda")
    assert recipe.skipped == 0
    assert_same_step(phases, g, mem, step, live, tricks)


@cuda
@pytest.mark.parametrize("impl", ["foreach", "fused", "loop"])
@pytest.mark.parametrize("family,tricks", [("llama", "bf16"), ("llama", "fp16,flash"), ("gpt", "bf16"),
                                           ("gpt", "fp16,ckpt")])  # fmt: skip
def test_cuda_run_equals_the_cuda_prediction(impl, family, tricks):
    check_cuda(TINY[family], tricks, stack_for("torch", impl=impl))


@cuda
@pytest.mark.parametrize("name", ["llama", "qwen3", "gpt2"])
@pytest.mark.parametrize("tricks", ["bf16", "fp16,flash", "bf16,flash,ckpt"])
def test_cuda_transformers_run_equals_the_cuda_prediction(name, tricks):
    """Transformers' model under CUDA autocast: GPT-2's gelu_new in fp32 (pow.Tensor_Scalar), the flash
    kernel's RNG state."""
    shape = HF_TINY[name] if not parse_tricks(tricks).flash else replace(HF_TINY[name], dropout=0.0)
    check_cuda(shape, tricks, STACKS["hf"])


@cuda
def test_accelerate_prepares_the_forward_verify_writes_out():
    """verify/amp.py amp_forward against Accelerate itself (where it is installed): the forward of a
    model Accelerator(mixed_precision="bf16").prepare_model wrapped allocates what amp_forward's does,
    in order (the autocast region, then the logits' fp32 copy)."""
    accelerate = pytest.importorskip("accelerate")
    shape, T = HF_TINY["llama"], 24
    ours = build_hf(shape, parse_tricks("bf16,flash"), T, device="cuda", autocast="cuda")
    theirs = build_hf(shape, parse_tricks("fp32,flash"), T, device="cuda")  # fp32 weights, no autocast of its own
    theirs.model = accelerate.Accelerator(mixed_precision="bf16").prepare_model(theirs.model)
    idx = torch.randint(0, shape.vocab, (2, T), device="cuda")
    timelines = []
    for model in (ours, theirs):
        live = LiveBytes("cuda", timeline=True)
        with live:
            live.track(list(model.parameters()) + list(model.buffers()) + [idx])
            loss = model(idx, idx)
            del loss
        timelines.append([(op, d) for _, op, d, _ in live.timeline])
    assert timelines[0] == timelines[1]


# -- the full-size stacks against the reference stack ------------------------------------------------------


def by_term(terms) -> Counter:
    return Counter({(t.name, t.symbolic()): t.value for t in terms})


def param_elements(shape: ModelShape, model: str) -> list[int]:
    """Elements of each parameter, in model.parameters() order, of the stack's model."""
    from memcalc.exact.hf.model import build as hf_build
    from memcalc.exact.replay.meta import build
    from memcalc.exact.sim.graph import Graph
    from memcalc.exact.sim.tensors import LiveBytes

    cfg = StepConfig(shape, 1, 1, Tricks("bf16", True), STACKS["hf" if model == "hf" else "reference"])
    return [p.numel for p in (hf_build if model == "hf" else build)(Graph(LiveBytes()), cfg).params]


@pytest.mark.parametrize("name", ["llama3-8b", "qwen3-8b"])
@pytest.mark.parametrize("tricks", ["bf16,flash", "bf16,flash,ckpt"])
def test_torch_stack_at_8b_against_the_reference_stack(name, tricks):
    """The torch stack's default (autocast, torch.optim AdamW foreach) at seq 8192, against the
    reference stack (bf16 weights, fp32 master, per-tensor AdamW):
      state      -2 bytes/param: fp32 weights (4) + m + v (8), where the reference keeps bf16 weights,
                 an fp32 master, m and v (2 + 4 + 8)
      grads      +2 bytes/param: fp32, not bf16
      activations as test_stack_autocast's terms (autocast's fp32 residual stream, its norms' fp32
                 inputs, each linear's own cast of its input, the cached bf16 weights)
      optimizer  _foreach_sqrt over every exp_avg_sq at once: 4 bytes/param above state and grads
                 (the reference's one fp32 grad and one denominator of the largest tensor)
    and the torch stack with the reference step (--optimizer-impl reference) differs from it in the
    optimizer step only."""
    shape, t = PRESETS[name], parse_tricks(tricks)
    ref, torch_stack = exact_step(shape, 8192, 1, t), exact_step(shape, 8192, 1, t, stack=STACKS["torch"])
    same_step = exact_step(shape, 8192, 1, t, stack=stack_for("torch", impl="reference"))
    n, p, q = torch_stack.n_params, torch_stack.phases, ref.phases
    assert p.state_bytes - q.state_bytes == -2 * n
    assert p.grads_bytes - q.grads_bytes == 2 * n
    assert by_term(torch_stack.activations.terms) == by_term(same_step.activations.terms)
    assert p.retained_bytes == same_step.phases.retained_bytes
    assert p.optimizer_peak_at == "optimizer: _foreach_sqrt"
    assert p.optimizer_peak_bytes - (p.state_bytes + p.inputs_bytes + p.grads_bytes) == 4 * n
    sizes = param_elements(shape, "reference")
    loop_peak = same_step.phases.optimizer_peak_bytes - (p.state_bytes + p.inputs_bytes + p.grads_bytes)
    assert loop_peak == max(4 * s for s in sizes)  # the reference step: one denominator (its grad left .grad)
    assert (p.forward_peak_bytes, p.backward_peak_bytes) == (same_step.phases.forward_peak_bytes,
                                                             same_step.phases.backward_peak_bytes)  # fmt: skip


@pytest.mark.parametrize("name", ["llama3-8b", "qwen3-8b"])
@pytest.mark.parametrize("tricks", ["bf16,flash", "bf16,flash,ckpt"])
def test_hf_stack_at_8b_against_the_reference_recipe(name, tricks):
    """The hf stack's default (Transformers' model under autocast as Accelerate prepares it, fused
    AdamW) at seq 8192, against Transformers' model trained by the reference recipe (bf16 weights,
    fp32 master, per-tensor AdamW; test_stack_hf holds that against memcalc's reference model), term
    by term (s·b·h = 33,554,432):
      per layer   RMSNorm's product of the fp32 residual stays fp32: +2·s·b·h each (input_layernorm,
                  post_attention_layernorm); q, k, v each cast the fp32 norm output themselves (not a
                  leaf: not cached): +4·s·b·h; gate and up likewise: +2·s·b·h; the layer's weights cast
                  to bf16 once per forward, saved by their matmuls: 2 bytes each. With full
                  checkpointing a layer keeps only its input, now fp32: +2·s·b·h
      outside     the rotary tables in the hidden states' dtype, fp32 (+4·s·d, saved by RoPE's mul);
                  model.norm's product fp32 (+2·s·b·h); lm_head's cast (2·h·v)
      state       -2 bytes/param (the fp32 weights are the master) + 4 bytes per tensor (fused AdamW's
                  step counters on the device) + 4 (the Trainer's last grad_norm)
      grads       +2 bytes/param (fp32)
      optimizer   fused: nothing above state and grads but the Trainer's clipping, at its peak _foreach_norm's
                  fp32 partial sums (4 bytes per tensor per 65,536 elements of the largest, the embedding) and
                  its 0-d norms (the last grad_norm let go first)
    Per layer it saves as many bytes as memcalc's reference model under autocast."""
    shape, t = PRESETS[name], parse_tricks(tricks)
    base = exact_step(shape, 8192, 1, t, stack=stack_for("hf", recipe="master", impl="reference"))
    hf = exact_step(shape, 8192, 1, t, stack=STACKS["hf"])
    s, h, d, v = 8192, shape.hidden, shape.head_dim, shape.vocab
    layer = by_term(hf.activations.terms)
    layer.subtract(by_term(base.activations.terms))
    outside = by_term(hf.activations.outside)
    outside.subtract(by_term(base.activations.outside))
    if t.recompute == "full":
        assert {k: x for k, x in layer.items() if x} == {
            ("checkpoint: checkpoint saves input (fp32)", "4·b·s·h"): 4 * s * h,
            ("checkpoint: checkpoint saves input (bf16)", "2·b·s·h"): -2 * s * h,
        }
    else:
        assert {k: x for k, x in layer.items() if x} == {
            ("norm1: mul saves other (fp32)", "4·b·s·h"): 4 * s * h,
            ("norm1: mul saves other (bf16)", "2·b·s·h"): -2 * s * h,
            ("norm2: mul saves other (fp32)", "4·b·s·h"): 4 * s * h,
            ("norm2: mul saves other (bf16)", "2·b·s·h"): -2 * s * h,
            ("attention: mm saves self (bf16)", "6·b·s·h"): 6 * s * h,
            ("attention: mm saves self (bf16)", "2·b·s·h"): -2 * s * h,
            ("mlp: mm saves self (bf16)", "4·b·s·h"): 4 * s * h,
            ("mlp: mm saves self (bf16)", "2·b·s·h"): -2 * s * h,
            ("attention: mm saves mat2 (bf16)", "2·h·a·d"): 2 * h * shape.q_dim,
            ("attention: mm saves mat2 (bf16)", "4·h·k·d"): 4 * h * shape.kv_dim,
            ("attention: mm saves mat2 (bf16)", "2·a·d·h"): 2 * h * shape.q_dim,
            ("mlp: mm saves mat2 (bf16)", "4·h·f"): 4 * h * shape.ffn,
            ("mlp: mm saves mat2 (bf16)", "2·f·h"): 2 * h * shape.ffn,
        }
    rope = {} if t.recompute == "full" else {("attention: mul saves other (fp32)", "8·s·d"): 8 * s * d,
                                             ("attention: mul saves other (bf16)", "4·s·d"): -4 * s * d}  # fmt: skip
    assert {k: x for k, x in outside.items() if x} == {
        **rope,
        ("final norm: mul saves other (fp32)", "4·b·s·h"): 4 * s * h,
        ("final norm: mul saves other (bf16)", "2·b·s·h"): -2 * s * h,
        ("logits: mm saves mat2 (bf16)", "2·h·v"): 2 * h * v,
    }
    n, p, q, sizes = hf.n_params, hf.phases, base.phases, param_elements(shape, "hf")
    assert p.state_bytes - q.state_bytes == -2 * n + 4 * len(sizes) + 4
    assert p.grads_bytes - q.grads_bytes == 2 * n
    clipping = 4 * len(sizes) * -(-max(sizes) // 65536) + 4 * len(sizes) - 4
    assert p.optimizer_peak_bytes == p.state_bytes + p.inputs_bytes + p.grads_bytes + clipping
    torch_model = exact_step(shape, 8192, 1, t, stack=stack_for("torch", impl="fused"))
    assert hf.activations.per_layer_bytes == torch_model.activations.per_layer_bytes


# -- the CLI ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("stack,note", [("torch", "torch.optim AdamW (foreach; fp32 weights and state)"),
                                        ("hf", "torch.optim AdamW (fused; fp32 weights and state)")])  # fmt: skip
def test_estimate_replays_the_stock_defaults(stack, note):
    """estimate --stack torch and --stack hf: the verdict is the replayed step, not the textbook's."""
    env = {"COLUMNS": "200", "TERMINAL_WIDTH": "200", "NO_COLOR": "1"}
    out = CliRunner().invoke(app, ["estimate", "--model", "qwen3-8b", "--seq", "8192", "--tricks", "bf16,flash",
                                   "--stack", stack, "--exact"], env=env)  # fmt: skip
    assert out.exit_code == 0, out.output
    text = " ".join(out.stdout.split())
    assert f"{stack} stack, its step replayed op by op" in text and note in text


# -- memcalc verify for an autocast stack: real CPU tensors at reduced size --------------------------------


def verify_json(*args: str):
    import json

    out = CliRunner().invoke(app, ["verify", *args, "--format", "json"], env={"COLUMNS": "200"})
    return out, (json.loads(out.stdout) if out.exit_code in (0, 1) else None)


def test_verify_torch_stack_at_8b_measures_a_reduced_step_on_cpu():
    """verify --stack torch (autocast, foreach) at Qwen3-8B, seq 8192: autocast does nothing on meta,
    so the step is measured on CPU tensors at reduced size, every row equal to the replay of that
    reduced step on CPU's lists; the notes say what was reduced, how the CUDA prediction of the same
    reduced step differs (the flash kernel's RNG state), and the CUDA prediction at the size asked."""
    out, r = verify_json("--model", "qwen3-8b", "--seq", "8192", "--tricks", "bf16,flash", "--stack", "torch")
    assert out.exit_code == 0, out.output
    assert r["device"] == "cpu" and r["passed"] and r["layers_built"] == 2 and r["layers_requested"] == 36
    judged = [row for row in r["rows"] if row["tolerance"] is not None]
    assert len(judged) == 9 and all(row["measured"] == row["exact"] for row in judged)
    assert "64 of 8192 tokens per sequence" in r["layers_note"] and "1024 of 151936 vocabulary" in r["layers_note"]
    notes = " ".join(r["notes"])
    assert "torch.optim AdamW (foreach; fp32 weights and state)" in notes
    assert "philox_seed (uint64) +32 B" in notes and "philox_offset (uint64) +16 B" in notes  # 2 layers
    full = exact_step(PRESETS["qwen3-8b"], 8192, 1, parse_tricks("bf16,flash"), stack=STACKS["torch"])
    assert f"({full.peak_bytes:,} B)" in notes


@pytest.fixture
def measured_once(monkeypatch):
    """verify.run.verify remembered by its arguments (the progress callback aside) through the test: the CLI's
    runs of one job in two formats print one measurement. The runs made, by their arguments."""
    import verify.run as verify_run

    real, runs = verify_run.verify, {}

    def once(*args, progress=None, **kwargs):
        key = repr((args, sorted(kwargs.items())))
        if key not in runs:
            runs[key] = real(*args, progress=progress, **kwargs)
        return runs[key]

    monkeypatch.setattr(verify_run, "verify", once)
    return runs


def test_verify_hf_stack_fp16_on_cpu(measured_once):
    """verify --stack hf (Transformers' model under autocast, fused AdamW with GradScaler's own path),
    fp16, eager: its rows equal the replay; the table names the CUDA difference in a note. (Eight tokens: the
    CPU's fp16 matmuls are slow; both formats print one measurement.)"""
    args = ["--model", "qwen3-0.6b", "--layers", "2", "--seq", "8", "--tricks", "fp16", "--stack", "hf"]
    out, r = verify_json(*args)
    assert out.exit_code == 0, out.output
    assert r["device"] == "cpu" and r["passed"]
    assert all(row["measured"] == row["exact"] for row in r["rows"] if row["tolerance"] is not None)
    assert "the CUDA prediction for this reduced step saves and keeps what the CPU one does" in r["notes"]
    table = CliRunner().invoke(app, ["verify", *args], env={"COLUMNS": "200", "NO_COLOR": "1"})
    assert table.exit_code == 0 and "the CUDA prediction for this reduced step" in table.stdout
    assert len(measured_once) == 1  # the table printed the measurement the JSON did


def test_verify_autocast_refusals(monkeypatch):
    """One line where the autocast recipe cannot be measured: --device cuda without a GPU (pick_device's
    refusal), and with one (a CUDA run of it is not wired yet)."""
    out = CliRunner().invoke(app, ["verify", "--model", "gpt2", "--seq", "32", "--stack", "torch", "--device", "cuda"])
    assert out.exit_code == 2 and "sees no CUDA device" in out.output and len(out.output.strip().splitlines()) == 1
    from memcalc.errors import InputError
    from memcalc.memory.estimate import Setup
    from memcalc.model.params import n_params
    from memcalc.model.shape import Model
    from verify.run import verify

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(InputError, match="measured on CPU tensors at reduced size so far, not on CUDA"):
        verify(Model(TINY["llama"], n_params(TINY["llama"]), "test"), Setup(24, stack=STACKS["torch"]),
               parse_tricks("bf16"), device="cuda")  # fmt: skip


def test_reduced_size():
    """What the CPU run keeps of the step asked: 2 layers (ckpt:N, N + 1: one checkpointed and one
    not), seq 64, micro-batch 2, vocabulary 1024, dropout 0 under flash; heads halved with hidden,
    KV heads and the MLP until the replay's peak fits the budget; head_dim, the GQA ratio and the
    architecture kept."""
    from memcalc.exact.hf.model import arch_for
    from verify.autocast import reduce

    shape, stack = PRESETS["qwen3-8b"], STACKS["hf"]
    red = reduce(shape, 8192, 4, parse_tricks("bf16,flash"), stack, "adamw")
    s = red.shape
    assert (s.n_layers, red.seq_len, red.micro_batch, s.vocab) == (2, 64, 2, 1024)
    assert s.head_dim == shape.head_dim and s.n_heads // s.n_kv_heads == 4 and arch_for(s) == "qwen3"
    assert s.hidden < shape.hidden and s.hidden // s.n_heads == shape.hidden // shape.n_heads
    assert "2 of 36 layers" in red.note and f"{s.hidden} of 4096 hidden" in red.note
    assert reduce(shape, 8192, 1, parse_tricks("bf16,flash,ckpt:4"), STACKS["torch"], "adamw").shape.n_layers == 5
    gpt = reduce(PRESETS["gpt2"], 1024, 1, parse_tricks("bf16,flash"), STACKS["torch"], "adamw")
    assert gpt.shape.dropout == 0 and "dropout 0" in gpt.note and gpt.shape.max_positions == 64
    small = reduce(TINY["llama"], 24, 1, parse_tricks("bf16"), STACKS["torch"], "adamw")
    assert small.shape == TINY["llama"] and small.changes == ()


# -- the roofline runs the stack's own kernels ---------------------------------------------------------------


def stack_time(stack, tricks: str = "bf16,flash", name: str = "qwen3-8b"):
    from memcalc.memory.setup import Setup
    from memcalc.model.gpus import GPUS
    from memcalc.model.params import n_params
    from memcalc.model.shape import Model
    from memcalc.time.calibration import calibration_for
    from memcalc.time.roofline import rooflines

    shape, gpu = PRESETS[name], GPUS["h100-sxm"]
    model = Model(shape, n_params(shape), name)
    return rooflines(model, Setup(8192, stack=stack), gpu, (parse_tricks(tricks),), calibration_for(gpu.key))[0]


def seconds_by_phase(t) -> dict[str, float]:
    out: dict[str, float] = {}
    for op in t.ops:
        out[op.phase] = out.get(op.phase, 0.0) + op.seconds
    return out


def test_roofline_times_the_stacks_own_kernels():
    """estimate's step time traces the stack's step (memcalc.exact.kernels.kernels_of): under autocast
    the weights' and activations' casts (_to_copy) and fp32 gradients; torch.optim's foreach kernels,
    fused AdamW's one kernel per layer. The torch stack with the reference step differs from its
    default in the optimizer step only; the reference stack's time is the reference trace's, as
    before (tests/test_golden.py and tests/test_docs.py hold its printed numbers)."""
    from memcalc.exact.kernels import kernels_of
    from memcalc.model.gpus import GPUS
    from memcalc.time.calibration import calibration_for
    from memcalc.time.roofline import roofline

    shape, t = PRESETS["qwen3-8b"], parse_tricks("bf16,flash")
    ops = {name: {k.op for k in kernels_of(shape, 8192, 1, t, st)} for name, st in
           (("reference", STACKS["reference"]), ("torch", STACKS["torch"]), ("hf", STACKS["hf"]))}  # fmt: skip
    assert {"_foreach_sqrt", "_foreach_addcdiv_"} <= ops["torch"] and "_fused_adamw_" in ops["hf"]
    assert not {"_foreach_sqrt", "_fused_adamw_"} & ops["reference"]
    casts = {name: sum(k.read_bytes * k.count for k in kernels_of(shape, 8192, 1, t, st) if k.op == "_to_copy" and k.layer == 0)
             for name, st in (("reference", STACKS["reference"]), ("torch", STACKS["torch"]))}  # fmt: skip
    assert casts["torch"] > casts["reference"]  # each weight's fp32 read for its bf16 cast, among others
    gpu = GPUS["h100-sxm"]
    plain = roofline(shape, 8192, 1, 1, t, gpu, calibration_for(gpu.key))
    assert stack_time(STACKS["reference"]) == plain
    default, same_step = stack_time(STACKS["torch"]), stack_time(stack_for("torch", impl="reference"))
    a, b = seconds_by_phase(default), seconds_by_phase(same_step)
    assert a["forward"] == b["forward"] and a["backward"] == b["backward"] and a["optimizer"] != b["optimizer"]
    assert seconds_by_phase(stack_time(STACKS["hf"]))["optimizer"] < a["optimizer"]  # fused: one pass
    assert default.step_seconds > plain.step_seconds


def test_a_stack_not_replayed_is_timed_as_the_reference():
    """Where the exact model does not replay the stack (Megatron's main_grad recipe), the roofline keeps
    the reference stack's trace."""
    assert stack_time(STACKS["megatron"]) == stack_time(STACKS["reference"])


def test_estimate_prints_the_stacks_step_time():
    """estimate --stack torch: the roofline's step time and its ops are the torch stack's trace's."""
    import json

    args = ["estimate", "--model", "qwen3-8b", "--seq", "8192", "--tricks", "bf16,flash", "--format", "json"]
    for stack in ("reference", "torch"):
        out = CliRunner().invoke(app, args + ["--stack", stack])
        assert out.exit_code == 0, out.output
        data = json.loads(out.stdout)
        roofline, (time,) = data["roofline"][0], data["time"]
        assert time["step_seconds"] == pytest.approx(stack_time(STACKS[stack]).step_seconds, rel=1e-12)
        assert ("_foreach_sqrt" in {op["op"] for op in roofline["ops"]}) == (stack == "torch")
