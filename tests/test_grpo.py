"""TRL 1.16's GRPOTrainer (--stack trl:1.16 --rl grpo, issue 43): memcalc.exact.hf.grpo's training step equals trl
1.16 itself (GRPOTrainer._compute_loss over its fused LM head, Transformers and PEFT: verify/trl_grpo.py) allocation
by allocation on meta, and on CPU tensors under the Trainer's autocast with the prompt masked.
"""

from __future__ import annotations

import csv
import io
import json
from dataclasses import replace

import pytest
from hypothesis import assume, given
from hypothesis import strategies as st
from typer.testing import CliRunner

from memcalc.cli import app
from memcalc.errors import InputError
from memcalc.model.finetune import Finetune
from memcalc.model.rl import OnlineRL, with_rl
from memcalc.model.stacks import STACKS, stack_for
from tests.test_fuzz import examples

LORA, QLORA = Finetune(4), Finetune(4, quantize="nf4")
VARIANT = pytest.mark.slow("the same step on LoRA, a full fine-tune and Qwen3 (the variant's own stack tests: "
                           "test_lora.py, test_dpo.py)")  # fmt: skip


def grpo(finetune: Finetune = LORA, recipe: str = "pure", **settings):
    return with_rl(replace(STACKS["trl:1.16"], finetune=finetune, recipe=recipe), "grpo", online=OnlineRL(**settings))


def run(*args: str):
    return CliRunner().invoke(app, list(args))


# On meta every position of a boolean index is taken as kept (verify/trl.py fused_paths), so the meta cases score
# all but the first position (a one-token prompt, completion_len = seq - 1); the CPU cases mask a longer prompt.
@pytest.mark.parametrize("name,tricks,finetune,settings", [
    ("llama", "bf16", LORA, {}),  # GRPOConfig's defaults: dapo, beta 0, the policy's own generate
    ("llama", "bf16,flash,ckpt", LORA, {"vllm": "colocate"}),  # vLLM's old log-probs and ratio in the batch
    ("llama", "bf16,flash,ckpt", QLORA, {"beta": 0.04}),  # the reference's log-probs and the KL term
    ("qwen3", "bf16,flash,ckpt", LORA, {"beta": 0.04, "vllm": "server"}),
    ("llama", "bf16", Finetune(), {}),  # a full fine-tune
    ("llama", "bf16,flash,ckpt", Finetune(), {"beta": 0.04}),  # and its reference, a second model held
    pytest.param("llama", "bf16", Finetune(4, dora=True), {"beta": 0.04}, marks=VARIANT),
    pytest.param("llama-mha-tied", "bf16", Finetune(), {}, marks=VARIANT),  # the head tied to the embedding table
    ("llama", "bf16,flash,ckpt", Finetune(4, lora_dropout=0.1), {"vllm": "server"}),  # GRPO keeps LoRA's dropout
])  # fmt: skip
def test_allocation_by_allocation(name, tricks, finetune, settings):
    pytest.importorskip("trl")
    from tests.replay import assert_watched_meta
    from tests.test_stack_hf import TINY

    assert_watched_meta(TINY[name], tricks, grpo(finetune, completion_len=23, **settings), batch=2)


def test_reentrant_checkpointing():
    pytest.importorskip("trl")
    from tests.replay import assert_watched_meta
    from tests.test_stack_hf import TINY

    assert_watched_meta(TINY["llama"], "bf16,flash,ckpt", replace(grpo(completion_len=23), reentrant=True), batch=2)


@pytest.mark.parametrize("name,tricks,finetune", [("llama", "bf16", LORA),
                                                  pytest.param("qwen3", "bf16,flash,ckpt", QLORA, marks=VARIANT),
                                                  ("llama", "bf16,flash,ckpt", Finetune())])  # fmt: skip
def test_liger_beside_the_fused_head(name, tricks, finetune):
    """use_liger_kernel under GRPOTrainer: Liger's RMSNorm, RoPE and SwiGLU (fused_linear_cross_entropy False, TRL
    sets it) beside the fused LM head; a full fine-tune's second model is held, not run, in the step."""
    pytest.importorskip("liger_kernel")
    from memcalc.model.savers import ON_META, Savers
    from tests.replay import assert_watched_meta
    from tests.test_stack_hf import TINY

    stack = replace(grpo(finetune, completion_len=23, beta=0.04, vllm="server" if finetune.trains_all else ""),
                    savers=Savers(liger=ON_META))  # fmt: skip
    assert_watched_meta(TINY[name], tricks, stack, batch=2)


