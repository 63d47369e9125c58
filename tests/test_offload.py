"""Activation offloading (issue 40, --offload-activations): memcalc.exact.sim.offload's replay equals the step of
Transformers' and PEFT's model run under the offloading hooks (verify/offload.py: TRL 1.16's OffloadActivations and
Transformers' checkpoint offload as torch.autograd.graph.saved_tensors_hooks over the real autograd) on meta,
allocation by allocation; the bytes sent to the host are the hooks' own count; and the refusals.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from memcalc.errors import InputError
from memcalc.model.finetune import Finetune
from memcalc.model.stacks import check_tricks, stack_for
from memcalc.model.tricks import parse_tricks

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("peft")

from memcalc.exact.replay.meta import simulate  # noqa: E402
from tests.replay import assert_same_step  # noqa: E402
from tests.test_lora import step_config  # noqa: E402
from tests.test_stack_hf import TINY  # noqa: E402
from verify.meta import build_model, measure_step  # noqa: E402
from verify.offload import OffloadedRecipe, exclude_head, offload_checkpoints  # noqa: E402
from verify.recipes import recipe_for  # noqa: E402

LORA = Finetune(4)


def offloaded(key: str, finetune: Finetune = LORA):
    return replace(stack_for(key, recipe="pure", impl="fused", offload=True), finetune=finetune)


def measured(shape, seq: int, batch: int, tricks: str, stack):
    """The step on meta under the stack's offloading hooks, and what they sent to the host and back."""
    t = parse_tricks(tricks)
    model = build_model(shape, seq, t, stack)
    counts = [0, 0]
    if stack.trl:
        exclude_head(model.model if hasattr(model, "model") else model)
        recipes = []

        def make(m, precision):
            recipes.append(OffloadedRecipe(recipe_for(m, precision, stack), m))
            return recipes[0]
    else:
        offload_checkpoints(model, counts)

        def make(m, precision):
            return recipe_for(m, precision, stack)
    step, live = measure_step(shape, seq, batch, t, model=model, timeline=True, stack=stack, make_recipe=make,
                              count_flops=False)  # fmt: skip
    if stack.trl:  # the context's count of the measured step
        return step, live, [recipes[0].context.offloaded, recipes[0].context.reloaded]
    return step, live, [n // 2 for n in counts]  # save_on_cpu's, over the warm-up step and the measured one


@pytest.mark.parametrize("name,key,tricks,batch,finetune", [
    ("llama", "trl:0.25", "bf16", 1, LORA), ("llama", "trl:0.25", "bf16,flash,ckpt", 2, LORA),
    ("qwen3", "trl:0.25", "bf16,flash", 1, Finetune()), ("llama", "hf", "bf16,flash,ckpt", 1, LORA),
    ("qwen2", "hf", "bf16,ckpt", 2, Finetune()),
])  # fmt: skip
def test_offloaded_step_allocation_by_allocation(name, key, tricks, batch, finetune):
    """Every phase and every allocation with the live bytes at it, and the bytes to the host and back, against the
    real model under the hooks on meta."""
    shape, stack = TINY[name], offloaded(key, finetune)
    phases, g, mem = simulate(step_config(shape, 24, batch, tricks, stack), timeline=True)
    step, live, (out, back) = measured(shape, 24, batch, tricks, stack)
    assert_same_step(phases, g, mem, replace(step, saved_bytes=sum(x.nbytes for x in g.saved_terms)), live, tricks)
    assert (phases.offloaded_bytes, phases.reloaded_bytes) == (out, back) and out > 0


def test_offloading_lowers_the_peak_and_sends_the_rest_to_the_host():
    """The same step without offloading peaks higher; what left the GPU is on the host."""
    shape = TINY["llama"]
    on = simulate(step_config(shape, 64, 1, "bf16", offloaded("trl:0.25")))[0]
    off = simulate(step_config(shape, 64, 1, "bf16", replace(stack_for("trl:0.25", recipe="pure", impl="fused"),
                                                            finetune=LORA)))[0]  # fmt: skip
    assert on.backward_peak_bytes < off.backward_peak_bytes and on.retained_bytes < off.retained_bytes
    assert on.offloaded_bytes >= off.retained_bytes - on.retained_bytes and off.offloaded_bytes == 0


@pytest.mark.parametrize("key", ["reference", "torch", "fsdp2", "trl:0.14", "trl:0.21"])
def test_a_stack_that_does_not_offload_is_refused(key):
    with pytest.raises(InputError, match="--offload-activations"):
        stack_for(key, offload=True)


def test_the_trainer_offloads_checkpoints_only():
    """Transformers offloads the checkpointed layers' inputs: without ckpt it is refused, not ignored."""
    stack = stack_for("hf", offload=True)
    with pytest.raises(InputError, match="needs ckpt"):
        check_tricks(stack, parse_tricks("bf16,flash"))
    check_tricks(stack, parse_tricks("bf16,flash,ckpt"))
    check_tricks(stack_for("trl:0.25", offload=True), parse_tricks("bf16,flash"))


def run(*args):
    from typer.testing import CliRunner

    from memcalc.cli import app

    return CliRunner().invoke(app, list(args), env={"COLUMNS": "200", "NO_COLOR": "1"})


@pytest.mark.parametrize("args,message", [
    (("--stack", "torch"), "not on --stack torch"), (("--stack", "trl:0.14", "--lora", "16"), "trl:0.25"),
    (("--stack", "hf", "--lora", "16", "--tricks", "bf16,flash"), "needs ckpt"),
])  # fmt: skip
def test_the_option_is_refused_in_one_line_where_it_does_not_apply(args, message):
    out = run("estimate", "--model", "llama3-8b", "--seq", "2048", "--offload-activations", *args)
    assert out.exit_code == 2 and message in out.output and len(out.output.strip().splitlines()) == 1, out.output


def test_the_verdict_says_where_the_activations_went():
    """The notes name TRL's OffloadActivations, the pinned host bytes and the copies on the card's host link."""
    out = run("estimate", "--model", "llama3-8b", "--layers", "2", "--seq", "1024", "--lora", "16", "--tricks",
              "bf16,flash", "--gpu", "a100-80gb", "--stack", "trl:0.25", "--offload-activations")  # fmt: skip
    assert out.exit_code == 0, out.output
    text = " ".join(out.output.split())
    assert "activations offloaded (TRL's SFTConfig(activation_offloading=True)" in text
    assert "of pinned host memory per GPU" in text and "PCIe Gen4 x16 (32 GB/s a direction)" in text
