"""TRL's SFTTrainer (--stack trl:0.14, trl:0.21, trl:0.25): memcalc.exact.hf.trl's replay equals the step as each
release line runs it (verify/trl.py: peft's own prepare_model_for_kbit_training, TRL's casting and compute_loss
metrics as each release writes them, over Transformers, PEFT and bitsandbytes), on meta allocation by allocation
and on real CPU tensors under the Trainer's autocast; and what it does to QLoRA at 8B width.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("peft")
pytest.importorskip("bitsandbytes")

from memcalc.exact.hf.model import build as hf_build  # noqa: E402
from memcalc.exact.replay.meta import simulate  # noqa: E402
from memcalc.exact.sim.graph import Graph  # noqa: E402
from memcalc.exact.sim.tensors import LiveBytes  # noqa: E402
from memcalc.model.finetune import Finetune  # noqa: E402
from memcalc.model.presets import PRESETS  # noqa: E402
from memcalc.model.stacks import STACKS, trl_note  # noqa: E402
from memcalc.model.tricks import parse_tricks  # noqa: E402
from tests.replay import assert_equal_at_width, assert_same_step  # noqa: E402
from tests.test_lora import assert_meta, step_config  # noqa: E402
from tests.test_stack_hf import TINY  # noqa: E402
from verify.autocast import measure_cpu  # noqa: E402
from verify.hf import build_hf  # noqa: E402

QLORA = Finetune(4, quantize="nf4")


def trl(line: str, finetune: Finetune = QLORA, recipe: str | None = None):
    """The line's SFTTrainer with loss_type "nll" (the compute_loss metrics over the logits: from 1.7 the default,
    chunked_nll, has none: tests/test_trl_chunked.py)."""
    stack = replace(STACKS[f"trl:{line}"], finetune=finetune, loss="full")
    return replace(stack, recipe=recipe) if recipe else stack


def test_the_prepared_parameters_are_trl_s():
    """prepare_model_for_kbit_training leaves what is not 4-bit in fp32 (the norms, the embedding, the head); under
    bf16=True peft_module_casting_to_bf16 casts the embedding and head back: the replay builds the same dtypes."""
    shape, dtypes = TINY["llama"], {"bfloat16": "bf16", "float32": "fp32", "uint8": "uint8"}
    for recipe, bf16_args in (("pure", False), ("autocast", True)):
        model = build_hf(shape, parse_tricks("bf16"), 24, autocast="cpu" if bf16_args else None, finetune=QLORA,
                         trl="0.25", device="cpu" if bf16_args else "meta").model  # fmt: skip
        real = [dtypes[str(p.dtype).removeprefix("torch.")] for p in model.parameters()]
        sim = hf_build(Graph(LiveBytes()), step_config(shape, 24, 1, "bf16", trl("0.25", recipe=recipe)))
        assert real == [p.dtype for p in sim.p.values()], recipe
        head = sim.p["lm_head.weight"].dtype
        assert head == ("bf16" if bf16_args else "fp32") and sim.p["model.norm.weight"].dtype == "fp32"


@pytest.mark.parametrize("line,tricks,batch", [
    ("0.14", "bf16,flash,ckpt", 1), ("0.21", "bf16", 2), ("0.21", "bf16,ckpt", 2), ("0.25", "bf16,flash,ckpt", 1),
    ("0.25", "fp16", 2), ("1.2", "bf16,flash,ckpt", 1), ("1.2", "bf16", 2), ("1.5", "bf16", 2),
    ("1.5", "bf16,flash,ckpt", 1), ("1.13", "bf16", 2), ("1.13", "bf16,ckpt", 1), ("1.14", "bf16", 2),
    ("1.14", "bf16,flash,ckpt", 1),
])  # fmt: skip
def test_qlora_allocation_by_allocation(line, tricks, batch):
    """A bf16 model loaded in 4 bits without autocast (bf16=False): its fp32 norms make the residual stream and so
    q, k and v fp32 (a 4-bit layer returns its input's dtype), which SDPA's flash kernel does not take (the
    efficient kernel, or the math path for grouped heads); compute_loss's metrics from the logits, and at
    micro-batch 2 the shifted logits copied."""
    assert_meta(TINY["llama"], tricks, trl(line, recipe="pure"), batch=batch)


def test_lora_on_a_16_bit_base_is_prepared_not():
    """A 16-bit base is not prepared: TRL adds compute_loss's metrics alone."""
    assert_meta(TINY["qwen2"], "bf16,ckpt", trl("0.25", Finetune(4), recipe="pure"), batch=2)


@pytest.mark.parametrize("line,tricks", [("0.25", "bf16"), ("0.21", "bf16,ckpt"), ("0.14", "fp16"), ("1.2", "bf16"),
                                         ("1.5", "bf16"), ("1.13", "bf16,ckpt"), ("1.14", "bf16")])  # fmt: skip
def test_qlora_on_cpu_under_the_trainers_autocast(line, tricks):
    """bf16=True (or fp16=True): Accelerate's autocast over the prepared model, on real CPU tensors; in bf16
    peft_module_casting_to_bf16 has cast the embedding and head back."""
    stack, shape = trl(line), TINY["llama"]
    phases, g, mem = simulate(step_config(shape, 24, 2, tricks, stack, device="cpu"), timeline=True)
    step, live, recipe = measure_cpu(shape, 24, 2, parse_tricks(tricks), 1, True, stack)
    assert recipe.skipped == 0
    assert_same_step(phases, g, mem, step, live, tricks)


def test_qlora_at_8b_width():
    """TRL 0.25's QLoRA of Llama-3-8B's blocks at seq 2048, three deep, without autocast: every phase, the saved
    bytes and the FLOPs equal the libraries on meta."""
    shape, t = replace(PRESETS["llama3-8b"], n_layers=3), parse_tricks("bf16,flash,ckpt")
    assert_equal_at_width(shape, 2048, t, trl("0.25", Finetune(16, quantize="nf4"), recipe="pure"))


def test_trl_s_preparation_is_the_gap_the_plain_trainer_misses():
    """Llama-3-8B QLoRA r=16 at seq 2048, bf16=True with flash and no checkpointing: TRL's fp32 residual stream
    holds about a third more at the peak than the plain Trainer's step (issue 40 measured 27-35% more than
    memcalc predicted for the plain one), and the verdict says which preparation it assumes."""
    from memcalc.engine.answer import answer
    from memcalc.engine.job import Job
    from memcalc.memory.setup import Setup
    from memcalc.model.gpus import gpu
    from memcalc.model.presets import preset_model

    def peak(stack):
        job = Job(preset_model("llama3-8b"), Setup(seq_len=2048, stack=stack), gpu("a100-80gb"),
                  trick_sets=(parse_tricks("bf16,flash"),))  # fmt: skip
        return answer(job).verdicts[0].total_bytes

    qlora = Finetune(16, quantize="nf4")
    plain, prepared = peak(replace(STACKS["hf"], finetune=qlora)), peak(trl("0.25", qlora))
    assert 1.25 < prepared / plain < 1.45
    assert "prepare_model_for_kbit_training" in trl_note(trl("0.25")) and "token accuracy" in trl_note(trl("0.21"))
    assert "prepare" not in trl_note(trl("0.25", Finetune(16))) and trl_note(STACKS["hf"]) == ""


def test_from_0_26_a_4_bit_models_trainable_parameters_are_cast_to_bf16():
    """0.26-1.2 prepare nothing for k-bit training: they cast a 4-bit model's trainable parameters to bf16 after
    get_peft_model, DoRA's magnitudes too, which 1.15 leaves fp32 (#7268); the norms stay bf16. The replay builds the
    dtypes Transformers, PEFT and bitsandbytes build on CPU."""
    shape, dtypes = TINY["llama"], {"bfloat16": "bf16", "float32": "fp32", "uint8": "uint8"}
    dora = Finetune(4, quantize="nf4", dora=True)
    for line, magnitude in (("1.2", "bf16"), ("1.16", "fp32")):
        model = build_hf(shape, parse_tricks("bf16"), 24, finetune=dora, trl=line, device="cpu").model
        real = [(n, dtypes[str(p.dtype).removeprefix("torch.")]) for n, p in model.named_parameters()]
        sim = hf_build(Graph(LiveBytes()), step_config(shape, 24, 1, "bf16", trl(line, dora)))
        assert [d for _, d in real] == [p.dtype for p in sim.p.values()], line
        assert {d for n, d in real if "magnitude" in n} == {magnitude}
        assert {d for n, d in real if "lora_A" in n or "norm" in n} == {"bf16"}
    assert "cast to bf16" in trl_note(trl("1.2")) and "entropy" in trl_note(trl("1.2"))
    assert "prepare_model_for_kbit_training" not in trl_note(trl("1.2"))


@pytest.mark.parametrize("line,loss_type,loss", [("1.13", None, "chunked_nll"), ("1.13", "nll", "full"),
                                                  ("1.13", "chunked_nll", "chunked_nll"), ("1.6", None, "full"),
                                                  ("1.6", "chunked_nll", "chunked_nll"), ("0.25", "chunked_nll", None)])
def test_loss_type_from_a_file(tmp_path, line, loss_type, loss):
    """SFTConfig's loss_type as --loss: a file on 1.7-1.14 that leaves it out gets the default, chunked_nll, said
    against the key; nll and chunked_nll are used as given where the line runs them (1.6's default is nll); chunked_nll
    on a line without it is refused in one line."""
    import json

    from tests.test_cli import run

    args = {"model_name_or_path": "llama3.1-8b", "per_device_train_batch_size": 1, "max_length": 1024}
    path = tmp_path / "sft.json"
    path.write_text(json.dumps({**args, **({"loss_type": loss_type} if loss_type else {})}))
    out = run("estimate", "--from", str(path), "--stack", f"trl:{line}", "--gpu", "h100-sxm", "--format", "json")
    if loss is None:
        assert out.exit_code == 2 and "chunked_nll" in out.output and len(out.output.strip().splitlines()) == 1
        return
    assert out.exit_code == 0, out.output
    answer = json.loads(out.stdout)
    keys = {k["key"]: k for k in answer["from"]["keys"]}
    if loss_type or line == "1.13":
        assert keys["loss_type"]["use"] == ("default" if loss_type is None else "used"), keys["loss_type"]
    assert answer["setup"]["stack"]["loss"] == loss
