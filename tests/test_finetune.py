"""Fine-tuning modes through the CLI and the textbook (no torch): LoRA's adapter count and model state, frozen
parts, and the options that do not apply, refused in one line (the replay itself: tests/test_lora.py)."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from memcalc.cli import app
from memcalc.memory.state import finetune_state
from memcalc.model.finetune import Finetune, adapter_params, frozen_params, parse_targets, trained_params
from memcalc.model.params import layer_params, n_params
from memcalc.model.presets import PRESETS

LLAMA = PRESETS["llama3-8b"]


def run(*args: str):
    return CliRunner().invoke(app, list(args))


def test_llama3_8b_adapters():
    """r=16 on every projection: 32 blocks x 16 x (q 4096+4096, k 4096+1024, v 4096+1024, o 4096+4096, gate,
    up, down 3 x (4096+14336)) = 41,943,040, the count PEFT's print_trainable_parameters reports for
    Meta-Llama-3-8B with target_modules="all-linear"; q and v alone: 32 x 16 x 14,336."""
    assert adapter_params(LLAMA, Finetune(16)) == 41_943_040
    assert adapter_params(LLAMA, Finetune(16, parse_targets("q,v"))) == 32 * 16 * (8192 + 5120)
    assert frozen_params(LLAMA, Finetune(16)) == n_params(LLAMA)


def test_lora_state_is_the_frozen_base_and_fp32_adapters():
    """The base in bf16 (2 bytes), nothing else for it; each adapter parameter 16 bytes (fp32 weight, grad, m, v)."""
    a = adapter_params(LLAMA, Finetune(16))
    st = finetune_state(n_params(LLAMA), n_params(LLAMA), a, "bf16", "bf16", "adamw", "autocast", True)
    assert st.total_bytes == 2 * n_params(LLAMA) + 16 * a
    assert [p.name for p in st.parts] == ["frozen weights", "adapter weights", "adapter grads", "adapter adam_m",
                                          "adapter adam_v"]  # fmt: skip


def test_frozen_parts_count():
    """--freeze embeddings,head,4 on untied Llama-3-8B: two tables and four blocks hold no grads or state."""
    ft = Finetune(freeze=("embeddings", "head"), frozen_blocks=4)
    assert frozen_params(LLAMA, ft) == 2 * 128256 * 4096 + 4 * layer_params(LLAMA)
    assert trained_params(LLAMA, ft) == n_params(LLAMA) - frozen_params(LLAMA, ft)


def test_estimate_answers():
    r = run("estimate", "--model", "llama3-8b", "--seq", "2048", "--lora", "16", "--tricks", "bf16,flash,ckpt",
            "--gpu", "rtx4090", "--format", "json")  # fmt: skip
    assert r.exit_code == 0, r.output
    out = json.loads(r.output)
    assert "LoRA r=16" in r.output and out


@pytest.mark.slow("test_estimate_answers (the verdict fit searches with) and tests/test_cli.py::test_fit_command")
def test_fit_answers():
    r = run("fit", "--model", "llama3-8b", "--lora", "16", "--tricks", "bf16,flash,ckpt", "--gpu", "rtx4090")
    assert r.exit_code == 0 and "Longest sequence that fits" in r.output, r.output
    # QLoRA's fit on the same card: docs/finetune.md's example (tests/test_docs.py)


@pytest.mark.parametrize("args,says", [
    (["--lora", "16", "--stack", "torch"], "--stack hf"),
    (["--quantize", "nf4"], "option of LoRA"),
    (["--lora", "16", "--quantize", "int8"], "LLM.int8()"),
    (["--lora", "16", "--lora-targets", "q,wq"], "unknown LoRA target"),
    (["--lora", "16", "--freeze", "head"], "already freezes"),
    (["--lora", "16", "--tp", "2", "--gpus", "4"], "tensor, pipeline, context and expert parallel are not replayed"),
    (["--lora", "16", "--zero", "2", "--gpus", "4", "--offload"], "offload"),
    (["--lora", "16", "--stack", "fsdp2"], "fully_shard over 2 or more GPUs"),
    (["--freeze", "32"], "leave one to train"),
    (["--lora", "16", "--lora-dropout", "1.5"], "lora-dropout"),
    (["--lora", "16", "--freeze", "2,4"], "one number of blocks"),
    # not replayed, and the textbook counts full training's state: it printed 128 GB and an MFU of 161%
    (["--lora", "16", "--recipe", "master"], "LoRA r=16: the master recipe (fp32 master weights) runs with its"),
])  # fmt: skip
def test_refused_in_one_line(args, says):
    r = run("estimate", "--model", "llama3-8b", "--seq", "1024", *args)
    assert r.exit_code == 2 and says in r.output and r.output.count("\n") == 1, r.output


def test_frozen_weights_run_no_weight_gradient_gemms():
    """The roofline's kernels are the replay's: a block whose weights are frozen runs no weight-gradient GEMM
    (aten.mm's backward makes a weight's gradient only when it requires grad), and one whose input needs no
    gradient either runs none at all. With the embedding and the first 16 of 32 blocks frozen, the blocks'
    backward is 16 blocks' dgrad + wgrad (2 x forward each) = the forward of all 32; training all, 2 x."""
    from dataclasses import replace

    from memcalc.exact.kernels import block_weight, kernels_of
    from memcalc.model.stacks import stack_for
    from memcalc.model.tricks import parse_tricks

    t = parse_tricks("bf16,flash")

    def linear_flops(ft: Finetune) -> dict[str, int]:
        out: dict[str, int] = {}
        for k in kernels_of(LLAMA, 2048, 1, t, replace(stack_for("hf"), finetune=ft)):
            if k.count_kind == "linear":
                out[k.phase] = out.get(k.phase, 0) + k.flops * k.count * block_weight(k, 32, t, LLAMA, ft)
        return out

    full, frozen = linear_flops(Finetune()), linear_flops(Finetune(freeze=("embeddings",), frozen_blocks=16))
    assert full["backward"] == 2 * full["forward"]
    assert frozen["backward"] == frozen["forward"] == full["forward"]


