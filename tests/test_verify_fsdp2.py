"""FSDP2 as torchtitan runs it, every phase's peak, on PyTorch's own engine (issue 12, item 5).

One process plays one rank on the fake process group: fp32 parameters under MixedPrecisionPolicy(bf16, fp32),
torchtitan's units and reshard policy, torch.optim.AdamW(fused=True), zero_grad(set_to_none) first. Live
bytes are counted on the fake tensors, FSDP2's storage resizes included. memcalc.exact.replay.fsdp2 replays
the same step on memcalc.exact: live bytes between steps and each phase's peak equal to the byte. Models are
presets at full width with few layers (every per-rank byte of a layer is full size).
"""

import json
from dataclasses import replace

import pytest
from typer.testing import CliRunner

from memcalc.cli import app
from memcalc.errors import InputError
from memcalc.exact.replay.fsdp2 import fsdp2_phases
from memcalc.exact.replay.fsdp2_units import Param, units_for
from memcalc.memory.estimate import Setup
from memcalc.model.params import n_params
from memcalc.model.presets import PRESETS
from memcalc.model.shape import Model
from memcalc.model.stacks import stack_for
from memcalc.model.tricks import parse_tricks
from memcalc.model.layout import Layout
from memcalc.verification.dist_tensors import param_tensors
from memcalc.verification.distributed import check_dist

torch = pytest.importorskip("torch")
from verify.distributed import verify_distributed

FSDP2 = stack_for("fsdp2")
PHASES = ("between steps", "forward peak", "backward peak", "optimizer peak")


def shape_of(name: str, layers: int):
    return replace(PRESETS[name], n_layers=layers)


def check(name, layers, seq, tricks, layout, ranks=None):
    shape = shape_of(name, layers)
    result = verify_distributed(Model(shape, n_params(shape), "test"), Setup(seq, stack=FSDP2), parse_tricks(tricks),
                                layout, ranks=ranks)  # fmt: skip
    for rc in result.ranks:
        for r in rc.rows:
            if r.checked:
                assert r.unexplained_bytes == 0, (rc.rank, r.quantity, r.error_bytes, r.differences)
    assert result.passed
    return result


def rows(result, rank):
    return {r.quantity: r for rc in result.ranks if rc.rank == rank for r in rc.rows}


def named(row) -> dict[str, int]:
    return {d.name.split(":")[0].split(" (")[0]: d.value for d in row.differences}


# ---- the replay equals PyTorch's FSDP2 to the byte -------------------------------------------------


def test_llama3_8b_every_phase_exact_on_8_ranks():
    """Untied table, RMSNorm, flash: every phase as the replay predicts it, nothing to name."""
    result = check("llama3-8b", 2, 2048, "bf16,flash", Layout(dp=8, zero=3))
    for rank in (0, 7):
        r = rows(result, rank)
        for q in PHASES:
            assert r[q].measured_bytes == r[q].predicted_bytes and r[q].differences == (), (rank, q)
        # between steps: 16 bytes/param in fp32 over 8 (every dim 0 divides by 8), 4 per step counter, the ids
        assert r["between steps"].measured_bytes == 16 * n_params(shape_of("llama3-8b", 2)) // 8 + 4 * 21 + 8 * 2049
        assert r["optimizer peak"].measured_bytes == r["between steps"].measured_bytes  # fused: in place


def test_gpt2_tied_layernorm_eager_the_cpu_statistics_named():
    """Tied table ([table, final norm] one unit), learned positions (the root's), LayerNorm, dropout, eager
    attention; ranks 0 and 7 (the 50,257-row table pads to 6,283 rows a rank). The fake group runs CPU
    kernels: LayerNorm's mean and rstd in bf16, named at each peak (5 norms × 2 × 2 bytes × 512 tokens)."""
    result = check("gpt2", 2, 512, "bf16", Layout(dp=8, zero=3))
    for rank in (0, 7):
        r = rows(result, rank)
        for q in ("forward peak", "backward peak"):
            assert r[q].error_bytes == -5 * 2 * 2 * 512
            assert list(named(r[q])) == ["CPU LayerNorm keeps mean and rstd in 16 bits, not fp32"]
        assert r["between steps"].differences == ()


@pytest.mark.parametrize("name, tricks, layout, rank", [
    ("qwen3-0.6b", "bf16,selective", Layout(dp=64, zero=3), 63),  # tied, q/k norms; the last of 64 ranks
    ("llama3-8b", "bf16", Layout(dp=8, zero=3, reshard_after_forward=False), 0),  # --no-reshard: blocks stay gathered
    ("llama3-8b", "bf16,flash,ckpt", Layout(dp=8, zero=3, reshard_after_forward=True), 5),  # 'always'
    ("qwen3-0.6b", "fp32", Layout(dp=8, zero=3), 0),  # param_dtype fp32: no cast, no all-gather copy-in
    ("llama3-8b", "bf16,flash,sac", Layout(dp=8, zero=3), 0),  # torchtitan's per-op SAC: its kept outputs too
    ("qwen3-0.6b", "bf16,sac", Layout(dp=8, zero=3), 7),  # eager attention under SAC, tied table
])  # fmt: skip
def test_policies_and_precisions_exact(name, tricks, layout, rank):
    check(name, 3, 512, tricks, layout, ranks=(rank,))


