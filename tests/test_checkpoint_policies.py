"""torchtitan's activation-checkpointing policies: per-layer (ckpt:N, every Nth block) and per-op (sac).

memcalc.exact replays them op by op and equals what torch.utils.checkpoint does on the meta device, to the
byte, phase by phase (verify/builder.py applies them with torch.utils.checkpoint and
create_selective_checkpoint_contexts, the per-op policy as torchtitan v0.1.0 writes it). The step grown
from short steps equals the full-depth replay; the roofline's weighted trace equals a full-depth trace.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from memcalc.cli import app
from memcalc.errors import InputError
from memcalc.exact.builder.model import torchtitan_policy
from memcalc.exact.base.config import StepConfig
from memcalc.exact.kernels import block_weight, kernels_of
from memcalc.exact.replay.meta import simulate, trace
from memcalc.exact.step import config, exact_step
from memcalc.memory.activations import layer_terms, textbook_activations
from memcalc.model.flops import textbook_step_flops
from memcalc.model.presets import PRESETS
from memcalc.model.shape import ModelShape
from memcalc.model.stacks import stack_for
from memcalc.model.tricks import parse_tricks
from tests.replay import FIELDS, GPT_8B, PEAKS_AT, assert_same_step

POLICIES = ("ckpt:2", "ckpt:3", "sac")
QWEN3_8B = PRESETS["qwen3-8b"]
SMALL = {
    "llama": ModelShape(n_layers=7, hidden=64, n_heads=4, n_kv_heads=2, ffn=160, gated_mlp=True, norm="rmsnorm",
                        vocab=200, tied_embeddings=False, positions="rope", qk_norm=True),
    "gpt": ModelShape(n_layers=7, hidden=64, n_heads=4, vocab=200, linear_bias=True, positions="learned",
                      max_positions=64, dropout=0.1),
}  # fmt: skip
PHASE_FIELDS = FIELDS + PEAKS_AT  # the phases' bytes, their peaks and where they are


def tricks_for(policy: str, flash: bool):
    return parse_tricks(("bf16,flash," if flash else "bf16,") + policy)


def cfg_of(shape, seq, batch, t, grad_accum=1) -> StepConfig:
    return StepConfig(shape, seq, batch, t, grad_accum=grad_accum)


# -- the trick names ----------------------------------------------------------------------------------


def test_names_round_trip():
    for text, label in (("bf16,flash,ckpt:2", "bf16+flash+ckpt:2"), ("ckpt:3", "bf16+ckpt:3"), ("sac", "bf16+sac"),
                        ("fp16,flash,sac", "fp16+flash+sac"), ("ckpt:1", "bf16+ckpt")):  # fmt: skip
        t = parse_tricks(text)
        assert t.label == label and parse_tricks(t.label) == t
    assert parse_tricks("ckpt:1") == parse_tricks("ckpt")


@pytest.mark.parametrize("text, message", [
    ("bf16,sac,selective", "choose one way to recompute, not selective and sac"),
    ("sac,ckpt", "choose one way to recompute, not ckpt and sac"),
    ("ckpt:2,selective", "drop selective or ckpt"),
    ("ckpt:2,ckpt:3", "choose one checkpointing frequency, not ckpt:2 and ckpt:3"),
    ("ckpt:0", "N must be a whole number from 1"),
    ("ckpt:two", "N must be a whole number from 1"),
    ("ckpt:-1", "N must be a whole number from 1"),
])  # fmt: skip
def test_refusals_are_one_clear_line(text, message):
    with pytest.raises(InputError, match=message) as err:
        parse_tricks(text)
    assert "\n" not in str(err.value)


# -- which blocks, which ops ----------------------------------------------------------------------------


def test_every_nth_block_counted_from_one():
    """torchtitan's _apply_layer_sac: a counter from 1 over the blocks, checkpointed when count % N == 0."""
    t = parse_tricks("ckpt:3")
    assert [i for i in range(8) if t.checkpointed(i)] == [2, 5]
    assert t.n_checkpointed(8) == 2 and parse_tricks("sac").n_checkpointed(8) == 8