@pytest.mark.parametrize("finetune,completion,settings", [
    (LORA, 20, {"beta": 0.04, "vllm": "server"}),
    (Finetune(), 12, {}),  # fp32 weights under autocast
])  # fmt: skip
def test_cpu_under_autocast_with_the_prompt_masked(finetune, completion, settings):
    """TRL's default bf16=True over real tensors: the labels mask the prompt, so the fused head scores B x C rows."""
    pytest.importorskip("trl")
    from tests.replay import assert_watched_cpu
    from tests.test_stack_hf import TINY

    assert_watched_cpu(TINY["llama"], grpo(finetune, "autocast", completion_len=completion, **settings),
                       "bf16,flash,ckpt")  # fmt: skip


def test_the_prompt_is_not_scored():
    """Only the completion's positions go through the head: a shorter completion at the same sequence needs less."""
    from memcalc.exact.step import exact_step
    from memcalc.model.presets import PRESETS
    from memcalc.model.tricks import parse_tricks

    shape, tricks = replace(PRESETS["llama3.2-1b"], n_layers=2), parse_tricks("bf16,flash,ckpt")
    kept = [exact_step(shape, 2048, 4, tricks, stack=grpo(completion_len=c)).phases.retained_bytes
            for c in (256, 1024, 2047)]  # fmt: skip
    assert kept[0] < kept[1] < kept[2]


@pytest.mark.parametrize("tricks,layers,settings", [("bf16,flash,ckpt", 6, {"vllm": "colocate"}),
                                                    ("bf16", 5, {"beta": 0.04})])  # fmt: skip
def test_grown_step_equals_the_full_depth_replay(tricks, layers, settings):
    from memcalc.exact.base.config import StepConfig
    from memcalc.exact.replay.meta import simulate
    from memcalc.exact.step import exact_step
    from memcalc.model.presets import PRESETS
    from memcalc.model.tricks import parse_tricks

    shape, run_as = replace(PRESETS["llama3.2-1b"], n_layers=layers), parse_tricks(tricks)
    stack = grpo(Finetune(8), completion_len=256, **settings)
    assert exact_step(shape, 512, 2, run_as, stack=stack).phases == simulate(StepConfig(shape, 512, 2, run_as,
                                                                                          stack))[0]  # fmt: skip


def test_the_generation_batch_is_held():
    """The buffered generation batch (grad_accum micro-batches) stays between steps: more accumulation, more state."""
    args = ["estimate", "--model", "llama3.2-1b", "--seq", "1024", "--lora", "8", "--rl", "grpo", "--vllm",
            "colocate", "--tricks", "bf16,flash,ckpt", "--micro-batch", "4", "--num-generations", "4", "--format",
            "json"]  # fmt: skip
    one, four = (json.loads(run(*args, "--grad-accum", a).stdout)["verdict"][0] for a in ("1", "4"))
    assert four["state_bytes"] > one["state_bytes"]


@pytest.mark.parametrize("args,said", [
    (["--rl", "grpo", "--stack", "hf", "--lora", "8"], "--rl grpo is TRL's GRPOTrainer"),
    (["--rl", "grpo", "--model", "mistral-7b", "--lora", "8", "--completion-len", "256"], "sliding-window"),
    (["--rl", "ppo", "--lora", "8", "--quantize", "nf4"], "QLoRA, DoRA"),
    (["--lora", "8", "--beta", "0.1"], "give --rl grpo"),
    (["--rl", "grpo", "--lora", "8", "--vllm", "colocated"], "unknown --vllm"),
    (["--rl", "grpo", "--lora", "8", "--vllm-sleep"], "give --vllm colocate"),
    (["--rl", "grpo", "--lora", "8", "--vllm-util", "0.5"], "give --vllm"),
    (["--rl", "grpo", "--lora", "8", "--num-generations", "1"], "at least 2"),
    (["--rl", "grpo", "--lora", "8", "--beta", "-1"], "--beta"),
    (["--rl", "grpo", "--lora", "8", "--completion-len", "0"], "--completion-len"),
    (["--rl", "grpo", "--lora", "8", "--quantize", "nf4", "--vllm", "colocate"], "bitsandbytes"),
    (["--rl", "grpo", "--lora", "8", "--cudagraph-memory", "0.5"], "give --vllm"),
    (["--rl", "grpo", "--lora", "8", "--num-generations", "16"], "generation batch of 8"),  # 8 x 1 x 1 GPU
    (["--rl", "grpo", "--beta", "0.04", "--gpus", "8", "--zero", "2"], "GRPOTrainer prepares its second model"),
    (["--rl", "rloo", "--model", "gpt2", "--completion-len", "256"], "RLOOConfig keeps it on"),  # its dropout
])  # fmt: skip
def test_refused(args, said):
    model = [] if "--model" in args else ["--model", "llama3.2-1b"]
    r = run("estimate", *model, "--seq", "1024", "--micro-batch", "8", *args)
    assert r.exit_code == 2 and said in r.output and "Traceback" not in r.output, r.output


