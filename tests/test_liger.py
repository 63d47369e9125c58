"""Liger's kernels as the Trainer applies them (use_liger_kernel=True, issue 40): memcalc.exact.hf.liger's replay
equals liger-kernel 0.8.5's own autograd Functions over Transformers' classes (apply_liger_kernel, as Trainer.train
calls it), their Triton launches skipped (the kernels write into what their Python wrappers allocated), allocation
by allocation on meta at tiny size, under the Trainer's autocast on CPU tensors, and phase by phase (FLOPs too) at
8B width. The device's part (RMSNorm's rows per SM, the logits buffer, the head's gradient in place) follows the
GPU table; what the replay does not have is refused in one line.
"""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from memcalc.errors import InputError
from memcalc.model.gpus import GPUS
from memcalc.model.savers import ON_META, Liger, Savers, liger_for
from memcalc.model.stacks import stack_for
from memcalc.model.tricks import parse_tricks

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("peft")
pytest.importorskip("liger_kernel")

from memcalc.exact.replay.meta import simulate  # noqa: E402
from memcalc.model.presets import PRESETS  # noqa: E402
from tests.replay import assert_equal_at_width, assert_same_step  # noqa: E402
from tests.test_lora import LORA, MASTER, PURE, QLORA, TRAINER, step_config  # noqa: E402
from tests.test_lora_families import SHAPES as FAMILIES  # noqa: E402
from tests.test_stack_hf import TINY  # noqa: E402
from verify.autocast import measure_cpu  # noqa: E402
from verify.meta import measure_step  # noqa: E402

LIGER = Savers(liger=ON_META)


def with_liger(stack, finetune=None):
    stack = replace(stack, savers=LIGER)
    return stack if finetune is None else replace(stack, finetune=finetune)


@pytest.mark.parametrize("name,tricks,stack,batch", [
    ("llama", "bf16,flash", with_liger(MASTER, LORA), 2),  # the cache's k copy through RoPE's backward
    ("llama", "bf16", with_liger(MASTER, LORA), 2),  # eager: q's and k's gradients copied by RoPE's transpose
    ("llama", "bf16,flash,ckpt", with_liger(MASTER, LORA), 2),  # a recomputed SwiGLU node that never runs
    ("qwen3", "bf16,flash,ckpt", with_liger(MASTER, LORA), 2),  # LigerRMSNorm on q_norm and k_norm
    ("qwen2", "bf16,selective", with_liger(MASTER, LORA), 2),
    ("llama", "bf16,flash", with_liger(PURE), 2),  # norms and head train: RMSNorm's partials, grad_weight
    ("qwen3", "bf16,flash", with_liger(PURE), 1),
    ("qwen2", "bf16,flash,ckpt", with_liger(PURE), 2),
    ("llama-mha-tied", "bf16,flash", with_liger(PURE), 2),  # the tied head's gradient into the table's
    ("qwen3-mqa-wide-heads", "bf16,flash", with_liger(MASTER, LORA), 2),  # one KV head: no copy
    ("llama", "fp32", with_liger(PURE), 2),  # fp32: the head's gradient by mm (fp32 already: no copy)
    ("llama", "bf16,flash", replace(with_liger(PURE), use_cache=False), 2),
    ("llama", "bf16,flash,ckpt", with_liger(MASTER, QLORA), 1),  # bitsandbytes' 4-bit base
    ("gemma", "bf16,flash", with_liger(MASTER, LORA), 2),  # LigerRMSNormForGemma, LigerGEGLUMLP
    ("gemma", "bf16,flash,ckpt", with_liger(PURE), 2),
    ("gemma2", "bf16,ckpt", with_liger(MASTER, LORA), 2),  # its norms not in place: dX into zeros_like(dY)
    ("gemma2", "bf16", with_liger(PURE), 2),  # eager attention (its softcap), the head's softcap in the kernel
])  # fmt: skip
def test_liger_allocation_by_allocation(name, tricks, stack, batch):
    shape = TINY[name] if name in TINY else FAMILIES[name]
    phases, g, mem = simulate(step_config(shape, 24, batch, tricks, stack), timeline=True)
    step, live = measure_step(shape, 24, batch, parse_tricks(tricks), timeline=True, stack=stack,
                              count_flops=False)  # fmt: skip
    assert_same_step(phases, g, mem, step, live, tricks)


@pytest.mark.parametrize("tricks", ["bf16,flash", "bf16,ckpt"])
def test_liger_under_the_trainers_autocast(tricks):
    """bf16=True over a LoRA model's bf16 base on CPU tensors: Liger's Functions see 16-bit tensors, so autocast
    casts nothing of theirs and the logits buffer is made once (CPU's flash kernel lays its gradients out (B, T, n,
    d): no copy through RoPE's transpose)."""
    stack, shape = with_liger(TRAINER, LORA), TINY["llama"]
    phases, g, mem = simulate(step_config(shape, 24, 2, tricks, stack, device="cpu"), timeline=True)
    step, live, _ = measure_cpu(shape, 24, 2, parse_tricks(tricks), 1, True, stack)
    assert_same_step(phases, g, mem, step, live, tricks)


