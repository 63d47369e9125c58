"""`--from FILE` refuses in one line, exit code 2, naming the file and its key: a bad file (missing, not YAML or
JSON, not a mapping, a wrong type, an unknown model, a kind its keys leave open, YAML aliases that repeat or
refer to themselves), a key memcalc refuses elsewhere (LoRA sharded by FSDP or ZeRO, the 8-bit base, an
optimizer it does not model), and the memory savers it does not replay (activation offloading in torchtune's
recipes; its chunked loss and optimizer step in backward where --stack torchtune does not run the recipe; fused
linear cross-entropy, Liger's or torchtune's), which would make its answer overstate the peak the recipe was
written to avoid."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from memcalc.cli import app

ROOT = Path(__file__).resolve().parents[1]
LOW_MEMORY = ROOT / "examples" / "recipes" / "torchtune-llama2-7b-full-low-memory.yaml"
AXOLOTL = "base_model: qwen3-0.6b\nsequence_len: 256\n"
TORCHTUNE = "model:\n  _component_: torchtune.models.llama3_2.llama3_2_1b\nbatch_size: 1\ndtype: bf16\n"
TRAINER = {"model_name_or_path": "qwen3-0.6b", "max_length": 256}


def refused(*args: str) -> str:
    out = CliRunner().invoke(app, ["estimate", *map(str, args)])
    assert out.exit_code == 2, out.output
    assert out.stdout == "" and out.stderr.count("\n") == 1 and out.stderr.startswith("error: "), out.output
    return out.stderr


def file(tmp_path: Path, text: str, name: str = "run.yml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


BAD = {
    "missing": None,
    "not yaml": "a: [1\n",
    "a list": "- 1\n- 2\n",
    "empty": "",
    "a wrong type": AXOLOTL + "micro_batch_size: two\n",
    "a bool for a number": AXOLOTL + "micro_batch_size: true\n",
    "zero": AXOLOTL + "micro_batch_size: 0\n",
    "an unknown model": "base_model: no-such-model\n",
    "a python tag": "base_model: !!python/object/apply:os.system ['true']\n",
    "a date": AXOLOTL + "seed: 2024-01-01\n",
    "NaN": AXOLOTL + "lora_dropout: .nan\n",
    "a huge integer": AXOLOTL + "micro_batch_size: " + "1" * 5000 + "\n",
    "a self-referring alias": "a: &x [*x]\n",
    "an alias bomb": "a: &a [1, 1, 1, 1, 1, 1, 1, 1, 1]\n" + "".join(
        f"{chr(98 + i)}: &{chr(98 + i)} [{', '.join(['*' + chr(97 + i)] * 9)}]\n" for i in range(8)),
    "no kind": "learning_rate: 0.1\nseed: 1\n",
}  # fmt: skip
SAID = {"missing": "not found", "not yaml": "not valid YAML", "a list": "mapping of keys", "empty": "it is empty",
        "a wrong type": "micro_batch_size must be a whole number", "a bool for a number": "micro_batch_size must",
        "zero": "micro_batch_size must be a whole number from 1", "an unknown model": "base_model: no-such-model",
        "a python tag": "not valid YAML", "a date": "not plain data", "NaN": "not a number",
        "a huge integer": "not a number", "a self-referring alias": "refers to itself",
        "an alias bomb": "more than 20,000 values", "no kind": "name it: --from trainer:"}  # fmt: skip


@pytest.mark.parametrize("case", BAD)
def test_a_bad_file_is_one_line(tmp_path, case):
    path = tmp_path / "absent.yml" if BAD[case] is None else file(tmp_path, BAD[case])
    assert SAID[case] in refused("--from", path)


def test_bad_json_and_a_folder(tmp_path):
    assert "not valid JSON" in refused("--from", file(tmp_path, "{", "args.json"))
    assert "not a regular file" in refused("--from", tmp_path)


REFUSED = {  # (file text, name, the key the line names, what it says)
    "lora under fsdp": (AXOLOTL + "adapter: lora\nlora_r: 8\nlora_target_linear: true\nfsdp: [full_shard]\n",
                        "run.yml", "fsdp: [full_shard]", "--stack fsdp2 --zero 3"),
    "lora under zero-3 without its GPUs": (json.dumps(TRAINER | {"use_peft": True,
                                                                 "deepspeed": {"zero_optimization": {"stage": 3}}}),
                                           "args.json", "deepspeed", "add --gpus N"),
    "a sharded recipe without its GPUs": (AXOLOTL + "fsdp: [full_shard]\n", "run.yml", "fsdp", "add --gpus N"),
    "the 8-bit base": (AXOLOTL + "adapter: lora\nlora_r: 8\nload_in_8bit: true\n", "run.yml", "load_in_8bit",
                       "depends on the data"),
    "modules_to_save": (json.dumps(TRAINER | {"use_peft": True, "lora_modules_to_save": ["lm_head", "norm"]}),
                        "args.json", "lora_modules_to_save", "embed_tokens and lm_head trained whole"),
    "an optimizer not modelled": (json.dumps(TRAINER | {"optim": "adafactor"}), "args.json", "optim: adafactor",
                                  "memcalc models AdamW"),
    "liger's kernels chosen": (json.dumps(TRAINER | {"use_liger_kernel": True,
                                                     "liger_kernel_config": {"rope": False}}),
                               "args.json", "liger_kernel_config", "other than its defaults"),
    "trl's activation offloading": (json.dumps(TRAINER | {"activation_offloading": True}), "args.json",
                                    "activation_offloading", "overstate"),
    "axolotl's offload": (AXOLOTL + "gradient_checkpointing: offload\n", "run.yml", "gradient_checkpointing",
                          "overstate"),
    "axolotl's liger": (AXOLOTL + "plugins: [axolotl.integrations.liger.LigerPlugin]\n"
                        "liger_fused_linear_cross_entropy: true\n", "run.yml", "liger_fused_linear_cross_entropy",
                        "overstate"),
    "preference training": (AXOLOTL + "rl: dpo\n", "run.yml", "rl: dpo", "--rl dpo"),
    "torchtune's fused loss": (TORCHTUNE + "loss:\n  _component_: torchtune.modules.loss.LinearCrossEntropyLoss\n",
                               "tt.yaml", "loss._component_", "overstate"),
    "torchtune's chunked loss off its stack": (TORCHTUNE.replace("bf16", "fp32") + "loss:\n  _component_: "
                                               "torchtune.modules.loss.CEWithChunkedOutputLoss\n", "tt.yaml",
                                               "loss._component_", "off --stack torchtune"),
    "the step in backward off its stack": (TORCHTUNE.replace("bf16", "fp32") + "optimizer_in_bwd: true\n", "tt.yaml",
                                           "optimizer_in_bwd", "overstate"),
    "torchtune's offloading": (TORCHTUNE + "enable_activation_offloading: true\n", "tt.yaml",
                               "enable_activation_offloading", "overstate"),
    "torchtune's lora on a tied output": (TORCHTUNE.replace("llama3_2_1b", "lora_llama3_2_1b\n  lora_attn_modules: "
                                                            "[q_proj]\n  apply_lora_to_output: true"), "tt.yaml",
                                          "--lora-targets from model.lora_attn_modules, model.apply_lora_to_output",
                                          "(tied)"),
    "a builder with no preset": (TORCHTUNE.replace("llama3_2_1b", "qwen2_5_7b_base"), "tt.yaml", "model._component_",
                                 "give --model or --config"),
}  # fmt: skip


@pytest.mark.parametrize("case", REFUSED)
def test_what_memcalc_refuses_names_the_key(tmp_path, case):
    text, name, key, said = REFUSED[case]
    line = refused("--from", file(tmp_path, text, name))
    assert f"{name}: {key}" in line and said in line, line


def test_a_published_recipe_with_its_savers_answers_as_torchtune_runs_it(monkeypatch):
    """torchtune's low-memory recipe (optimizer_in_bwd, PagedAdamW) was refused while memcalc did not replay its
    savers; --stack torchtune does: it answers as the options typed out."""
    monkeypatch.chdir(ROOT)
    read = CliRunner().invoke(app, ["estimate", "--from", str(LOW_MEMORY.relative_to(ROOT)), "--format", "json"])
    typed = CliRunner().invoke(app, ["estimate", "--model", "llama2-7b", "--stack", "torchtune", "--loss", "full",
                                     "--optimizer-in-backward", "--optimizer", "paged-adamw", "--optimizer-impl",
                                     "loop", "--micro-batch", "2", "--grad-accum", "1", "--tricks", "bf16,flash,ckpt",
                                     "--format", "json"])  # fmt: skip
    assert read.exit_code == 0 and typed.exit_code == 0, read.output + typed.output
    data = json.loads(read.stdout)
    assert data.pop("from")["remarks"][0].startswith("--stack torchtune") and data == json.loads(typed.stdout)


def test_typing_the_option_lifts_what_it_decides(tmp_path):
    """--zero typed replaces the file's sharding (LoRA then answers); --gpus gives what the file cannot say; a
    typed --model stands in for a torchtune builder with no preset."""
    lora = file(tmp_path, REFUSED["lora under fsdp"][0])
    out = CliRunner().invoke(app, ["estimate", "--from", str(lora), "--zero", "0", "--format", "json"])
    assert out.exit_code == 0, out.output
    assert {k["key"]: k["use"] for k in json.loads(out.stdout)["from"]["keys"]}["fsdp"] == "overridden"
    sharded = file(tmp_path, REFUSED["a sharded recipe without its GPUs"][0], "full.yml")
    out = CliRunner().invoke(app, ["estimate", "--from", str(sharded), "--gpus", "8", "--format", "json"])
    assert out.exit_code == 0 and json.loads(out.stdout)["layout"]["zero"] == 3, out.output
    builder = file(tmp_path, REFUSED["a builder with no preset"][0], "tt.yaml")
    assert CliRunner().invoke(app, ["estimate", "--from", str(builder), "--model", "qwen3-8b"]).exit_code == 0


def test_a_refusal_of_an_option_the_file_set_names_its_key(tmp_path):
    """The engine's refusal of an option names the file's key behind it."""
    line = refused("--from", file(tmp_path, AXOLOTL + "micro_batch_size: 100000000\n"))
    assert line.rstrip().endswith("run.yml: --micro-batch from micro_batch_size)"), line


def test_bf16_auto_is_fp16_on_a_card_without_bf16(tmp_path):
    """axolotl's bf16: auto (its default) picks fp16 on a V100 (utils/config resolve_dtype)."""
    path = file(tmp_path, AXOLOTL)
    out = CliRunner().invoke(app, ["estimate", "--from", str(path), "--gpu", "v100-32gb", "--format", "json"])
    assert out.exit_code == 0 and json.loads(out.stdout)["trick_sets"] == [["fp16", "flash"]], out.output