def test_qlora_storage_is_the_replays():
    """QLoRA on Llama-3-8B: the textbook's frozen weights (embeddings, head, norms in bf16), 4-bit weights
    (bitsandbytes' packed nf4 with double quantisation) and fp32 adapters are the replay's weights less the rotary
    buffers (2 x 64 fp32): 5.87 GB where the bf16 base is 16.06 GB."""
    from dataclasses import replace

    from memcalc.exact.step import exact_step
    from memcalc.memory.estimate import Setup, state_for
    from memcalc.model.stacks import stack_for
    from memcalc.model.tricks import parse_tricks

    stack = replace(stack_for("hf"), finetune=Finetune(16, quantize="nf4"))
    st = state_for(LLAMA, n_params(LLAMA), Setup(seq_len=2048, stack=stack), "bf16")[0]
    weights = sum(p.bytes for p in st.parts if p.name in ("frozen weights", "4-bit weights", "adapter weights"))
    e = exact_step(LLAMA, 2048, 1, parse_tricks("bf16,flash,ckpt"), stack=stack)
    assert e.phases.weights_bytes - 2 * 64 * 4 == weights == 5_870_313_344


def test_the_numbers_docs_finetune_quotes():
    """docs/finetune.md's prose: the adapter count, bytes per adapter parameter and per 4-bit parameter, the
    MLP's dequantised buffer, and bitsandbytes' token limit for its fused kernel, each computed here."""
    from pathlib import Path

    from memcalc.exact.hf.qlora import MAX_FUSED_TOKENS
    from memcalc.model.finetune import quantized_weights

    page = " ".join((Path(__file__).resolve().parent.parent / "docs" / "finetune.md").read_text().split())
    a = adapter_params(LLAMA, Finetune(16))
    st = finetune_state(n_params(LLAMA), n_params(LLAMA), a, "bf16", "bf16", "adamw", "autocast", True)
    per_adapter = sum(p.bytes for p in st.parts if p.name.startswith("adapter")) // a
    count, size = quantized_weights(LLAMA)
    assert f"{per_adapter} bytes an adapter parameter, {a:,} of them here" in page
    assert f"{size / count:.2f} bytes a parameter with double quantisation" in page
    assert f"{LLAMA.hidden} × {LLAMA.ffn} × 2 bytes for Llama-3-8B" in page
    assert f"more than {MAX_FUSED_TOKENS:,} tokens a micro-batch" in page and f"Below {MAX_FUSED_TOKENS:,} tokens" in page


