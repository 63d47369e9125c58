"""LoRA and frozen weights on the hf stack: memcalc.exact.hf.lora's replay equals PEFT's LoRA (peft 0.21) on
Transformers' own classes, measured on meta allocation by allocation at tiny size and phase by phase at 8B width
three blocks deep, and on real CPU tensors under the Trainer's autocast.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("peft")

from memcalc.errors import InputError  # noqa: E402
from memcalc.exact.base.config import StepConfig  # noqa: E402
from memcalc.exact.hf.model import build as hf_build  # noqa: E402
from memcalc.exact.replay.meta import simulate  # noqa: E402
from memcalc.exact.sim.graph import Graph  # noqa: E402
from memcalc.exact.step import exact_step  # noqa: E402
from memcalc.exact.sim.tensors import LiveBytes  # noqa: E402
from memcalc.model.finetune import Finetune, adapter_params, finetune_for  # noqa: E402
from memcalc.model.presets import PRESETS  # noqa: E402
from memcalc.model.stacks import stack_for  # noqa: E402
from memcalc.model.tricks import parse_tricks  # noqa: E402
from tests.replay import FIELDS, assert_equal_at_width, assert_same_step  # noqa: E402
from tests.test_stack_hf import TINY  # noqa: E402
from verify.autocast import measure_cpu  # noqa: E402
from verify.hf import build_hf  # noqa: E402
from verify.meta import measure_step  # noqa: E402

LORA = Finetune(4)
DORA = Finetune(4, dora=True)
SAVED = Finetune(4, ("q_proj", "v_proj"), modules_to_save=("embed_tokens", "lm_head"))  # PEFT's modules_to_save
MASTER = stack_for("hf", recipe="master", impl="reference")  # the tests' hf recipe (tests/test_stack_hf.py)
PURE = stack_for("hf", recipe="pure", impl="fused")  # a bf16 model trained without autocast by fused AdamW
TRAINER = stack_for("hf")  # the Trainer: bf16=True autocasts, adamw_torch_fused


def step_config(shape, seq: int, batch: int, tricks: str, stack, device: str = "cuda") -> StepConfig:
    t = parse_tricks(tricks)
    return StepConfig(shape, seq, batch, replace(t, ckpt_every=1, fp8="", compile=False), replace(stack, model="hf"),
                      device=device)  # fmt: skip


def assert_cpu(finetune: Finetune, tricks: str) -> None:
    """The Trainer's step (bf16=True: Accelerate's autocast) with this fine-tuning on real CPU tensors, batch 2:
    every phase, the saved bytes and every allocation equal the replay's for device cpu."""
    stack, shape = replace(TRAINER, finetune=finetune), TINY["llama"]
    phases, g, mem = simulate(step_config(shape, 24, 2, tricks, stack, device="cpu"), timeline=True)
    step, live, recipe = measure_cpu(shape, 24, 2, parse_tricks(tricks), 1, True, stack)
    assert recipe.skipped == 0
    assert_same_step(phases, g, mem, step, live, tricks)


def assert_meta(shape, tricks: str, stack, batch: int = 1, seq: int = 24) -> None:
    """Every phase, the saved bytes and every allocation with the live bytes at it, against PEFT on meta."""
    phases, g, mem = simulate(step_config(shape, seq, batch, tricks, stack), timeline=True)
    step, live = measure_step(shape, seq, batch, parse_tricks(tricks), timeline=True, stack=stack, count_flops=False)
    assert_same_step(phases, g, mem, step, live, tricks)


@pytest.mark.parametrize("name,ft", [("llama", LORA), ("qwen3", LORA), ("qwen2", LORA), ("llama", DORA),
                                     ("llama", SAVED)])  # fmt: skip
def test_peft_parameters_as_peft_registers_them(name, ft):
    """named_parameters() of get_peft_model's model: names (less PEFT's prefixes), shapes, dtypes (the base in
    bf16, the adapters upcast to fp32, DoRA's magnitudes too) and which train, as the replay builds them; the
    adapters' count."""
    shape, stack = TINY[name], replace(MASTER, finetune=ft)
    model = build_hf(shape, parse_tricks("bf16"), 24, finetune=ft).model
    real = [(n.removeprefix("base_model.model.").replace(".base_layer", "").replace(".default", "")
             .replace(".modules_to_save", ""), tuple(p.shape), str(p.dtype).removeprefix("torch."), p.requires_grad)
            for n, p in model.named_parameters()]  # fmt: skip
    g = Graph(LiveBytes())
    sim = hf_build(g, step_config(shape, 24, 1, "bf16", stack))
    dtypes = {"bfloat16": "bf16", "float32": "fp32"}
    assert [(n, s, dtypes[d], r) for n, s, d, r in real] == [(p.name, p.shape, p.dtype, p.requires_grad)
                                                             for p in sim.p.values()]  # fmt: skip
    assert sum(p.numel() for p in model.parameters() if p.requires_grad) == adapter_params(shape, ft)


