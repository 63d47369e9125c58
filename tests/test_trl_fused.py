"""TRL 1.15-1.16's SFTTrainer (--stack trl:1.16): its fused LM head (memcalc.exact.hf.fused_head) and its
compute_loss equal trl 1.16 itself (add_fused_lm_head, ChunkedLogProbFunction and SFTTrainer.compute_loss, run over
Transformers and PEFT: verify/trl.py) on meta allocation by allocation and on CPU tensors under the Trainer's autocast,
with what it does to a 4-bit model's adapters; and what the head saves at 8B width.
"""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from memcalc.errors import InputError
from memcalc.model.finetune import Finetune
from memcalc.model.stacks import STACKS, stack_for, trl_note
from memcalc.model.tricks import parse_tricks

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("peft")
pytest.importorskip("bitsandbytes")
pytest.importorskip("trl")

from memcalc.exact.hf.model import build as hf_build  # noqa: E402
from memcalc.exact.sim.graph import Graph  # noqa: E402
from memcalc.exact.sim.tensors import LiveBytes  # noqa: E402
from memcalc.model.presets import PRESETS  # noqa: E402
from memcalc.model.shape import ModelShape  # noqa: E402
from tests.replay import assert_equal_at_width, assert_watched_cpu, assert_watched_meta  # noqa: E402
from tests.test_lora import step_config  # noqa: E402
from tests.test_lora_families import SHAPES as FAMILIES  # noqa: E402
from tests.test_stack_hf import TINY  # noqa: E402
from verify.hf import build_hf  # noqa: E402

LORA, QLORA, FULL = Finetune(4), Finetune(4, quantize="nf4"), Finetune()
# vocabulary past one 32768-column tile, and more than 4096 positions: the Function's two loops go round
WIDE_VOCAB = ModelShape(n_layers=1, hidden=32, n_heads=2, n_kv_heads=1, ffn=64, gated_mlp=True, norm="rmsnorm",
                        positions="rope", vocab=40000, name="llama-wide-vocab", arch="llama")  # fmt: skip


def trl(finetune: Finetune = LORA, recipe: str | None = "pure"):
    stack = replace(STACKS["trl:1.16"], finetune=finetune)
    return replace(stack, recipe=recipe) if recipe else stack


@pytest.mark.parametrize("name,tricks,finetune,batch", [
    ("llama", "bf16", LORA, 2),  # the head frozen: the rows' gradient alone
    ("llama", "bf16,flash,ckpt", QLORA, 1),  # the adapters cast to bf16; the decoder called without the count
    ("llama", "bf16,selective", QLORA, 2),
    ("llama", "bf16", FULL, 2),  # the head trains: its fp32 accumulator, cast back to bf16
    ("llama", "fp32", FULL, 2),  # fp32 tiles: no casts back
    ("qwen3", "bf16,flash,ckpt", LORA, 2),
    ("llama-mha-tied", "bf16", FULL, 1),  # the tied table's gradient from the head and the embedding
])  # fmt: skip
def test_allocation_by_allocation(name, tricks, finetune, batch):
    assert_watched_meta(TINY[name], tricks, trl(finetune), batch=batch)


def test_gemma2_softcap_is_in_the_kernel():
    """Gemma 2's final_logit_softcapping goes into the Triton kernels: no tensor of its own."""
    assert_watched_meta(FAMILIES["gemma2"], "bf16,ckpt", trl(LORA), batch=2)


def test_both_loops_go_round():
    """40,000 columns (two vocabulary tiles, the second 7,232 wide in the same buffer) and 2 x 2,500 positions (two
    token chunks): the head's rows cast per tile where they differ, the buffer's rows min(N, 4096)."""
    assert_watched_meta(WIDE_VOCAB, "bf16", trl(FULL), batch=2, seq=2501)


@pytest.mark.parametrize("finetune,tricks", [(LORA, "bf16"), (FULL, "bf16,ckpt"), (QLORA, "bf16")])
def test_on_cpu_under_the_trainers_autocast(finetune, tricks):
    """bf16=True: Accelerate's autocast around the patched forward, on real CPU tensors. Full training loads fp32
    weights: the rows and each head tile are cast to bf16 for the mm, per chunk, and the rows' gradient comes back
    fp32 (no cast); LoRA's base is bf16."""
    assert_watched_cpu(TINY["llama"], trl(finetune, recipe=None), tricks)