def test_the_per_op_policy_is_torchtitans():
    """verify's policy (torch ops, through create_selective_checkpoint_contexts's interface) and the
    simulator's (op names) decide alike: every aten.mm but each second, the flash op; never addmm or bmm."""
    torch = pytest.importorskip("torch")
    from collections import defaultdict

    from torch.utils.checkpoint import CheckpointPolicy, SelectiveCheckpointContext

    from verify.builder import sac_policy

    aten = torch.ops.aten
    calls = [aten.mm.default, aten.addmm.default, aten.mm.default, aten._scaled_dot_product_flash_attention.default,
             aten.mm.default, aten.bmm.default, aten.mm.default, aten.mm.default, aten.max.default]  # fmt: skip
    policy, counts = sac_policy(defaultdict(int)), Counter()
    for func in calls:
        name = func.overloadpacket.__name__
        counts[name] += 1
        kept = policy(SelectiveCheckpointContext(is_recompute=False), func) == CheckpointPolicy.MUST_SAVE
        assert kept == torchtitan_policy(name, counts[name]), name
    assert [torchtitan_policy("mm", n) for n in range(1, 8)] == [True, False, True, False, True, False, True]


def test_linear_dispatches_mm_without_a_bias_and_addmm_with_one():
    """What the policy sees on meta: F.linear on a 3-D input folds to aten.mm; with a bias it is aten.addmm."""
    torch = pytest.importorskip("torch")
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.seen.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    x = torch.empty(2, 8, 16, device="meta", dtype=torch.bfloat16)
    w = torch.empty(32, 16, device="meta", dtype=torch.bfloat16)
    b = torch.empty(32, device="meta", dtype=torch.bfloat16)
    with Ops() as plain:
        torch.nn.functional.linear(x, w)
    with Ops() as biased:
        torch.nn.functional.linear(x, w, b)
    assert "mm" in plain.seen and "addmm" not in plain.seen
    assert "addmm" in biased.seen and "mm" not in biased.seen


def test_sac_keeps_wq_wv_gate_and_down_and_the_flash_outputs():
    """A Qwen3 block's seven mms: wq, wv, gate and down (1st, 3rd, 5th, 7th) are kept; the flash op's
    output, logsumexp and Philox seed and offset too; the block's input, as every checkpoint keeps."""
    a = exact_step(QWEN3_8B, 8192, 1, parse_tricks("bf16,flash,sac")).activations
    s, h, q, kv, f = 8192, QWEN3_8B.hidden, QWEN3_8B.q_dim, QWEN3_8B.kv_dim, QWEN3_8B.ffn
    kept = sorted(t.value for t in a.terms if t.name.startswith(("attention: mm", "mlp: mm")))
    assert kept == sorted([2 * s * q, 2 * s * kv, 2 * s * f, 2 * s * h])
    flash = sorted(t.value for t in a.terms if "flash_attention" in t.name)
    assert flash == sorted([2 * s * q, 4 * QWEN3_8B.n_heads * s, 16, 8])
    assert sum(t.value for t in a.terms if t.name.startswith("checkpoint:")) == 2 * s * h
    assert a.per_layer_bytes == 2 * s * (q + kv + f + h) + 2 * s * q + 4 * QWEN3_8B.n_heads * s + 24 + 2 * s * h


def test_gpt_sac_keeps_no_matmul():
    """GPT's linears have biases: aten.addmm, not in the save list. Only the flash outputs are kept."""
    a = exact_step(GPT_8B, 8192, 1, parse_tricks("bf16,flash,sac")).activations
    assert not [t for t in a.terms if ": mm " in t.name or ": addmm " in t.name]
    assert [t for t in a.terms if "flash_attention" in t.name]