@pytest.mark.parametrize("name,tricks", [("llama", t) for t in ("bf16", "fp32", "fp16", "bf16,flash,ckpt",
                                                                 "bf16,selective")]
                         + [("qwen3", "bf16,flash"), ("qwen2", "bf16,flash,ckpt")])  # fmt: skip
def test_lora_allocation_by_allocation(name, tricks):
    """No ckpt: the first block's input needs no gradient, so its norm and base projections save nothing; with
    ckpt the embedding's output is made to require grad (enable_input_require_grads), a leaf whose .grad dies
    with the graph."""
    assert_meta(TINY[name], tricks, replace(MASTER, finetune=LORA))


@pytest.mark.parametrize("tricks", ["bf16", "bf16,flash,ckpt"])
def test_lora_dropout_and_targets(tricks):
    """lora_dropout > 0: nn.Dropout on the adapters' fp32 input saves its mask; q and v alone wrapped."""
    ft = Finetune(8, ("q_proj", "v_proj"), 0.1)
    assert_meta(TINY["qwen2"], tricks, replace(PURE, finetune=ft), batch=2)


@pytest.mark.parametrize("name,tricks,stack,ft,batch", [
    ("llama", "bf16", PURE, DORA, 1), ("llama", "bf16,flash,ckpt", PURE, DORA, 1), ("llama", "fp32", MASTER, DORA, 1),
    ("llama", "bf16", MASTER, Finetune(4, ("q_proj", "v_proj", "lm_head"), dora=True), 1),
    ("qwen2", "bf16", PURE, Finetune(8, ("q_proj", "v_proj"), 0.1, dora=True), 2),
    ("qwen2", "bf16,flash,ckpt", PURE, Finetune(8, ("q_proj", "v_proj"), 0.1, dora=True), 2)])  # fmt: skip
def test_dora_allocation_by_allocation(name, tricks, stack, ft, batch):
    """PEFT's DoRA (use_dora=True): each forward builds lora_weight through an identity (held to the layer's
    return), casts the base weight to fp32 and takes its row norm; with lora_dropout the base result is
    recomputed from the dropped input, saving the fp32 weight copy; qwen2's biases are subtracted first. Under
    ckpt the recompute packs what dead nodes saved and lets it go (torch's dead _Holder)."""
    assert_meta(TINY[name], tricks, replace(stack, finetune=ft), batch=batch)


def test_dora_under_the_trainers_autocast_on_cpu():
    """DoRA in the Trainer's bf16 autocast on real CPU tensors, gradient checkpointing and dropout on."""
    assert_cpu(Finetune(4, lora_dropout=0.05, dora=True), "bf16,ckpt")


def test_dora_trainable_count_is_peft_method_comparisons():
    """huggingface/peft method_comparison/MetaMathQA results/lora--llama-3.2-3B-rank32-dora.json:
    num_trainable_params 9,289,728 (r 32 on q and v: LoRA's 9,175,040 and a magnitude per output, 28 x 4,096)."""
    shape = PRESETS["llama3.2-3b"]
    assert adapter_params(shape, Finetune(32, ("q_proj", "v_proj"), dora=True)) == 9_289_728
    assert adapter_params(shape, Finetune(32, ("q_proj", "v_proj"))) == 9_175_040


@pytest.mark.parametrize("tricks,stack,ft", [
    ("bf16", PURE, SAVED), ("bf16,flash,ckpt", PURE, SAVED), ("bf16", MASTER, replace(SAVED, modules_to_save=("lm_head",))),
    ("bf16,flash,ckpt", stack_for("trl:0.25", recipe="pure"), replace(SAVED, quantize="nf4"))])  # fmt: skip