def test_completion_within_the_sequence():
    with pytest.raises(InputError, match="completion"):
        from memcalc.exact.step import exact_step
        from memcalc.model.presets import PRESETS
        from memcalc.model.tricks import parse_tricks

        exact_step(PRESETS["llama3.2-1b"], 512, 1, parse_tricks("bf16"), stack=grpo(completion_len=512))


def test_the_stack_is_trl_1_16_and_the_defaults_trls():
    r = run("estimate", "--model", "llama3.2-1b", "--seq", "1024", "--lora", "8", "--rl", "grpo", "--micro-batch", "8",
            "--format", "json")  # fmt: skip
    assert r.exit_code == 0, r.output
    stack = json.loads(r.stdout)["setup"]["stack"]
    assert stack["key"] == "trl:1.16" and stack["online"]["completion_len"] == 512 and stack["online"]["beta"] == 0.0
    assert with_rl(replace(stack_for("trl:1.16"), finetune=Finetune(8, lora_dropout=0.1)), "grpo").finetune \
        .lora_dropout == 0.1  # GRPOConfig.disable_dropout is False  # fmt: skip


# -- the rollout engine beside the step (memcalc.engine.rollout) ------------------------------------------------------

JOB = ["--model", "llama3-8b", "--seq", "1024", "--completion-len", "512", "--lora", "16", "--rl", "grpo",
       "--num-generations", "4", "--tricks", "bf16,flash,ckpt", "--micro-batch", "4", "--gpu", "h100-sxm"]  # fmt: skip


def answer(*args: str) -> dict:
    r = run("estimate", *JOB, *args, "--format", "json")
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout)


def test_the_engine_is_memcalc_serves():
    """The colocated engine's budget is `memcalc serve`'s for the same vLLM: TRL's LLM(...) arguments, the newest
    release trl 1.16 admits."""
    engine = answer("--vllm", "colocate")["rollout"]["engine"]
    r = run("serve", "--model", "llama3-8b", "--gpu", "h100-sxm", "--context", "1024", "--gpu-memory-utilization",
            "0.3", "--max-num-seqs", "4", "--max-num-batched-tokens", "4096", "--vllm-version", "0.31",
            "--cudagraph-memory", "0", "--format", "json")  # fmt: skip
    assert r.exit_code == 0, r.output
    budget = json.loads(r.stdout)["budget"]
    assert (engine["cache_bytes"], engine["cache_tokens"]) == (budget["cache_bytes"], budget["cache_tokens"])
    assert engine["awake_bytes"] == engine["weights_bytes"] + engine["cache_bytes"] + engine["kept_bytes"]


def test_the_engine_is_kept_back_beside_the_step():
    """Colocated: the verdict's usable bytes less the engine awake (asleep under --vllm-sleep: its runner's tensors);
    a server's engine is on GPUs of its own; the step itself is the same."""
    alone, server = answer(), answer("--vllm", "server")
    awake, asleep = answer("--vllm", "colocate"), answer("--vllm", "colocate", "--vllm-sleep")
    usable = alone["verdict"][0]["usable_bytes"]
    assert server["verdict"][0]["usable_bytes"] == usable
    assert awake["verdict"][0]["usable_bytes"] < usable - awake["rollout"]["engine"]["awake_bytes"] * 0.99
    assert usable - asleep["verdict"][0]["usable_bytes"] < awake["rollout"]["engine"]["weights_bytes"]
    assert awake["verdict"][0]["peak_bytes"] == asleep["verdict"][0]["peak_bytes"] == server["verdict"][0]["peak_bytes"]
    phases = awake["rollout"]["phases"][0]
    assert phases["train_bytes"] == awake["verdict"][0]["total_bytes"] + awake["rollout"]["engine"]["awake_bytes"]
    assert phases["fits"] == awake["verdict"][0]["fits"]