def test_the_recompute_skips_what_sac_kept():
    """FLOPs the recompute runs: wk, wo and up again (wq, wv, gate come from the cache; the recompute
    stops at down's input, the last tensor backward needs); attention not at all (flash's output kept)."""
    shape, t = replace(QWEN3_8B, n_layers=4), parse_tricks("bf16,flash,sac")
    e = exact_step(shape, 8192, 1, t)
    recompute = {term.name: term.value for term in e.flops.terms if term.name.startswith("recompute")}
    T, h, q, kv, f = 8192, shape.hidden, shape.q_dim, shape.kv_dim, shape.ffn
    assert recompute == {"recompute: layer matmuls": 4 * 2 * T * (h * kv + q * h + h * f)}


# -- exact = meta, to the byte ----------------------------------------------------------------------------


def assert_exact_equals_meta(shape, seq, batch, t, grad_accum=1, step=None):
    """Every phase of the step (peaks and where they are), the saved bytes and FLOPs: the replay of every
    block, and exact_step's growth, equal the meta measurement (step: one already measured)."""
    pytest.importorskip("torch")
    from verify.meta import measure_step

    if step is None:
        step, _ = measure_step(shape, seq, batch, t, grad_accum=grad_accum)
    e = exact_step(shape, seq, batch, t, grad_accum)
    for name in PHASE_FIELDS:
        assert getattr(e.phases, name) == getattr(step, name), name
    assert e.activations.total_bytes == step.saved_bytes
    assert step.flops == e.flops.counted  # its first micro-batch's


@pytest.mark.parametrize("family", SMALL)
@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("flash", [False, True], ids=["eager", "flash"])
def test_small_exact_equals_meta_allocation_by_allocation(family, policy, flash):
    """Every allocation of forward, backward and the optimizer step, in order, with the live bytes."""
    pytest.importorskip("torch")
    from verify.meta import measure_step

    shape, t = SMALL[family], tricks_for(policy, flash)
    phases, g, mem = simulate(cfg_of(shape, 24, 2, t), timeline=True)
    step, live = measure_step(shape, 24, 2, t, timeline=True)
    assert_same_step(phases, g, mem, step, live, t.label)
    assert_exact_equals_meta(shape, 24, 2, t, step=step)


@pytest.mark.parametrize("policy", [p if p != "ckpt:3" else pytest.param(p, marks=pytest.mark.slow(
    "test_small_with_gradient_accumulation[ckpt:2], the same with the second of three blocks")) for p in POLICIES])
def test_small_with_gradient_accumulation(policy):
    for shape in SMALL.values():
        assert_exact_equals_meta(shape, 24, 1, tricks_for(policy, True), grad_accum=3)


@pytest.mark.parametrize("impl", ["foreach", "fused"])
def test_small_with_the_pure_recipe_and_torch_optim(impl):
    """The policies are the model's; the recipe and the optimizer are the stack's: any pair replays exactly."""
    pytest.importorskip("torch")
    from verify.meta import measure_step

    stack = stack_for("reference", recipe="pure", impl=impl)
    for shape in SMALL.values():
        for policy in POLICIES:
            t = tricks_for(policy, True)
            step, _ = measure_step(shape, 24, 2, t, stack=stack, count_flops=False)
            e = exact_step(shape, 24, 2, t, 1, stack)
            assert [getattr(e.phases, f) for f in PHASE_FIELDS] == [getattr(step, f) for f in PHASE_FIELDS], policy
            assert e.activations.total_bytes == step.saved_bytes


@pytest.mark.parametrize("family", ["llama", "gpt"])
@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("flash", [False, True], ids=["eager", "flash"])
def test_8b_width_exact_equals_meta(family, policy, flash):
    """At full 8B width and seq 8192 (qwen3-8b; the GPT layer at the same width), seven blocks: ckpt:2 is
    three groups and one block left over, ckpt:3 two groups and one. (All 36 blocks: the next tests.)"""
    shape = replace(QWEN3_8B if family == "llama" else GPT_8B, n_layers=7)
    assert_exact_equals_meta(shape, 8192, 1, tricks_for(policy, flash))