def test_modules_to_save_allocation_by_allocation(tricks, stack, ft):
    """modules_to_save: ModulesToSaveWrapper keeps the original frozen and trains a deep copy in the model's dtype
    (no tuner layer: not upcast), the embedding's dense gradient and the head's, and their optimizer state; under
    TRL a 4-bit base is prepared (its embedding and head cast to fp32) before the copies are made."""
    assert_meta(TINY["llama"], tricks, replace(stack, finetune=ft))


def test_modules_to_save_under_the_trainers_autocast_on_cpu():
    assert_cpu(SAVED, "bf16,ckpt")


def test_modules_to_save_in_the_textbook():
    """The textbook's state: the copies in the model's dtype, their grads and AdamW moments too (a vocab x hidden
    table each), beside the fp32 adapters."""
    from memcalc.memory.state import finetune_state

    shape = PRESETS["llama3-8b"]
    ft = Finetune(16, modules_to_save=("embed_tokens", "lm_head"))
    table = shape.vocab * shape.hidden
    state = finetune_state(10**9, 10**9, adapter_params(shape, ft), "bf16", "bf16", "adamw", "master", True,
                           copies=2 * table)  # fmt: skip
    copies = {p.name: p.bytes for p in state.parts if p.name.startswith("copy ")}
    assert copies == {"copy weights": 4 * table, "copy grads": 4 * table, "copy adam_m": 4 * table,
                      "copy adam_v": 4 * table}  # fmt: skip
    paged = finetune_state(10**9, 10**9, adapter_params(shape, ft), "bf16", "bf16", "paged-adamw", "master", True,
                           copies=2 * table)  # bitsandbytes' 32-bit moments, paged whole: unified memory  # fmt: skip
    assert {p.name: (p.bytes, p.unified) for p in paged.parts if p.name.startswith("copy adam")} == \
        {"copy adam_m": (8 * table, True), "copy adam_v": (8 * table, True)}  # fmt: skip


def test_dora_and_saved_modules_under_zero_1_and_2():
    """ZeRO 1 and 2 keep the base whole on every GPU, so DoRA's forward and the copies run as on one; the adapters'
    and the copies' moments (and at 2 their gradients) shard: memory falls with the stage."""
    from typer.testing import CliRunner

    from memcalc.cli import app

    def verdict(zero: str) -> dict:
        args = ["estimate", "--model", "llama3-8b", "--seq", "2048", "--lora", "16", "--dora", "--modules-to-save",
                "lm_head", "--tricks", "bf16,flash,ckpt", "--gpus", "8", "--zero", zero, "--format", "json"]
        out = CliRunner().invoke(app, args)
        assert out.exit_code == 0, out.output
        return __import__("json").loads(out.stdout)["verdict"][0]

    z0, z1, z2 = (verdict(z) for z in "012")
    assert z0["state_bytes"] > z1["state_bytes"] == z2["state_bytes"]
    assert z0["peak_bytes"] > z1["peak_bytes"] > z2["peak_bytes"]


@pytest.mark.parametrize("args,why", [
    (["--lora", "8", "--modules-to-save", "norm"], "embed_tokens and lm_head"),
    (["--modules-to-save", "lm_head"], "an option of LoRA"),
    (["--lora", "8", "--modules-to-save", "lm_head", "--lora-targets", "q,lm_head"], "one way"),
    (["--lora", "8", "--modules-to-save", "lm_head", "--gpus", "8", "--zero", "3"], "ZeRO 0-2"),
    (["--dora"], "--dora is an option of LoRA"), (["--lora", "8", "--dora", "--quantize", "nf4"], "4-bit base"),
    (["--lora", "8", "--dora", "--stack", "fsdp2", "--gpus", "8", "--zero", "3"], "FSDP or ZeRO"),
    (["--lora", "8", "--dora", "--gpus", "8", "--zero", "3"], "FSDP or ZeRO-3"),
    (["--lora", "8", "--dora", "--stack", "torchtune"], "Transformers' classes")])  # fmt: skip
def test_dora_refusals(args, why):
    from typer.testing import CliRunner

    from memcalc.cli import app

    out = CliRunner().invoke(app, ["estimate", "--model", "llama3-8b", *args])
    assert out.exit_code == 2 and why in out.output, out.output


@pytest.mark.parametrize("tricks", ["bf16", "bf16,flash,ckpt", "bf16,selective"])
def test_frozen_parts(tricks):
    """Full training with the embedding, the head (tied: the same table) and the first block frozen: no
    gradient, no optimizer state for them; the frozen block's checkpointed core saves inputs nobody needs,
    freed in forward (selective)."""
    ft = Finetune(freeze=("embeddings", "head"), frozen_blocks=1)
    assert_meta(TINY["llama-mha-tied"], tricks, replace(PURE, finetune=ft))