@pytest.mark.parametrize("stack,tricks", [(with_liger(PURE, LORA), "bf16,flash"),
                                          (with_liger(PURE), "bf16,flash,ckpt")])  # fmt: skip
def test_liger_at_8b_width(stack, tricks):
    """Llama-3.1-8B two blocks deep at seq 256: the phases, the saved bytes and the FLOPs (the fused cross-entropy's
    three matmuls a chunk of 8 rows, in forward)."""
    assert_equal_at_width(replace(PRESETS["llama3.1-8b"], n_layers=2), 256, parse_tricks(tricks), stack)


def test_the_device_part_follows_the_gpu_table():
    """RMSNorm's partial gradients: one fp32 row per SM; the logits buffer on CUDA, not ROCm; the head's gradient
    in place from compute capability 8 (V100: a product and its fp32 copy a chunk)."""
    assert liger_for(GPUS["h100-sxm"]) == Liger(132, mm_out=True, addmm=True)
    assert liger_for(GPUS["v100-32gb"]) == Liger(GPUS["v100-32gb"].sms, mm_out=True, addmm=False)
    assert liger_for(GPUS["mi300x"]) == Liger(GPUS["mi300x"].sms, mm_out=False, addmm=True)
    with pytest.raises(InputError, match="SM count is not known"):
        liger_for(replace(GPUS["h100-sxm"], sms=0))
    with pytest.raises(InputError, match="names none"):  # a --gpu file's arch is any string
        liger_for(replace(GPUS["h100-sxm"], arch="hopper"))
    assert liger_for(GPUS["t4"]).addmm is False and liger_for(GPUS["b200"]).addmm is True  # sm75, sm100


def test_each_device_part_is_where_the_source_puts_it():
    """Full fine-tuning of the tiny Llama (hidden 64, vocab 200) at 128 tokens: chunks of
    next_power_of_2(cdiv(128, cdiv(200, 64))) = 32 rows, 4 of them. RMSNorm's partials have a row per SM (three
    norms train in the block and the final one); mm_out makes one (32, 200) bf16 buffer, else each chunk's logits
    are a new tensor; without addmm each chunk adds a (200, 64) bf16 product and its fp32 copy."""
    shape, stack = replace(TINY["llama"], n_layers=1), with_liger(PURE)

    def allocations(liger, phase):
        s = replace(stack, savers=Savers(liger=liger))
        _, _, mem = simulate(step_config(shape, 64, 2, "bf16,flash", s), timeline=True)
        return [(op, d) for p, op, d, _ in mem.timeline if d > 0 and p == phase]

    cuda = allocations(Liger(132), "forward")
    assert allocations(Liger(132), "backward").count(("empty", 132 * 64 * 4)) == 3
    assert allocations(Liger(1), "backward").count(("empty", 64 * 4)) == 3
    logits = 32 * 200 * 2
    assert cuda.count(("empty", logits)) == 1 and cuda.count(("mm", logits)) == 0
    no_buffer = allocations(Liger(132, mm_out=False), "forward")
    assert no_buffer.count(("empty", logits)) == 0 and no_buffer.count(("mm", logits)) == 4
    no_addmm = allocations(Liger(132, addmm=False), "forward")
    assert (cuda.count(("mm", 200 * 64 * 2)), no_addmm.count(("mm", 200 * 64 * 2))) == (0, 4)
    assert no_addmm.count(("_to_copy", 200 * 64 * 4)) == 4


def run(*args):
    from typer.testing import CliRunner

    from memcalc.cli import app

    return CliRunner().invoke(app, list(args), env={"COLUMNS": "200", "NO_COLOR": "1"})


@pytest.mark.parametrize("args,message", [
    (("--model", "phi3-mini", "--lora", "8"), "Liger's patching of phi3 is not replayed"),
    (("--model", "gemma3-4b", "--lora", "8"), "Gemma 3: its q_norm and k_norm"),
    (("--stack", "trl:0.25", "--lora", "8", "--quantize", "nf4"), "TRL's k-bit preparation"),
    (("--stack", "torchtune", "--lora", "8"), "not --stack torchtune"),
    ((), "not --stack reference"),
    (("--stack", "hf"), "autocast over fp32 weights"),
    (("--stack", "hf", "--lora", "8", "--tricks", "bf16,ckpt", "--offload-activations"), "--offload-activations"),
    (("--lora", "8", "--lora-targets", "q_proj,lm_head"), "LoRA on lm_head"),
    (("--lora", "8", "--gpu", "CARD"), "SM count is not known"),  # a --gpu file without sms
    (("--lora", "8", "--gpus", "2", "--zero", "3"), "ZeRO 0-2"),  # lce_forward reads lm_head.weight itself
])  # fmt: skip
def test_what_the_replay_lacks_is_refused_in_one_line(args, message, tmp_path):
    card = tmp_path / "card.json"
    card.write_text('{"name": "a card", "memory_mib": 24576, "bf16_tflops": 100}')
    base = ("--model", "llama3-8b") if "--model" not in args else ()
    out = run("estimate", *base, "--seq", "2048", "--liger", *(str(card) if a == "CARD" else a for a in args))
    assert out.exit_code == 2 and message in out.output and len(out.output.strip().splitlines()) == 1, out.output