@pytest.mark.slow("test_8b_width_exact_equals_meta[flash-ckpt:2-llama] (seven blocks) and "
                  "test_grown_phases_equal_the_full_depth_replay[bf16,flash,ckpt:2-qwen3-8b-8192]")
def test_qwen3_8b_ckpt2_full_depth_exact_equals_meta():
    assert_exact_equals_meta(QWEN3_8B, 8192, 1, parse_tricks("bf16,flash,ckpt:2"))


def test_per_layer_bytes_from_depths_at_8b_width():
    """verify's per-layer rows: with ckpt:3, depths 2, 3 and 4 give one plain and one checkpointed layer."""
    pytest.importorskip("torch")
    from verify.meta import saved_at_depth

    t = parse_tricks("bf16,flash,ckpt:3")
    a = exact_step(QWEN3_8B, 8192, 1, t).activations
    two, three, four = (saved_at_depth(QWEN3_8B, 8192, 1, t, d) for d in (2, 3, 4))
    assert (four - three, three - two, two - 2 * (four - three)) == (a.per_layer_bytes, a.checkpointed_bytes,
                                                                      a.outside_bytes)  # fmt: skip
    assert a.checkpointed_bytes == 2 * 8192 * QWEN3_8B.hidden  # the block's input
    assert a.n_checkpointed == 12
    assert a.total_bytes == 24 * a.per_layer_bytes + 12 * a.checkpointed_bytes + a.outside_bytes


# -- the growth: short steps grown to the depth equal the full-depth replay -------------------------------


def assert_grown_equals_replay(shape, seq, batch, t, grad_accum=1):
    phases, g, _ = simulate(config(shape, seq, batch, t, grad_accum))  # every block, after a warm-up step
    e = exact_step(shape, seq, batch, t, grad_accum)
    assert e.phases == phases
    assert e.activations.total_bytes == sum(x.nbytes for x in g.saved_terms)
    assert e.flops.counted == sum(g.flops.values())


@pytest.mark.parametrize("name, seq", [("qwen3-8b", 8192), ("llama3-8b", 8192), ("gpt2", 1024)])
@pytest.mark.parametrize("tricks", ["bf16,flash,ckpt:2", "bf16,ckpt:3", "bf16,flash,ckpt:5", "bf16,flash,sac",
                                    "bf16,sac", "fp32,ckpt:4"])  # fmt: skip
def test_grown_phases_equal_the_full_depth_replay(name, seq, tricks):
    assert_grown_equals_replay(PRESETS[name], seq, 1, parse_tricks(tricks))


shapes = st.builds(
    lambda layers, heads, kv, dim, gated, ffn, tied: ModelShape(
        n_layers=layers, hidden=heads * dim, n_heads=heads, n_kv_heads=kv, ffn=ffn, gated_mlp=gated,
        norm="rmsnorm" if gated else "layernorm", positions="rope" if gated else "none", vocab=97,
        tied_embeddings=tied, dropout=0.0 if gated else 0.1),
    layers=st.integers(1, 13), heads=st.sampled_from([2, 4]), kv=st.sampled_from([1, 2]), dim=st.sampled_from([8, 16]),
    gated=st.booleans(), ffn=st.sampled_from([24, 64, 200]), tied=st.booleans(),
)  # fmt: skip


@settings(max_examples=30, deadline=None)
@given(shape=shapes, seq=st.sampled_from([8, 32, 96]), batch=st.sampled_from([1, 3]), ga=st.sampled_from([1, 2]),
       tricks=st.sampled_from(["bf16,ckpt:2", "bf16,flash,ckpt:3", "fp16,ckpt:4", "bf16,flash,sac", "fp32,sac",
                               "bf16,ckpt:7"]))  # fmt: skip
def test_grown_phases_for_any_shape_and_depth(shape, seq, batch, ga, tricks):
    """Any depth, including fewer blocks than N (nothing checkpointed) and depths that leave a tail."""
    assert_grown_equals_replay(shape, seq, batch, parse_tricks(tricks), ga)