def test_vllm_asks_free_what_the_trainer_holds():
    """vLLM checks at startup that total x utilization is free beside the trainer's weights: 0.99 of an H100 is not,
    beside a 1B model, though the step would fit beside the engine asleep; the table says which phase fails."""
    args = ["--model", "llama3.2-1b", "--seq", "1024", "--lora", "8", "--rl", "grpo", "--tricks", "bf16,flash,ckpt",
            "--vllm", "colocate", "--vllm-util", "0.99", "--vllm-sleep", "--micro-batch", "8"]  # fmt: skip
    data = json.loads(run("estimate", *args, "--format", "json").stdout)
    phases = data["rollout"]["phases"][0]
    assert phases["startup_bytes"] > phases["startup_limit"] and not phases["fits"] and data["verdict"][0]["fits"]
    table = run("estimate", *args).output
    assert "no: startup" in table and "The step fits" in table and "but vLLM refuses to start" in table


def test_an_engine_that_does_not_start():
    """0.1 of a 24 GB card holds less than a 1B model's bf16 weights and the profile run: no room for a KV cache."""
    args = ["--model", "llama3.2-1b", "--seq", "1024", "--lora", "8", "--rl", "grpo", "--tricks", "bf16,flash,ckpt",
            "--vllm", "colocate", "--vllm-util", "0.1", "--gpu", "rtx4090", "--micro-batch", "8"]  # fmt: skip
    r = run("estimate", *args)
    assert r.exit_code == 0 and "no: vLLM does not start" in r.output, r.output
    assert "The step fits" in r.output and "but vLLM does not start" in r.output  # the verdict's sentence says it


def test_group_rows():
    """The micro-batch's unit GRPOConfig takes: whole groups of num_generations per generation batch (micro-batch x
    accumulation x processes); fit searches in it, estimate refuses what is not a multiple of it."""
    from memcalc.memory.setup import Setup, group_rows

    def unit(generations: int, accumulation: int, world: int) -> int:
        stack = with_rl(replace(STACKS["trl:1.16"], finetune=LORA), "grpo", online=OnlineRL(num_generations=generations))
        return group_rows(Setup(seq_len=1024, micro_batch=8, grad_accum=accumulation, stack=stack), world)

    assert (unit(8, 1, 1), unit(8, 2, 1), unit(8, 1, 8), unit(6, 4, 1), unit(2, 1, 1)) == (8, 4, 1, 3, 2)
    assert group_rows(Setup(seq_len=1024, micro_batch=1), 1) == 1


@pytest.mark.slow("test_group_rows (the unit fit searches in) and the replay's tests")
def test_fit_holds_the_completion():
    """fit's longest sequence keeps the completion's length and grows the prompt, the verdict at it fits; its largest
    micro-batch is one GRPOConfig takes (whole prompt groups)."""
    args = ["--model", "llama3.2-1b", "--lora", "8", "--rl", "grpo", "--completion-len", "1024", "--vllm",
            "colocate", "--gpu", "rtx4090", "--tricks", "bf16,flash,ckpt", "--micro-batch", "8"]  # fmt: skip
    r = run("fit", *args, "--seq", "2048", "--format", "json")
    assert r.exit_code == 0, r.output
    limits = json.loads(r.stdout)
    longest, most = limits["max_seq_len"], limits["max_micro_batch"]
    assert longest > 1024 and most % 8 == 0  # whole groups of num_generations 8 (one GPU, no accumulation)
    at = run("estimate", *args, "--seq", str(longest), "--format", "json")
    assert json.loads(at.stdout)["verdict"][0]["fits"]


GRPO_FILE = """model_name_or_path: Qwen/Qwen2.5-7B
per_device_train_batch_size: 8
bf16: true
gradient_checkpointing: true
num_generations: 8
max_completion_length: 1024
beta: 0.04
use_vllm: true
vllm_mode: colocate
vllm_gpu_memory_utilization: 0.35
vllm_enable_sleep_mode: true
temperature: 0.9
use_peft: true
lora_r: 16
lora_target_modules: all-linear
"""