def test_replay_alone_is_torch_free_and_follows_the_reshard_policy():
    """The replay's own numbers: --no-reshard keeps every block gathered from its forward to its backward."""
    shape = shape_of("llama3-8b", 4)
    params = [Param(t.name, t.dims) for t in param_tensors(shape)]
    default, _ = fsdp2_phases(shape, 1024, 1, parse_tricks("bf16,flash"), 8, None, 0, params)
    kept, _ = fsdp2_phases(shape, 1024, 1, parse_tricks("bf16,flash"), 8, False, 0, params)
    block, table = 2 * 218_112_000, 2 * 128256 * 4096  # one Llama-3-8B block and the token table, in bf16
    # at the loss: the default holds [norm, lm_head] only; 'never' also every block and the token table
    extra = kept.forward_parts["FSDP2 unsharded parameters"] - default.forward_parts["FSDP2 unsharded parameters"]
    assert extra == 4 * block + table


def test_units_are_torchtitans():
    llama = shape_of("llama3-8b", 2)
    params = [Param(t.name, t.dims) for t in param_tensors(llama)]
    units = units_for(llama, params, None)
    assert [u.name for u in units] == ["tok_emb", "norm, lm_head", "blocks.0", "blocks.1"]
    assert [u.reshard_after_forward for u in units] == [True, False, True, True]
    assert [u.reshard_after_forward for u in units_for(llama, params, None, pipelined=True)] == [False] * 4
    gpt2 = shape_of("gpt2", 2)
    units = units_for(gpt2, [Param(t.name, t.dims) for t in param_tensors(gpt2)], True)
    assert [u.name for u in units] == ["tok_emb, norm", "blocks.0", "blocks.1", "root"]  # root: the position table
    assert units[0].reshard_after_forward and not units[-1].reshard_after_forward


# ---- memcalc's fsdp2 engine against the same peak, every byte named -----------------------------------


def test_the_engine_row_names_every_byte():
    """estimate --stack fsdp2's per-GPU peak against PyTorch's: the state, the gradients zero_grad freed, FSDP2's
    buffers at the peak, the op-by-op activations against the textbook's, the ids: they add up to the byte."""
    result = check("llama3-8b", 2, 8192, "bf16,flash", Layout(dp=8, zero=3), ranks=(0,))
    row = rows(result, 0)["step peak, the fsdp2 engine"]
    parts = named(row)
    shape = shape_of("llama3-8b", 2)
    # the step peaks at the log-softmax backward: no sharded gradient is back yet, [norm, lm_head] is gathered
    # and the last block's all-gather (prefetched by [norm, lm_head]'s pre-backward) is in flight
    grads = 4 * n_params(shape) // 8
    assert parts["sharded gradients at the step's peak"] == -grads
    head, block = 128256 * 4096 + 4096, 218_112_000
    engine = 2 * 2 * block + 2 * head + 4 * head + 2 * head  # two blocks, the unit's grads, its RS input, the head
    assert parts["FSDP2's buffers at the step's peak"] == 2 * head + 2 * block - engine
    assert sum(parts.values()) == row.error_bytes


# ---- the command line ---------------------------------------------------------------------------------


FSDP2_CLI = ["verify", "--model", "qwen3-0.6b", "--layers", "2", "--seq", "256", "--stack", "fsdp2"]


def test_cli_table_says_the_reshard_policy():
    args = [*FSDP2_CLI, "--fsdp", "2", "--tricks", "bf16,flash", "--no-reshard"]
    table = CliRunner().invoke(app, args, env={"COLUMNS": "200"})
    assert table.exit_code == 0 and "reshard after forward: never" in table.stdout and "Pass" in table.stdout


@pytest.mark.slow("test_policies_and_precisions_exact (each trick set on FSDP2), test_cli_table_says_the_reshard_policy "
                  "and tests/test_gpu_matrix.py's --matrix --save")  # fmt: skip
def test_cli_matrix_and_save(tmp_path):
    out = CliRunner().invoke(app, [*FSDP2_CLI, "--fsdp", "8", "--matrix", "--save", str(tmp_path), "--format", "json"])
    assert out.exit_code == 0, out.output
    data = json.loads(out.stdout)
    assert [d["tricks"] for d in data] == [["fp32"], ["bf16"], ["bf16", "flash"], ["bf16", "flash", "ckpt"],
                                           ["bf16", "selective"], ["bf16", "flash", "selective"], ["bf16", "ckpt"]]  # fmt: skip
    saved = sorted(p.name for p in tmp_path.iterdir())
    assert saved[0] == "01-fp32.json" and len(saved) == 7
    assert json.loads((tmp_path / saved[2]).read_text())["tricks"] == ["bf16", "flash"]


@pytest.mark.parametrize("args, message", [
    (["--fsdp", "8", "--save", "x"], "add --matrix"),
    (["--fsdp", "8", "--reshard"], "add --stack fsdp2"),
    (["--reshard", "--stack", "fsdp2"], "add --fsdp N --stack fsdp2"),
    (["--tp", "2", "--stack", "fsdp2"], "N > 1"),
    (["--fsdp", "2", "--stack", "fsdp2", "--dist-device", "cpu-gloo"], "--dist-device meta"),
])  # fmt: skip
def test_cli_refusals(args, message):
    out = CliRunner().invoke(app, ["verify", "--model", "qwen3-0.6b", "--layers", "2", "--seq", "256", *args])
    assert out.exit_code == 2 and message in out.stderr, out.output


def test_reshard_always_with_a_tied_table_is_refused():
    with pytest.raises(InputError, match="drop --reshard"):
        check_dist(PRESETS["gpt2"], Setup(256, stack=FSDP2), parse_tricks("bf16"),
                   Layout(dp=8, zero=3, reshard_after_forward=True), "meta")  # fmt: skip