LIGER_8B = ("--model", "llama3.1-8b", "--lora", "16", "--tricks", "bf16,flash,ckpt", "--gpu", "rtx4090")


def test_liger_lowers_the_lora_peak():
    """Llama-3.1-8B LoRA r16 under the Trainer on a 24 GB card: no logits in fp32 (the fused cross-entropy) and
    RMSNorm's saved input in place of its fp32 copies: the peak falls, and the notes say which kernels the verdict
    assumes."""
    peaks = [json.loads(run("estimate", *LIGER_8B, "--seq", "4096", *extra, "--format", "json").output)["verdict"][0]
             ["peak_bytes"] for extra in ((), ("--liger",))]  # fmt: skip
    assert peaks[1] < peaks[0] * 0.85
    text = " ".join(run("estimate", *LIGER_8B, "--seq", "4096", "--liger").output.split())
    assert "Liger kernels" in text and "Liger's kernels (TrainingArguments(use_liger_kernel=True)" in text


@pytest.mark.slow("test_liger_lowers_the_lora_peak (the verdict fit searches with)")
def test_liger_fit_gives_a_longer_sequence():
    """The same card: the longest sequence that fits grows threefold (docs/finetune.md: "three times longer")."""
    fits = [json.loads(run("fit", *LIGER_8B, *extra, "--format", "json").output)["max_seq_len"]
            for extra in ((), ("--liger",))]  # fmt: skip
    assert fits[1] >= 3 * fits[0]


@pytest.mark.parametrize("line,tricks,device", [("0.25", "bf16,flash", "meta"), ("0.21", "bf16,flash,ckpt", "meta"),
                                                ("0.25", "bf16,ckpt", "cpu")])  # fmt: skip
def test_liger_under_trls_sfttrainer(line, tricks, device):
    """TRL 0.15-0.25's compute_loss computes its entropy and token accuracy from the logits only without
    use_liger_kernel ("liger doesn't return logits"): under Liger it adds nothing to the Trainer's step but 0.22's
    use_cache=False. LoRA on meta (--recipe pure) and on CPU tensors under the Trainer's autocast (bf16=True)."""
    stack, shape = replace(stack_for(f"trl:{line}", recipe="pure" if device == "meta" else None), savers=LIGER,
                           finetune=LORA), TINY["llama"]  # fmt: skip
    phases, g, mem = simulate(step_config(shape, 24, 2, tricks, stack, device="cuda" if device == "meta" else "cpu"),
                              timeline=True)  # fmt: skip
    if device == "meta":
        step, live = measure_step(shape, 24, 2, parse_tricks(tricks), timeline=True, stack=stack, count_flops=False)
    else:
        step, live, _ = measure_cpu(shape, 24, 2, parse_tricks(tricks), 1, True, stack)
    assert_same_step(phases, g, mem, step, live, tricks)


def test_a_trainer_file_with_use_liger_kernel(tmp_path):
    """--from a TrainingArguments file: use_liger_kernel is --liger on the Trainer's stack, said so in the table of
    keys; with a key of SFTConfig on TRL's, which then computes no metrics."""
    args = {"model_name_or_path": "llama3.1-8b", "per_device_train_batch_size": 1, "dtype": "bfloat16",
            "gradient_checkpointing": True, "use_liger_kernel": True}  # fmt: skip
    path = tmp_path / "args.json"
    path.write_text(json.dumps(args))
    out = run("estimate", "--from", str(path), "--seq", "2048", "--gpu", "h100-sxm")
    assert out.exit_code == 0, out.output
    assert "--liger: Liger's RoPE" in out.output and "hf (pure, Liger kernels)" in " ".join(out.output.split())
    path.write_text(json.dumps(args | {"max_length": 2048}))
    out = run("estimate", "--from", str(path), "--gpu", "h100-sxm")
    assert out.exit_code == 0 and "trl:0.25 (pure, Liger kernels)" in " ".join(out.output.split()), out.output
    assert "TRL 0.22-0.25's SFTTrainer: the Trainer's step as it is" in " ".join(out.output.split())