def test_fewer_blocks_than_n_is_no_checkpointing():
    shape = replace(SMALL["llama"], n_layers=4)
    e, plain = exact_step(shape, 32, 1, parse_tricks("bf16,ckpt:5")), exact_step(shape, 32, 1, parse_tricks("bf16"))
    assert e.phases == plain.phases and e.activations.n_checkpointed == 0


# -- the roofline's kernels: one group traced and weighted ---------------------------------------------


@pytest.mark.parametrize("family", SMALL)
@pytest.mark.parametrize("tricks", ["bf16,flash,ckpt:2", "bf16,ckpt:3", "bf16,flash,ckpt:9", "bf16,sac",
                                    "bf16,flash,sac"])  # fmt: skip
def test_weighted_trace_equals_a_full_depth_trace(family, tricks):
    shape, t = SMALL[family], parse_tricks(tricks)
    full = trace(cfg_of(shape, 64, 2, t))
    weighted = Counter()
    for k in kernels_of(shape, 64, 2, t):
        weighted[(k.key(), k.layer is None)] += block_weight(k, shape.n_layers, t) * k.count
    assert weighted == Counter((k.key(), k.layer is None) for k in full)
    assert sum(k.counted for k in full) == exact_step(shape, 64, 2, t).flops.counted


def test_a_plain_step_is_a_sac_step_less_the_recompute():
    """sac's forward runs every op (the policy only keeps outputs) and its backward the same kernels: the
    plain step's trace may be taken from a sac trace (memcalc.exact.kernels.without_recompute)."""
    for shape in SMALL.values():
        plain = trace(cfg_of(shape, 64, 2, parse_tricks("bf16,flash")))
        sac = trace(cfg_of(shape, 64, 2, parse_tricks("bf16,flash,sac")))
        assert [(k.key(), k.layer) for k in plain] == [(k.key(), k.layer) for k in sac if k.phase != "recompute"]


# -- the textbook ------------------------------------------------------------------------------------------


def test_textbook_ckpt_n_is_a_mix_of_its_rows():
    """ckpt:N: the L // N layers checkpointed keep ckpt's row (2sbh), the others the row without recompute."""
    s, b = 2048, 1
    for flash in (False, True):
        t = tricks_for("ckpt:4", flash)
        rows = layer_terms(GPT_8B, s, b, 1)
        none = textbook_activations(GPT_8B, s, b, replace(t, recompute="none", ckpt_every=1))
        a = textbook_activations(GPT_8B, s, b, t)
        assert a.n_checkpointed == 9 and a.checkpointed_bytes == rows["input"].value == 2 * s * b * GPT_8B.hidden
        assert a.total_bytes == 27 * none.per_layer_bytes + 9 * rows["input"].value
        assert a.rebuilt_bytes == none.per_layer_bytes  # one layer rebuilt at a time


def test_textbook_has_no_formula_for_sac():
    a = textbook_activations(GPT_8B, 2048, 1, parse_tricks("bf16,sac"))
    assert not a.formula and not a.terms
    assert textbook_step_flops(GPT_8B, 2048, parse_tricks("bf16,sac")) is None
    full = textbook_step_flops(GPT_8B, 2048, parse_tricks("bf16,ckpt"))
    half = textbook_step_flops(GPT_8B, 2048, parse_tricks("bf16,ckpt:2"))
    plain = textbook_step_flops(GPT_8B, 2048, parse_tricks("bf16"))
    extra = {n: f.hardware_per_token - plain.hardware_per_token for n, f in (("full", full), ("half", half))}
    assert 2 * extra["half"] == extra["full"] > 0