@pytest.mark.parametrize("tricks", ["bf16", "bf16,ckpt", "fp16,flash"])
def test_lora_under_the_trainers_autocast_on_cpu(tricks):
    """The Trainer's step (bf16=True: Accelerate's autocast; fused AdamW over the fp32 adapters) on real CPU
    tensors with CPU's autocast lists: PEFT casts the base's 16-bit output to the adapters' fp32, autocast casts
    it back for lora_A (and lora_A's weight, cached)."""
    assert_cpu(Finetune(4, lora_dropout=0.05), tricks)


@pytest.mark.parametrize("name,tricks,dora", [("llama3-8b", "bf16,flash,ckpt", False),
                                             ("qwen3-8b", "bf16,flash", False), ("llama3-8b", "bf16,flash,ckpt", True)])
def test_lora_at_8b_width(name, tricks, dora):
    """LoRA r=16 (and DoRA) on every projection at 8B width, seq 2048, three blocks deep: every phase, the saved
    bytes and FlopCounterMode's count equal PEFT's on meta. The gradients are the adapters' alone, in fp32."""
    ft = Finetune(16, dora=dora)
    shape, t, stack = replace(PRESETS[name], n_layers=3), parse_tricks(tricks), replace(PURE, finetune=ft)
    step, _ = measure_step(shape, 2048, 1, t, stack=stack)
    e = exact_step(shape, 2048, 1, t, stack=stack)
    for f in FIELDS:
        assert getattr(e.phases, f) == getattr(step, f), f
    assert e.activations.total_bytes == step.saved_bytes
    assert step.flops == e.flops.counted
    assert e.phases.grads_bytes == 4 * adapter_params(shape, ft)


QLORA = Finetune(4, quantize="nf4")


@pytest.mark.parametrize("name,tricks", [("llama", "bf16"), ("llama", "bf16,flash,ckpt"), ("qwen2", "bf16,selective")])
def test_qlora_allocation_by_allocation(name, tricks):
    """bitsandbytes' 4-bit projections (nf4, double quantisation) under PEFT's bnb LoRA on meta, with CUDA's
    training path for the matmul (verify/qlora.py): the packed weights and their quantisation state; in forward
    the dequantised absmax (+ offset) and weight buffers of each matmul, PEFT's clone of the base's output; in
    backward the weight dequantised again; Qwen2's biases through addmm."""
    pytest.importorskip("bitsandbytes")
    assert_meta(TINY[name], tricks, replace(PURE, finetune=QLORA), batch=2 if name == "qwen2" else 1)


@pytest.mark.parametrize("tricks", ["bf16", "fp16,ckpt"])
def test_qlora_on_cpu_under_autocast(tricks):
    """The Trainer's QLoRA step on real CPU tensors, bitsandbytes' CPU backend quantising and computing: its
    gemm_4bit (backends/default/ops.py) is one op whose dequantised buffers the tracker does not see, and PEFT casts
    the adapters' input to fp32 there even under autocast (torch.is_autocast_enabled() asks CUDA's); the
    replay says both for device cpu."""
    pytest.importorskip("bitsandbytes")
    assert_cpu(QLORA, tricks)


def test_qlora_at_8b_width():
    """QLoRA r=16 on Llama-3-8B's blocks at seq 2048, three deep: every phase, the saved bytes and the FLOPs equal
    bitsandbytes and PEFT on meta."""
    pytest.importorskip("bitsandbytes")
    shape, t = replace(PRESETS["llama3-8b"], n_layers=3), parse_tricks("bf16,flash,ckpt")
    assert_equal_at_width(shape, 2048, t, replace(PURE, finetune=Finetune(16, quantize="nf4")))


