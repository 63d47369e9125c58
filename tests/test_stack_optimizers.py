"""The libraries' optimizers: memcalc.exact.train.optimizers' step equals torch.optim's (and bitsandbytes'
AdamW8bit's) own, measured on meta, to the byte.

Every implementation (loop = foreach=False, foreach, fused) × optimizer (AdamW, SGD with momentum,
AdamW8bit) × recipe that applies (fp32; pure bf16 and pure fp16: 16-bit weights, grads and state, no
master, no loss scaling), on tiny models allocation by allocation and at 8B width (qwen3-8b's blocks, seq
8192, three of them: what is measured is the optimizer's bytes, every one full size). The step grown from
two and three blocks to qwen3-8b's 36 equals the full-depth replay for each of them
(tests/test_exact_depth.py, test_grown_phases_with_the_libraries_optimizers); the brief's command below
verifies one three deep, and at full depth where MEMCALC_SLOW=1.
"""

from __future__ import annotations

import functools
import importlib.util
import itertools
import re
from dataclasses import replace

import pytest

torch = pytest.importorskip("torch")

from typer.testing import CliRunner  # noqa: E402

from memcalc.cli import app  # noqa: E402
from memcalc.errors import InputError  # noqa: E402
from memcalc.exact.base.config import StepConfig  # noqa: E402
from memcalc.exact.replay.meta import simulate, trace  # noqa: E402
from memcalc.exact.step import exact_step  # noqa: E402
from memcalc.memory.estimate import Setup  # noqa: E402
from memcalc.model.params import n_params  # noqa: E402
from memcalc.model.presets import PRESETS  # noqa: E402
from memcalc.model.shape import Model, ModelShape  # noqa: E402
from memcalc.model.stacks import DEFAULT_STACK, stack_for  # noqa: E402
from memcalc.model.tricks import Tricks, parse_tricks  # noqa: E402
from tests.replay import FIELDS, PEAKS_AT  # noqa: E402
from verify.meta import measure_step  # noqa: E402
from verify.run import verify  # noqa: E402

QWEN3_8B = PRESETS["qwen3-8b"]
QWEN3_8B_WIDTH = replace(QWEN3_8B, n_layers=3)  # three full-size blocks: exact_step grows from two and three
PHASE_FIELDS = FIELDS + PEAKS_AT  # the phases' bytes, their peaks and where they are
TINY = {  # a 4096-element wq (8-bit state in AdamW8bit) beside 64-element norms (fp32 state)
    "llama": ModelShape(n_layers=2, hidden=64, n_heads=4, n_kv_heads=2, ffn=160, gated_mlp=True, norm="rmsnorm",
                        vocab=200, tied_embeddings=False, positions="rope", qk_norm=True),
    "gpt": ModelShape(n_layers=2, hidden=64, n_heads=4, vocab=200, linear_bias=True, positions="learned",
                      max_positions=64, dropout=0.1),
}  # fmt: skip
HAS_BNB = importlib.util.find_spec("bitsandbytes") is not None
needs_bnb = pytest.mark.skipif(not HAS_BNB, reason="bitsandbytes not installed (pip install 'memcalc[bnb]')")
OPTIMIZERS = [("adamw", impl) for impl in ("loop", "foreach", "fused")] + [("sgd", "loop"), ("sgd", "foreach")] + [
    pytest.param("adam8bit", impl, marks=needs_bnb) for impl in ("loop", "fused")]  # fmt: skip


def sim_and_meta(shape: ModelShape, seq: int, tricks: Tricks, optimizer: str, impl: str, recipe: str = "pure"):
    stack = stack_for("torch", recipe, impl)
    cfg = StepConfig(shape, seq, 1, tricks, replace(DEFAULT_STACK, model=stack.model, recipe=stack.recipe,
                                                     impl=stack.impl), optimizer)  # fmt: skip
    phases, _, mem = simulate(cfg, timeline=True)
    step, live = measure_step(shape, seq, 1, tricks, timeline=True, stack=stack, optimizer=optimizer, count_flops=False)
    return phases, mem, step, live