# -- the CLI ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("tricks", ["bf16,flash,sac", "bf16,flash,ckpt:2"])
def test_estimate_gives_the_replayed_verdict_and_step_time(tricks):
    out = CliRunner().invoke(app, ["estimate", "--model", "qwen3-8b", "--seq", "8192", "--tricks", tricks, "--bytes"],
                             env={"NO_COLOR": "1"})  # fmt: skip
    assert out.exit_code == 0, out.output
    t = parse_tricks(tricks)
    row = next(line for line in out.stdout.splitlines() if line.startswith(f" {t.label} "))
    assert re.search(r"\d[\d.]* m?s +\d[\d.]*%$", row), row  # the step time and MFU
    assert f"{exact_step(QWEN3_8B, 8192, 1, t).peak_bytes:,} B" in out.stdout  # the verdict: the replayed peak
    assert ("no formula" in row) == (t.recompute == "op")


@pytest.mark.parametrize("layers", [
    ["--layers", "3"],  # qwen3-8b's blocks three deep (the growth to 36: test_grown_phases_equal_the_full_depth_replay)
    pytest.param([], marks=pytest.mark.slow("the same command with --layers 3")),
], ids=["3-layers", "36-layers"])  # fmt: skip
def test_verify_sac_at_8b_passes_every_row(layers):
    """`memcalc verify --device meta --tricks bf16,flash,sac --params 8e9 --seq 8192`: every judged row passes."""
    pytest.importorskip("torch")
    args = ["verify", "--device", "meta", "--tricks", "bf16,flash,sac", "--params", "8e9", "--seq", "8192", *layers]
    out = CliRunner().invoke(app, args, env={"NO_COLOR": "1"})
    assert out.exit_code == 0, out.output
    assert "Pass: all 13 judged rows" in out.stdout and "FAIL" not in out.stdout
    assert "no formula for sac" in out.stdout


@pytest.mark.parametrize("args, message", [
    (["estimate", "--model", "qwen3-8b", "--tricks", "bf16,flash,ckpt:2", "--tp", "2"], "the parallel layouts know"),
    (["plan", "--model", "qwen3-8b", "--gpus", "8", "--global-batch", "64", "--tricks", "ckpt:2"], "planner"),
    (["mfu", "--model", "qwen3-8b", "--tricks", "sac", "--tokens-per-sec", "3000"], "published MFU conventions"),
    (["estimate", "--model", "gpt2", "--seq", "1024", "--stack", "megatron", "--tricks", "sac"], "the textbook has no formula for sac"),
])  # fmt: skip
def test_what_does_not_take_the_new_policies_says_so(args, message):
    out = CliRunner().invoke(app, args, env={"NO_COLOR": "1"})
    assert out.exit_code == 2 and message in out.output


@pytest.mark.parametrize("tricks", ["bf16,flash,sac", "bf16,ckpt:3"])
def test_every_view_of_estimate_takes_them(tricks):
    """--detail, --exact and --explain: the textbook's rows say what it has (ckpt:N's two kinds of layer)
    or that it has no formula (sac); the CSV leaves sac's textbook columns empty."""
    out = CliRunner().invoke(app, ["estimate", "--model", "qwen3-0.6b", "--seq", "2048", "--tricks", tricks, "--detail",
                                   "--exact", "--explain", "--bytes"], env={"NO_COLOR": "1"})  # fmt: skip
    assert out.exit_code == 0, out.output
    t = parse_tricks(tricks)
    if t.recompute == "op":
        assert "no textbook formula" in out.stdout
    else:
        assert "9 checkpointed" in out.stdout and "kept per checkpointed layer = " in out.stdout
    csv = CliRunner().invoke(app, ["estimate", "--model", "qwen3-0.6b", "--tricks", tricks, "--format", "csv"])
    row = csv.stdout.splitlines()[1].split(",")
    assert (row[1:4] == ["", "", ""]) == (t.recompute == "op")


def test_gpt_eager_sac_is_full_checkpointing():
    """With biased linears (aten.addmm) and eager attention (aten.bmm) nothing of a GPT block is in the
    save list: the step is ckpt's, byte for byte and FLOP for FLOP."""
    sac, ckpt = (exact_step(GPT_8B, 8192, 1, parse_tricks(t)) for t in ("bf16,sac", "bf16,ckpt"))
    assert sac.phases == ckpt.phases and sac.flops.counted == ckpt.flops.counted