@pytest.mark.parametrize("model", ["mixtral-8x7b", "deepseek-v3", "qwen3-30b-a3b"])
@pytest.mark.parametrize("how", [["--lora", "16"], ["--freeze", "embeddings"], ["--lora", "16", "--quantize", "nf4"]])
def test_experts_and_latent_attention_are_refused(model, how):
    """PEFT's LoRA is replayed on the dense decoders (memcalc.exact.hf.model.FAMILIES, those with lora=True): a
    mixture of experts or latent attention is one line, never a step whose state counts one dense MLP's adapters."""
    for command in ("estimate", "fit"):
        r = run(command, "--model", model, "--seq", "1024", *how)
        assert r.exit_code == 2 and "the hf stack builds" in r.output and r.output.count("\n") == 1, r.output


def test_the_toolbox_offers_qlora_where_lora_does_not_fit():
    """A LoRA that fits no card as it is can fit with its base in 4 bits: the toolbox tries --quantize nf4 (it said
    "nothing in the toolbox makes it fit"), and the verdict names it with the trick set."""
    r = run("estimate", "--model", "llama3-8b", "--seq", "2048", "--lora", "16", "--tricks", "fp16,flash,ckpt",
            "--gpu", "t4", "--format", "json")  # fmt: skip
    assert r.exit_code == 0, r.output
    toolbox = json.loads(r.output)["toolbox"]
    step = toolbox["steps"][toolbox["fits_at"]]
    assert step["name"].startswith("QLoRA") and step["verdict"]["fits"]
    assert step["combination"]["setup"]["stack"]["finetune"]["quantize"] == "nf4"
    text = run("estimate", "--model", "llama3-8b", "--seq", "2048", "--lora", "16", "--tricks", "fp16,flash,ckpt",
               "--gpu", "t4").output  # fmt: skip
    assert "Cheapest combination that fits: fp16+flash+ckpt, QLoRA (nf4) r=16 ->" in " ".join(text.split())


def test_a_lora_layout_s_stages_hold_the_lora_state():
    """The layout's textbook stages count LoRA's state (the frozen base and fp32 adapters), not full training's."""
    r = run("estimate", "--model", "llama3-8b", "--seq", "2048", "--lora", "16", "--tricks", "bf16,flash,ckpt",
            "--format", "json")  # fmt: skip
    out = json.loads(r.output)
    (stage,) = out["stages"][0]
    assert stage["state"]["total_bytes"] == out["model_state"]["total_bytes"]


@pytest.mark.parametrize("zero", ["1", "2", "3"])
def test_frozen_blocks_under_zero(zero):
    """`--freeze 8 --gpus 4 --zero 2` ended in a KeyError traceback: ZeRO-2's reduce-scatter looked up the
    trained parameters of a frozen block (memcalc.exact.replay.zero Zero.leave), which has none."""
    r = run("estimate", "--model", "llama3.2-1b", "--seq", "512", "--freeze", "8", "--tricks", "bf16,flash,ckpt",
            "--gpus", "4", "--zero", zero, "--format", "json")  # fmt: skip
    assert r.exit_code == 0, r.output
    assert json.loads(r.output)["verdict"][0]["replay"] == f"DeepSpeed ZeRO-{zero} over 4 ranks"