def warm_up(timeline) -> list[tuple[str, int, int]]:
    """The warm-up step's allocations, from the inputs on (the weights are registered by other names)."""
    made = [(op, d, lv) for p, op, d, lv in timeline if p == "" and d > 0]
    return made[[op for op, _, _ in made].index("input"):]


@pytest.mark.parametrize("optimizer,impl", OPTIMIZERS)
@pytest.mark.parametrize("name,tricks", list(itertools.product(TINY, ("fp32", "fp16", "bf16,flash,ckpt"))))
def test_tiny_allocation_by_allocation(name, tricks, optimizer, impl):
    """Every phase equal, and every allocation of the measured optimizer step (with its frees) and of
    the warm-up step, where the state is made, in order with the live bytes at each."""
    t = parse_tricks(tricks)
    phases, mem, step, live = sim_and_meta(TINY[name], 24, t, optimizer, impl)
    for f in PHASE_FIELDS:
        assert getattr(phases, f) == getattr(step, f), f
    opt = [e for e in mem.timeline if e[0] == "optimizer"]
    assert opt == [e for e in live.timeline if e[0] == "optimizer"]
    assert warm_up(mem.timeline) == warm_up(live.timeline)


@pytest.mark.parametrize("impl", ["loop", "foreach", "fused"])
def test_fp32_is_fp32_whatever_the_recipe(impl):
    """fp32 trains the same with --recipe master or pure: the libraries' optimizers over fp32 weights."""
    t = parse_tricks("fp32")
    master, _, step, _ = sim_and_meta(TINY["llama"], 24, t, "adamw", impl, recipe="master")
    pure, _, _, _ = sim_and_meta(TINY["llama"], 24, t, "adamw", impl, recipe="pure")
    assert master == pure and master.optimizer_peak_bytes == step.optimizer_peak_bytes


@functools.lru_cache(maxsize=None)
def full_size(shape: ModelShape, tricks: str, optimizer: str, impl: str):
    """The exact step and the meta measurement at seq 8192 (measured once per test process)."""
    t, stack = parse_tricks(tricks), stack_for("torch", "pure", impl)
    step, _ = measure_step(shape, 8192, 1, t, stack=stack, optimizer=optimizer, count_flops=False)
    return exact_step(shape, 8192, 1, t, 1, stack, optimizer), step


@pytest.mark.parametrize("optimizer,impl", OPTIMIZERS)
def test_8b_pure_bf16_exact_equals_meta(optimizer, impl):
    """qwen3-8b's blocks, seq 8192, pure bf16 + flash + ckpt: every phase and where its peak is, to the byte."""
    e, step = full_size(QWEN3_8B_WIDTH, "bf16,flash,ckpt", optimizer, impl)
    for f in PHASE_FIELDS:
        assert getattr(e.phases, f) == getattr(step, f), f


@pytest.mark.parametrize("tricks,impl", [("fp32,ckpt", "loop"), ("fp32,ckpt", "foreach"), ("fp32,ckpt", "fused"),
                                         ("fp16,flash,ckpt", "foreach")])  # fmt: skip
def test_8b_fp32_and_pure_fp16_exact_equals_meta(tricks, impl):
    e, step = full_size(QWEN3_8B_WIDTH, tricks, "adamw", impl)
    for f in PHASE_FIELDS:
        assert getattr(e.phases, f) == getattr(step, f), f


def test_8b_optimizer_peaks_follow_torch_code():
    """What each implementation holds above the step's start (state, inputs, grads), from the shape:
    fused nothing; foreach one _foreach_sqrt output per parameter; loop sqrt and its quotient of one
    tensor beside the previous tensor's denominator (torch/optim/adam.py)."""
    sizes = [2 * n for n in param_elements(QWEN3_8B)]  # bf16 bytes, in model.parameters() order
    above = {}
    for impl in ("loop", "foreach", "fused"):
        e = exact_step(QWEN3_8B, 8192, 1, parse_tricks("bf16,flash,ckpt"), 1, stack_for("torch", "pure", impl))
        p = e.phases
        above[impl] = p.optimizer_peak_bytes - (p.state_bytes + p.inputs_bytes + p.grads_bytes)
    assert above["fused"] == 0
    assert above["foreach"] == sum(sizes)
    assert above["loop"] == max(prev + 2 * size for prev, size in zip([0] + sizes, sizes))