def test_a_grpo_config_file(tmp_path):
    """`trl grpo --config FILE`'s GRPOConfig under --rl grpo: the same answer as its options typed out (TRL's
    ModelConfig keeps lora_dropout 0.05, GRPOConfig.disable_dropout is False); without --rl grpo its keys are
    refused, and without --seq (GRPOConfig holds no prompt length) too."""
    path = tmp_path / "grpo.yaml"
    path.write_text(GRPO_FILE)
    r = run("estimate", "--from", str(path), "--rl", "grpo", "--model", "qwen2.5-7b", "--seq", "1536", "--format",
            "json")  # fmt: skip
    typed = run("estimate", "--model", "qwen2.5-7b", "--rl", "grpo", "--seq", "1536", "--micro-batch", "8", "--lora",
                "16", "--lora-targets", "all-linear", "--lora-dropout", "0.05", "--tricks", "bf16,flash,ckpt",
                "--completion-len", "1024", "--beta", "0.04", "--vllm", "colocate", "--vllm-util", "0.35",
                "--vllm-sleep", "--format", "json")  # fmt: skip
    assert r.exit_code == 0 and typed.exit_code == 0, r.output + typed.output
    a, b = json.loads(r.stdout), json.loads(typed.stdout)
    assert a["verdict"] == b["verdict"] and a["rollout"] == b["rollout"]
    for args, said in ((["--seq", "1536"], "give --rl grpo"), (["--rl", "grpo"], "give --seq")):
        refused = run("estimate", "--from", str(path), "--model", "qwen2.5-7b", *args)
        assert refused.exit_code == 2 and said in refused.output and "Traceback" not in refused.output, refused.output


@examples(2, slow=10)
@given(model=st.sampled_from(["llama3.2-1b", "qwen3-0.6b"]), completion=st.sampled_from(["128", "768"]),
       rows=st.sampled_from([1, 2]), how=st.sampled_from([["--lora", "8"], ["--lora", "8", "--quantize", "nf4"], []]),
       engine=st.sampled_from([[], ["--vllm", "colocate"], ["--vllm", "colocate", "--vllm-sleep"]]))  # fmt: skip
def test_grpo_jobs_say_one_verdict_and_grow_with_the_batch(model, completion, rows, how, engine):
    """Every GRPO job: table, JSON and CSV give the same verdict and phases; a prompt group more never needs less, in
    the step, nor in the rollout where the policy generates itself."""
    assume(not ("--quantize" in how and engine))  # refused: vLLM's bitsandbytes weights (test_refused)
    args = ["estimate", "--model", model, "--seq", "1024", "--rl", "grpo", "--completion-len", completion, *how,
            *engine, "--num-generations", "2", "--tricks", "bf16,flash,ckpt", "--gpu", "rtx4090"]  # fmt: skip
    rows *= 2  # whole prompt groups of 2
    data = json.loads(run(*args, "--micro-batch", str(rows), "--format", "json").stdout)
    more = json.loads(run(*args, "--micro-batch", str(rows + 2), "--format", "json").stdout)
    v = data["verdict"][0]
    assert more["verdict"][0]["peak_bytes"] > v["peak_bytes"]
    table = run(*args, "--micro-batch", str(rows)).output
    csv_rows = list(csv.DictReader(io.StringIO(run(*args, "--micro-batch", str(rows), "--format", "csv").stdout)))
    assert (csv_rows[0]["fits"], int(csv_rows[0]["peak_bytes"])) == (str(v["fits"]), v["peak_bytes"])
    fits = data["rollout"]["phases"][0]["fits"]  # beside vLLM, or the policy's own generate (no --vllm)
    assert ("  yes\n" in table) == fits and csv_rows[0]["phases_fit"] == str(fits)
    if not engine:  # vLLM's budget is the card's share whatever the batch (its cache takes what its runner leaves)
        assert more["rollout"]["phases"][0]["rollout_bytes"] > data["rollout"]["phases"][0]["rollout_bytes"]


def test_the_toolbox_keeps_to_what_vllm_loads():
    """QLoRA is no fix beside vLLM (TRL starts it with bitsandbytes weights, refused): the toolbox does not offer it."""
    r = run("estimate", *JOB[:-1], "rtx4090", "--vllm", "colocate")
    assert r.exit_code == 0 and "Does not fit" in r.output and "nf4" not in r.output, r.output


@pytest.mark.parametrize("rows,said", [(8, "its default"), (32, "not modelled")])
def test_generation_batch_size_in_a_file(tmp_path, rows, said):
    """generation_batch_size sizes the buffered batch and the rows generated at once: its default
    (per_device_train_batch_size x GPUs x accumulation) is what the answer holds, another value is said not
    modelled."""
    path = tmp_path / "grpo.yaml"
    path.write_text(GRPO_FILE.replace("use_vllm: true", "use_vllm: false") + f"generation_batch_size: {rows}\n")
    r = run("estimate", "--from", str(path), "--rl", "grpo", "--model", "qwen2.5-7b", "--seq", "1536", "--detail")
    assert r.exit_code == 0, r.output
    row = " ".join(r.output.split("generation_batch_size", 1)[1].split("attn_implementation", 1)[0].split())
    assert said in row and ("8 completions over the GPUs" in row) == (rows != 8), row