def test_a_kind_named_in_the_path_decides(tmp_path):
    path = file(tmp_path, "gradient_accumulation_steps: 2\nmodel_name_or_path: qwen3-0.6b\nbase_model: qwen3-0.6b\n"
                          "micro_batch_size: 1\nper_device_train_batch_size: 1\n")  # fmt: skip
    assert "keys of trainer and axolotl alike" in refused("--from", path)
    for kind in ("trainer", "axolotl"):
        out = CliRunner().invoke(app, ["estimate", "--from", f"{kind}:{path}", "--format", "json"])
        assert out.exit_code == 0 and json.loads(out.stdout)["from"]["kind"] == kind, out.output


def test_torchtunes_distributed_lora_recipe_is_fsdp2_over_the_lora_model(tmp_path):
    """lora_finetune_distributed shards with fully_shard per layer: --stack fsdp2 --zero 3 over the GPUs typed (its
    LoRALinear as PEFT's, said), where axolotl's and the Trainer's LoRA under FSDP is refused (their stack is not
    FSDP2's); without --gpus it asks for them."""
    text = ("model:\n  _component_: torchtune.models.llama3_2.lora_llama3_2_1b\n  lora_attn_modules: [q_proj, v_proj]\n"
            "  lora_rank: 8\nbatch_size: 1\ndtype: bf16\nfsdp_cpu_offload: false\n"
            "loss:\n  _component_: torch.nn.CrossEntropyLoss\n")  # fmt: skip
    path = file(tmp_path, text, "tt.yaml")
    assert "add --gpus N" in refused("--from", path)
    out = CliRunner().invoke(app, ["estimate", "--from", str(path), "--gpus", "4", "--format", "json"])
    assert out.exit_code == 0, out.output
    data = json.loads(out.stdout)
    assert data["setup"]["stack"]["key"] == "fsdp2" and data["layout"]["zero"] == 3
    assert any("LoRALinear replayed as PEFT's" in k["not_modelled"] for k in data["from"]["keys"])


def test_torchtunes_lora_on_the_output_is_lm_head_among_the_targets(tmp_path):
    """apply_lora_to_output on an untied builder: the head's LoRALinear, replayed on --stack torchtune."""
    text = ("model:\n  _component_: torchtune.models.llama3_1.lora_llama3_1_8b\n  lora_attn_modules: [q_proj]\n"
            "  apply_lora_to_output: true\nbatch_size: 1\ndtype: bf16\ntokenizer:\n  max_seq_len: 512\n")  # fmt: skip
    out = CliRunner().invoke(app, ["estimate", "--from", str(file(tmp_path, text, "tt.yaml")), "--format", "json"])
    assert out.exit_code == 0, out.output
    data = json.loads(out.stdout)
    keys = {k["key"]: k["note"] for k in data["from"]["keys"]}
    assert keys["model.apply_lora_to_output"] == "lm_head in --lora-targets"
    assert data["setup"]["stack"]["key"] == "torchtune"
    assert data["setup"]["stack"]["finetune"]["targets"] == ["q_proj", "lm_head"]