def test_a_4_bit_models_adapters_are_bf16():
    """SFTTrainer from 0.26 casts a 4-bit model's trainable parameters to bf16 and prepares nothing else: the norms,
    embedding and head stay bf16 (0.25's prepare_model_for_kbit_training left them fp32)."""
    shape, dtypes = TINY["llama"], {"bfloat16": "bf16", "float32": "fp32", "uint8": "uint8"}
    model = build_hf(shape, parse_tricks("bf16"), 24, finetune=QLORA, trl="1.16").model
    real = [dtypes[str(p.dtype).removeprefix("torch.")] for p in model.parameters()]
    sim = hf_build(Graph(LiveBytes()), step_config(shape, 24, 1, "bf16", trl(QLORA)))
    assert real == [p.dtype for p in sim.p.values()]
    assert {p.dtype for p in sim.p.values() if p.requires_grad} == {"bf16"}
    assert sim.p["model.norm.weight"].dtype == "bf16"
    plain = hf_build(Graph(LiveBytes()), step_config(shape, 24, 1, "bf16", trl(LORA)))
    assert {p.dtype for p in plain.p.values() if p.requires_grad} == {"fp32"}  # a 16-bit base: PEFT's fp32 adapters


def test_at_8b_width():
    """Llama-3-8B's blocks, three deep, LoRA at seq 2048 with flash and ckpt, no autocast: every phase, the saved
    bytes (the head's rows, targets, log_z and entropy) and the FLOPs equal trl's on meta."""
    shape = replace(PRESETS["llama3-8b"], n_layers=3)
    assert_equal_at_width(shape, 2048, parse_tricks("bf16,flash,ckpt"), trl(Finetune(16)))


def quoted_fits() -> tuple[int, int]:
    """What docs/finetune.md quotes `memcalc fit` finding under TRL 1.16 and TRL 0.25."""
    import re
    from pathlib import Path

    page = " ".join((Path(__file__).parents[1] / "docs" / "finetune.md").read_text().split())
    quoted = re.search(r"finds ([\d,]+) tokens where TRL 0\.25 reaches ([\d,]+)", page)
    assert quoted
    fused, prepared = (int(x.replace(",", "")) for x in quoted.groups())
    return fused, prepared


QLORA_8B = ("--model", "llama3-8b", "--lora", "16", "--quantize", "nf4", "--tricks", "bf16,flash,ckpt", "--gpu",
            "rtx4090", "--format", "json")  # fmt: skip


def test_no_logits_is_the_gain():
    """Llama-3-8B QLoRA r=16 with bf16, flash and ckpt at 8,192 tokens: TRL 1.16's step holds no logits, 0.25's
    holds them in bf16 and fp32 at least (8,192 x 128,256 x 6 bytes, 6.3 GB) beside its loss's temporaries. And
    the note says which TRL it replays. (test_fit_finds_the_quoted_lengths: what that buys on a 24 GB card.)"""
    from tests.test_cli import run

    peaks = {stack: json.loads(run("estimate", *QLORA_8B[:-3], "h100-sxm", "--format", "json", "--stack", stack,
                                   "--seq", "8192").output)["verdict"][0]["peak_bytes"]
             for stack in ("trl:1.16", "trl:0.25")}  # fmt: skip
    assert peaks["trl:0.25"] - peaks["trl:1.16"] > 8192 * 128_256 * 6
    note = trl_note(trl(Finetune(16, quantize="nf4")))
    assert "1.15-1.16" in note and "bf16" in note and "fused" in note


@pytest.mark.slow("test_no_logits_is_the_gain (the peaks at one length)")
def test_fit_finds_the_quoted_lengths():
    """On a 24 GB card the longest sequence that fits under 1.16 is several times 0.25's. docs/finetune.md quotes
    what `memcalc fit` finds for each: 1.16's is fit's answer; 0.25's is held as estimate's verdict either side of
    it (fits at the number, not one token more), two replays where a search takes some twenty."""
    from tests.test_cli import run

    fused, prepared = quoted_fits()
    assert json.loads(run("fit", *QLORA_8B, "--stack", "trl:1.16").output)["max_seq_len"] == fused
    for seq, fits in ((prepared, True), (prepared + 1, False)):
        assert json.loads(run("estimate", *QLORA_8B, "--stack", "trl:0.25", "--seq", str(seq)).output)["verdict"][0][
            "fits"] is fits, seq  # fmt: skip
    assert fused > 4 * prepared


def test_refused():
    """What the replay does not run on this line, in one line each: TRL's activation offloading (replayed for
    0.22-0.25), LoRA on the head (read outside its module), ZeRO-3's gather of it. (Liger's layer kernels beside the
    fused head: tests/test_dpo.py test_liger_beside_the_fused_head.)"""
    with pytest.raises(InputError, match="0.22-0.25"):
        stack_for("trl:1.16", offload=True)
    from tests.test_cli import run

    for args, why in ((("--lora-targets", "q,v,lm_head"), "lm_head.weight outside"),
                      (("--gpus", "8", "--zero", "3", "--gpu", "h100-sxm"), "ZeRO 0-2")):  # fmt: skip
        out = run("estimate", "--model", "llama3-8b", "--lora", "16", "--stack", "trl:1.16", "--seq", "1024", *args)
        assert out.exit_code == 2 and why in out.output and len(out.output.strip().splitlines()) == 1, out.output