def param_elements(shape: ModelShape) -> list[int]:
    """Elements of each parameter of the reference model, in registration order (built in the sim)."""
    from memcalc.exact.builder.model import build
    from memcalc.exact.sim.graph import Graph
    from memcalc.exact.sim.tensors import LiveBytes

    cfg = StepConfig(shape, 1, 1, Tricks("bf16", True))
    return [p.numel for p in build(Graph(LiveBytes()), cfg).params]


@needs_bnb
def test_8bit_state_is_bitsandbytes_layout():
    """AdamW8bit's state at 8B width: uint8 m and v and two fp32 absmax per 256-element block for tensors of
    4096 elements or more, fp32 m and v below (qwen3's 128-element q/k norms), two 256-entry fp32
    quantile maps (bitsandbytes/optim/optimizer.py Optimizer2State.init_state)."""
    e, step = full_size(QWEN3_8B_WIDTH, "bf16,flash,ckpt", "adam8bit", "loop")
    ns = param_elements(QWEN3_8B_WIDTH)
    big, small = [n for n in ns if n >= 4096], [n for n in ns if n < 4096]
    state = sum(2 * n + 2 * 4 * -(-n // 256) for n in big) + sum(2 * 4 * n for n in small) + 2 * 256 * 4
    assert small and step.state_bytes - step.weights_bytes == state == e.phases.state_bytes - e.phases.weights_bytes


CPU_LLAMA = ModelShape(n_layers=4, hidden=64, n_heads=4, n_kv_heads=2, ffn=160, gated_mlp=True, norm="rmsnorm",
                       vocab=200, tied_embeddings=False, positions="rope", qk_norm=True, name="tiny-llama")  # fmt: skip


@pytest.mark.parametrize("impl,optimizer,tricks", [("foreach", "adamw", "fp32"), ("fused", "adamw", "bf16"),
                                                   ("loop", "sgd", "bf16")])  # fmt: skip
def test_cpu_stand_in_names_the_host_step_counters(impl, optimizer, tricks):
    """On real CPU tensors (verify --device cpu, the CUDA path's stand-in) torch.optim's loop and foreach
    keep AdamW's step counters on the CPU (torch/optim/adam.py Adam._init_group), which there is the
    weights' device: 4 bytes per parameter tensor more in every row from the first step on. On CUDA
    they are host memory and on meta not meta tensors; fused keeps them on the device everywhere, and
    SGD has none. The stand-in's prediction is the CPU replay's (exact_step(device="cpu")), so every row
    is equal; the CUDA prediction is the counters less."""
    setup = Setup(32, micro_batch=2, optimizer=optimizer, stack=stack_for("torch", "pure", impl))
    r = verify(Model(CPU_LLAMA, n_params(CPU_LLAMA), "test"), setup, parse_tricks(tricks), device="cpu", steps=1)
    assert r.error is None
    host = 4 * len(param_elements(CPU_LLAMA)) if (optimizer, impl) in (("adamw", "loop"), ("adamw", "foreach")) else 0
    for row in r.rows:
        if row.unit == "bytes" and row.exact is not None and row.measured is not None:
            assert row.measured == row.exact, row.quantity
    args = (CPU_LLAMA, 32, 2, parse_tricks(tricks), 1, setup.stack, optimizer)
    cpu, cuda = exact_step(*args, device="cpu").phases, exact_step(*args).phases
    assert cpu.state_bytes - cuda.state_bytes == host


def test_traced_step_is_the_second():
    """trace(): the libraries make their state at the first step (zeros_like, SGD's clone), so the traced
    step is a later one; a fused kernel reads and writes each tensor of its group once."""
    shape = TINY["llama"]
    for optimizer, impl in (("adamw", "fused"), ("sgd", "loop"), ("adamw", "foreach")):
        cfg = StepConfig(shape, 16, 1, Tricks("bf16"), replace(DEFAULT_STACK, recipe="pure", impl=impl), optimizer)
        ops = [k for k in trace(cfg) if k.phase == "optimizer"]
        assert not {"zeros_like", "zeros", "clone"} & {k.op for k in ops}, (optimizer, impl)
    pure = replace(DEFAULT_STACK, recipe="pure", impl="fused")
    fused = [k for k in trace(StepConfig(shape, 16, 1, Tricks("bf16"), pure)) if k.op == "_fused_adamw_"]
    weights = 2 * sum(param_elements(shape))
    steps = 4 * len(param_elements(shape))
    assert sum(k.read_bytes for k in fused) == 4 * weights + steps  # params, grads, m, v, step counters
    assert sum(k.write_bytes for k in fused) == 3 * weights  # params, m, v
    assert {k.layer for k in fused} == {None, 0, 1}  # one per layer, and one outside the blocks


@pytest.mark.parametrize("precision,recipe,impl,optimizer,message", [
    ("bf16", "master", "foreach", "adamw", "master recipe (fp32 master weights) runs with its reference"),
    ("bf16", "pure", "reference", "adamw", "pure recipe trains with torch.optim"),
    ("fp32", "master", "reference", "sgd", "reference implementation trains AdamW"),
    ("bf16", "pure", "fused", "sgd", "no meta kernel for aten::_fused_sgd_"),
])  # fmt: skip
def test_what_is_not_replayed_is_refused(precision, recipe, impl, optimizer, message):
    shape, stack = TINY["llama"], stack_for("torch", recipe, impl)
    with pytest.raises(InputError, match=re.escape(message)):
        exact_step(shape, 16, 1, parse_tricks(precision), 1, stack, optimizer)
    with pytest.raises(InputError, match=re.escape(message)):  # verify refuses the same before building anything
        verify(Model(shape, n_params(shape), "test"), Setup(16, optimizer=optimizer, stack=stack),
               parse_tricks(precision), "meta")  # fmt: skip


def test_estimate_exact_with_the_pure_recipe():
    out = CliRunner().invoke(app, ["estimate", "--params", "8e9", "--seq", "8192", "--stack", "torch", "--recipe",
                                   "pure", "--tricks", "bf16,flash", "--exact"], env={"COLUMNS": "200"})  # fmt: skip
    assert out.exit_code == 0, out.output
    assert "torch.optim AdamW (foreach; bf16 weights and state, no master)" in out.stdout


@pytest.mark.parametrize("args", [["--optimizer", "sgd", "--optimizer-impl", "loop"],
                                  ["--optimizer", "adam8bit", "--optimizer-impl", "fused"]])  # fmt: skip
def test_estimate_exact_with_the_other_optimizers(args):
    out = CliRunner().invoke(app, ["estimate", "--params", "8e9", "--seq", "8192", "--stack", "torch", "--recipe",
                                   "pure", "--tricks", "bf16,flash,ckpt", "--exact", *args], env={"COLUMNS": "200"})  # fmt: skip
    assert out.exit_code == 0, out.output
    assert ("SGD with momentum (loop" if "sgd" in args else "bitsandbytes AdamW8bit (bf16") in out.stdout


@pytest.mark.parametrize("layers", [
    ["--layers", "3"],  # qwen3-8b's blocks three deep (the growth to 36: test_exact_depth's LIBRARY)
    pytest.param([], marks=pytest.mark.slow("the same command with --layers 3")),
], ids=["3-layers", "36-layers"])  # fmt: skip
def test_verify_meta_pure_foreach_at_8b(layers):
    """The brief's command: every row passes, the optimizer-step peak among them."""
    out = CliRunner().invoke(app, ["verify", "--device", "meta", "--stack", "torch", "--recipe", "pure",
                                   "--optimizer-impl", "foreach", "--params", "8e9", "--seq", "8192", "--tricks",
                                   "bf16,flash,ckpt", "--format", "json", *layers])  # fmt: skip
    assert out.exit_code == 0, out.output
    assert '"optimizer-step peak"' in out.stdout and "_foreach_sqrt" in out.stdout


def test_the_textbook_keeps_a_paged_state_off_the_gpu():
    """bitsandbytes' paged optimizers hold their moments in unified memory (functional.get_paged: cudaMallocManaged),
    outside the GPU's allocator, as the replay counts them: the textbook's state puts them there too (it put
    PagedAdamW's 8 bytes/param on the GPU beside a replayed state of 2)."""
    from memcalc.memory.state import finetune_state, model_state

    n = 1_000_000
    full = model_state(n, "bf16", "paged-adamw", recipe="pure")
    assert (full.total_bytes, full.host_bytes) == (4 * n, 8 * n)  # bf16 weights and grads; fp32 m and v, paged
    assert model_state(n, "bf16", "adamw", recipe="pure").host_bytes == 0
    eight = model_state(n, "bf16", "paged-adam8bit", recipe="pure")
    assert eight.host_bytes == 2 * (n + 4 * -(-n // 256)) and eight.total_bytes == 4 * n
    from memcalc.memory.state import StateSharding

    offloaded = {p.name: p for p in model_state(n, "bf16", "paged-adamw", StateSharding(8, 2, True)).parts}
    assert offloaded["master"].on_host and not offloaded["master"].unified  # ZeRO-Offload's, in plain host memory
    assert offloaded["adam_m"].on_host and offloaded["adam_m"].unified  # the paged moments, in unified memory
    lora = finetune_state(n + 1000, n, 1000, "bf16", "bf16", "paged-adamw", "pure", True)
    assert lora.host_bytes == 8 * 1000 and lora.total_bytes == 2 * n + 8 * 1000  # fp32 adapters and their grads


def test_a_paged_lora_keeps_the_adapters_moments_in_host_memory():
    """The verdict's host memory under LoRA with PagedAdamW is the fp32 moments of the adapters large enough to page
    (1e5 elements or more: get_state_buffer), the rest on the GPU beside the replay's state (it counted the whole
    model's for a moment, 64 GB for Llama-3-8B, and so refused a 24 GB card with 32 GB of host RAM)."""
    import json

    from memcalc.model.bnb import MIN_PAGED_SIZE
    from memcalc.model.finetune import Finetune, adapter_sizes
    from memcalc.model.presets import PRESETS

    args = ["estimate", "--model", "llama3-8b", "--seq", "2048", "--lora", "16", "--optimizer", "paged-adamw",
            "--tricks", "bf16,flash,ckpt", "--gpu", "rtx4090", "--host-memory", "32G", "--format", "json"]  # fmt: skip
    out = CliRunner().invoke(app, args)
    assert out.exit_code == 0, out.output
    data = json.loads(out.stdout)
    sizes = adapter_sizes(PRESETS["llama3-8b"], Finetune(16))
    paged, kept = sum(n for n in sizes if n >= MIN_PAGED_SIZE), sum(n for n in sizes if n < MIN_PAGED_SIZE)
    v, parts = data["verdict"][0], {p["name"]: p for p in data["model_state"]["parts"]}
    assert v["host_bytes"] == 8 * paged and v["fits"] and paged and kept
    assert parts["adapter adam_m"]["bytes"] == 4 * kept and not parts["adapter adam_m"]["on_host"]
    assert parts["adapter adam_m (paged)"]["bytes"] == 4 * paged and parts["adapter adam_m (paged)"]["on_host"]
    # the replay's state between steps: the base and adapters, the moments bitsandbytes did not page, the
    # rotary embedding's fp32 inv_freq and original_inv_freq (head_dim / 2 each), the Trainer's last grad_norm
    weights = sum(p["bytes"] for n, p in parts.items() if n in ("frozen weights", "adapter weights"))
    assert v["state_bytes"] == weights + 8 * kept + 2 * 4 * PRESETS["llama3-8b"].head_dim // 2 + 4
