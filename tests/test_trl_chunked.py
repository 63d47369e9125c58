"""TRL 1.4-1.14's loss_type "chunked_nll" (SFTConfig's default from 1.7; --stack trl:1.7 to trl:1.14, --loss
chunked_nll on trl:1.6): memcalc.exact.hf.chunked_nll equals the releases' _chunked_cross_entropy_loss and _chunk
(written out in verify/trl_chunked.py as the trl 1.6.0 to 1.14.2 wheels have them, over Transformers and PEFT) on
meta allocation by allocation and on CPU tensors under the Trainer's autocast; at 8B width with the FLOPs; and what the
releases' fp32 copy of the head costs beside 1.13's.
"""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from memcalc.errors import InputError
from memcalc.model.finetune import Finetune
from memcalc.model.stacks import STACKS, stack_for, trl_note, with_loop
from memcalc.model.tricks import parse_tricks

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("peft")
pytest.importorskip("bitsandbytes")

from memcalc.model.presets import PRESETS  # noqa: E402
from tests.replay import assert_equal_at_width, assert_watched_cpu, assert_watched_meta  # noqa: E402
from tests.test_cli import run  # noqa: E402
from tests.test_lora_families import SHAPES as FAMILIES  # noqa: E402
from tests.test_stack_hf import TINY  # noqa: E402

LORA, QLORA, FULL = Finetune(4), Finetune(4, quantize="nf4"), Finetune()


def trl(line: str, finetune: Finetune = QLORA, recipe: str | None = "pure"):
    stack = replace(STACKS[f"trl:{line}"], finetune=finetune, loss="chunked_nll")
    return replace(stack, recipe=recipe) if recipe else stack


@pytest.mark.parametrize("line,name,tricks,finetune,batch", [
    ("1.6", "llama", "bf16,ckpt", LORA, 2),  # 1.4-1.7: the labelled rows kept by a boolean index, the head in fp32
    ("1.7", "llama", "bf16", QLORA, 2),
    ("1.10", "llama", "bf16", QLORA, 2),  # 1.8-1.10: every row ordered by the mask, the count tested against 0
    ("1.10", "llama", "bf16", FULL, 2),  # the head trains: its gradient through the fp32 copy, per chunk
    ("1.12", "llama", "bf16,flash,ckpt", QLORA, 1),  # 1.11-1.12: the chunk count clamped
    ("1.12", "llama-mha-tied", "bf16", FULL, 1),  # the tied table's gradient from the chunks and the embedding
    ("1.13", "llama", "bf16", QLORA, 2),  # 1.13-1.14: the matmul in the rows' dtype, the logits upcast after
    ("1.13", "llama", "fp32", FULL, 2),
    ("1.14", "qwen3", "bf16,flash,ckpt", LORA, 2),
])  # fmt: skip
def test_allocation_by_allocation(line, name, tricks, finetune, batch):
    assert_watched_meta(TINY[name], tricks, trl(line, finetune), batch=batch)


@pytest.mark.parametrize("line", ["1.12", "1.13"])
def test_gemma2_softcap_per_chunk(line):
    """Gemma 2's final_logit_softcapping on each chunk's logits (bf16 up to 1.12 without autocast's cast, fp32
    from 1.13), over its tied head."""
    assert_watched_meta(FAMILIES["gemma2"], "bf16,ckpt", trl(line, LORA), batch=2)


@pytest.mark.parametrize("line", ["1.7", "1.13"])
def test_two_chunks(line):
    """2 x 199 positions: two chunks, the second 142 rows; the loss, counts and entropies summed across them, and
    in backward each chunk's slice gradient accumulated into the rows'."""
    assert_watched_meta(TINY["llama"], "bf16,ckpt", trl(line), batch=2, seq=200)


@pytest.mark.parametrize("line,finetune,tricks", [("1.10", LORA, "bf16"), ("1.13", FULL, "bf16,ckpt"),
                                                  ("1.7", QLORA, "bf16"), ("1.13", QLORA, "bf16")])  # fmt: skip
def test_on_cpu_under_the_trainers_autocast(line, finetune, tricks):
    """bf16=True: Accelerate's autocast around the patched forward, on real CPU tensors. Up to 1.12 the fp32 copies
    of the rows and the head are cast back to bf16 for the matmul, per chunk; full training's fp32 head is cast per
    chunk too (a view's cast is not cached)."""
    assert_watched_cpu(TINY["llama"], trl(line, finetune, recipe=None), tricks)


def test_at_8b_width():
    """Llama-3-8B's blocks, three deep, QLoRA at seq 2048 with flash and ckpt, no autocast, 1.10's chunks (eight,
    each copying the 128,256-row head to fp32): every phase, the saved bytes and the FLOPs equal the release's on
    meta."""
    shape = replace(PRESETS["llama3-8b"], n_layers=3)
    assert_equal_at_width(shape, 2048, parse_tricks("bf16,flash,ckpt"), trl("1.10", Finetune(16, quantize="nf4")))


def peak(line: str, loss: str | None = None) -> int:
    args = ("--model", "llama3-8b", "--seq", "2048", "--lora", "16", "--quantize", "nf4", "--tricks", "bf16,flash",
            "--gpu", "a100-80gb", "--micro-batch", "2", "--format", "json", "--stack", f"trl:{line}")  # fmt: skip
    out = run("estimate", *args, *(("--loss", loss) if loss else ()))
    assert out.exit_code == 0, out.output
    return json.loads(out.output)["verdict"][0]["total_bytes"]


def test_the_default_loss_and_what_it_saves():
    """Llama-3-8B QLoRA r16 at seq 2048, micro-batch 2, bf16 and flash: 1.7-1.14 default to chunked_nll, which holds
    no logits; up to 1.12 each chunk copies the bf16 head to fp32 (2.1 GB) and autocast casts it back (1.05 GB), so
    1.13's peak is lower by about those; --loss nll is the cross-entropy over the logits, higher than both."""
    assert STACKS["trl:1.13"].loss == "chunked_nll" and STACKS["trl:1.6"].loss == "full"
    head = 128256 * 4096
    nll, fp32_chunks, chunks = peak("1.13", "nll"), peak("1.12"), peak("1.13")
    assert nll > fp32_chunks > chunks
    assert 4 * head <= fp32_chunks - chunks <= 6 * head
    assert peak("1.6") == nll and peak("1.6", "chunked_nll") == peak("1.7")
    assert "256 positions" in trl_note(trl("1.12")) and "fp32" in trl_note(trl("1.12"))
    assert "fp32" not in trl_note(trl("1.13")) and "chunked_nll" in trl_note(replace(trl("1.13"), loss="full"))


def test_refused():
    """chunked_nll where no release of the line runs it (1.3, and from 1.15: the fused head), with LoRA on the head
    (SFTTrainer refuses it), and where the head is sharded (FSDP2's full_tensor, ZeRO-3's gather)."""
    for key in ("trl:1.5", "trl:1.16", "hf", "torchtune"):
        with pytest.raises(InputError, match="chunked_nll"):
            with_loop(stack_for(key), "chunked_nll")
    for args, why in ((("--lora-targets", "q,v,lm_head"), "chunked_nll"),
                      (("--gpus", "8", "--zero", "3", "--gpu", "h100-sxm"), "ZeRO 0-2")):  # fmt: skip
        out = run("estimate", "--model", "llama3-8b", "--lora", "16", "--stack", "trl:1.13", "--seq", "1024", *args)
        assert out.exit_code == 2 and why in out.output and len(out.output.strip().splitlines()) == 1, out.output
