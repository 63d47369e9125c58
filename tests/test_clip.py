"""The Trainer's gradient clipping (max_grad_norm 1.0, memcalc.exact.train.clip): torch's clip_grad_norm_ as the
Trainer calls it, held to torch on meta allocation by allocation (the foreach path and its partial sums as on
CUDA: verify/recipes.py cuda_norms) and on CPU tensors under fp16's GradScaler, which unscales first; only the
Trainer's stacks clip; and a recipe file's max_grad_norm is read.
"""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from memcalc.model.finetune import Finetune
from memcalc.model.shape import ModelShape
from memcalc.model.stacks import STACKS, stack_for

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("peft")

from memcalc.exact.base.config import StepConfig  # noqa: E402
from memcalc.exact.replay.meta import simulate, trace  # noqa: E402
from memcalc.model.tricks import parse_tricks  # noqa: E402
from tests.replay import assert_same_step  # noqa: E402
from tests.test_cli import run  # noqa: E402
from tests.test_lora import assert_meta, step_config  # noqa: E402
from tests.test_stack_hf import TINY  # noqa: E402
from verify.autocast import measure_cpu  # noqa: E402

# 70,000 x 64 = 4,480,000 elements in the embedding: 69 chunks of 65,536 for every tensor's partial sums
WIDE = ModelShape(n_layers=2, hidden=64, n_heads=4, n_kv_heads=2, ffn=160, gated_mlp=True, norm="rmsnorm",
                  positions="rope", vocab=70000, name="llama-70k-vocab", arch="llama")  # fmt: skip


def test_full_training_on_meta():
    """Every weight trains (bf16, fused AdamW): 21 gradients, the partial sums 21 x 69 fp32, 21 0-d norms, the
    stack, the total; the last step's grad_norm held between steps."""
    assert_meta(WIDE, "bf16", stack_for("hf", recipe="pure"), batch=2)


def test_lora_and_a_trained_copy_group_by_dtype():
    """fp32 adapters and a bf16 copy of the head (modules_to_save): two groups, the later dtype's first, each with
    its own partial sums; the norms stacked in fp32."""
    ft = Finetune(4, modules_to_save=("lm_head",))
    assert_meta(TINY["llama"], "bf16", replace(stack_for("hf", recipe="pure"), finetune=ft), batch=2)


def test_fp16_unscales_before_clipping_on_cpu():
    """fp16=True: accelerate's clip_grad_norm_ unscales first (GradScaler.unscale_), so the fused AdamW's step is
    handed found_inf and no grad_scale; on real CPU tensors under the Trainer's autocast."""
    stack, shape = replace(STACKS["hf"], finetune=Finetune(4)), TINY["llama"]
    phases, g, mem = simulate(step_config(shape, 24, 2, "fp16", stack, device="cpu"), timeline=True)
    step, live, recipe = measure_cpu(shape, 24, 2, parse_tricks("fp16"), 1, True, stack)
    assert recipe.skipped == 0
    assert_same_step(phases, g, mem, step, live, "fp16")


def test_only_the_trainer_clips():
    """The hf and TRL stacks run the Trainer's loop, which clips; stock PyTorch's loop and torchtitan's (whose
    clipping is its own, over DTensors) do not."""
    def ops(stack):
        cfg = StepConfig(TINY["llama"], 24, 1, parse_tricks("bf16"), replace(stack, recipe="pure"))
        return {k.op for k in trace(cfg)}

    assert "_foreach_norm" in ops(STACKS["hf"]) and "_foreach_norm" in ops(STACKS["trl:0.25"])
    assert "_foreach_norm" not in ops(STACKS["torch"]) and "_foreach_norm" not in ops(STACKS["fsdp2"])


@pytest.mark.parametrize("norm,kind", [(0.3, "used"), (0, "not modelled")])
def test_max_grad_norm_in_a_trainer_file(tmp_path, norm, kind):
    """A positive max_grad_norm is the replayed clipping (its bytes do not depend on the norm); 0 turns it off,
    which the replay does not: said so, not passed off as ignored."""
    path = tmp_path / "args.json"
    path.write_text(json.dumps({"model_name_or_path": "llama3.1-8b", "per_device_train_batch_size": 1,
                                "max_grad_norm": norm, "bf16": True}))  # fmt: skip
    out = run("estimate", "--from", str(path), "--gpu", "h100-sxm", "--seq", "1024", "--format", "json")
    assert out.exit_code == 0, out.output
    keys = {k["key"]: k for k in json.loads(out.stdout)["from"]["keys"]}
    assert keys["max_grad_norm"]["use"] == kind, keys["max_grad_norm"]


def test_the_8b_figure_docs_quote():
    """docs/stack-hf.md: Llama-3-8B trained whole clips 291 gradients, the embedding's 8,016 chunks the largest:
    9.3 MB of partial sums."""
    from pathlib import Path

    from memcalc.model.presets import PRESETS
    from tests.test_stack_amp import param_elements

    sizes = param_elements(PRESETS["llama3-8b"], "hf")
    chunks = -(-max(sizes) // 65536)
    page = " ".join((Path(__file__).parents[1] / "docs" / "stack-hf.md").read_text().split())
    assert (len(sizes), chunks) == (291, 8016)
    assert f"{len(sizes)} tensors by the embedding's {chunks:,} chunks, {4 * len(sizes) * chunks / 1e6:.1f} MB" in page