def test_refusals():
    shape = TINY["llama"]
    with pytest.raises(InputError, match="--stack hf"):
        exact_step(shape, 24, 1, parse_tricks("bf16"), stack=replace(stack_for("reference"), finetune=LORA))
    with pytest.raises(InputError, match="Conv1D"):  # LoRA on GPT-2 is replayed (tests/test_lora_families.py)
        exact_step(TINY["gpt2"], 24, 1, parse_tricks("bf16"), stack=replace(MASTER, finetune=Finetune(4, dora=True)))
    with pytest.raises(InputError, match=r"LLM\.int8\(\)"):
        exact_step(shape, 24, 1, parse_tricks("bf16"), stack=replace(MASTER, finetune=Finetune(4, quantize="int8")))
    with pytest.raises(InputError, match="option of LoRA"):
        finetune_for(quantize="nf4")
    with pytest.raises(InputError, match="unknown LoRA target"):
        finetune_for("16", targets="q,wq")
    with pytest.raises(InputError, match="already freezes"):
        finetune_for("16", freeze="embeddings")


@pytest.mark.parametrize("extra", [["--recipe", "pure", "--tricks", "bf16,flash,ckpt"], ["--tricks", "bf16"]])
def test_verify_with_lora(extra):
    """memcalc verify --stack hf --lora R: on meta where nothing autocasts (--recipe pure), on CPU tensors at
    reduced size under the Trainer's autocast; every judged row passes."""
    from typer.testing import CliRunner

    from memcalc.cli import app

    args = ["verify", "--model", "llama3-8b", "--layers", "2", "--hidden", "256", "--heads", "4", "--kv-heads", "2",
            "--ffn", "512", "--vocab", "512", "--seq", "64", "--stack", "hf", "--lora", "8", "--device", "meta"]
    r = CliRunner().invoke(app, args + extra)
    assert r.exit_code == 0 and "Pass: all" in r.output, r.output


def test_a_model_without_4bit_layers_holds_no_quantisation_state():
    """After a QLoRA model was built on meta (bitsandbytes' shared dynamic map made there), another model's
    measured weights are its parameters and buffers alone."""
    pytest.importorskip("bitsandbytes")
    from verify.lora import held_tensors

    build_hf(TINY["llama"], parse_tricks("bf16"), 24, finetune=QLORA)
    assert held_tensors(build_hf(TINY["llama"], parse_tricks("bf16"), 24)) == []


HEAD_LORA = Finetune(4, ("q_proj", "v_proj", "lm_head"), 0.1)  # target_modules=["q_proj", "v_proj", "lm_head"]


def test_lora_on_the_head_registers_as_peft_does():
    """lm_head among the targets: PEFT's Linear around the head, its lora_A (r, hidden) and lora_B (vocab, r) after
    the frozen head weight, r·(hidden + vocab) more to train."""
    shape, stack = TINY["llama"], replace(MASTER, finetune=HEAD_LORA)
    model = build_hf(shape, parse_tricks("bf16"), 24, finetune=HEAD_LORA).model
    real = [(n.removeprefix("base_model.model.").replace(".base_layer", "").replace(".default", ""), tuple(p.shape),
             p.requires_grad) for n, p in model.named_parameters()]  # fmt: skip
    sim = hf_build(Graph(LiveBytes()), step_config(shape, 24, 1, "bf16", stack))
    assert real == [(p.name, p.shape, p.requires_grad) for p in sim.p.values()]
    assert real[-2:] == [("lm_head.lora_A.weight", (4, 64), True), ("lm_head.lora_B.weight", (200, 4), True)]
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    without = adapter_params(shape, Finetune(4, ("q_proj", "v_proj")))
    assert trained == adapter_params(shape, HEAD_LORA) == without + 4 * (64 + 200)


@pytest.mark.parametrize("tricks,stack", [("bf16", MASTER), ("bf16,flash,ckpt", PURE)])
def test_lora_on_the_head_allocation_by_allocation(tricks, stack):
    """The head's adapters on the logits: the fp32 cast of the last hidden states (lora_A's dtype), the dropout's
    mask, lora_B's vocab-wide output, the scaled copy and the sum with the head's own logits, each a logits-sized
    temporary; lora_B's input saved for its weight's gradient."""
    assert_meta(TINY["llama"], tricks, replace(stack, finetune=HEAD_LORA), batch=2)


def test_lora_on_the_head_under_the_trainers_autocast_on_cpu():
    assert_cpu(HEAD_LORA, "bf16")


def test_lora_on_a_tied_head_is_refused():
    from typer.testing import CliRunner

    from memcalc.cli import app

    args = ["estimate", "--model", "llama3.2-1b", "--lora", "8", "--lora-targets", "q,v,lm_head"]
    out = CliRunner().invoke(app, args)
    assert out.exit_code == 2 and "head is its embedding table (tied)" in out.output, out.output
