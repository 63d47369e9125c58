"""`memcalc estimate --from FILE` and `memcalc fit --from FILE` (issue 40, item 3): a TRL/Transformers arguments
file, an axolotl config and a torchtune recipe config read into the options the command line builds, the typed
ones winning, each key reported used, default, overridden, not modelled, ignored or not read, in the table and in
the JSON; and the answer the same as for the options typed out."""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from memcalc.cli import app
from tests.test_hub import ENV, cache_with

ROOT = Path(__file__).resolve().parents[1]
RECIPES = ROOT / "examples" / "recipes"
TRL = RECIPES / "trl-zephyr-7b-qlora.yaml"
AXOLOTL = RECIPES / "axolotl-llama3-8b-qlora.yml"
TORCHTUNE = RECIPES / "torchtune-llama2-7b-lora.yaml"
HUB = {"mistralai/Mistral-7B-v0.1": "mistral-7b.json", "NousResearch/Meta-Llama-3-8B": "llama3-8b.json"}
# each example as the options typed out (the keys' meaning is the readers' docstrings and docs/finetune.md)
TYPED = {
    TRL: ["--model", "mistralai/Mistral-7B-v0.1", "--stack", "trl:0.25", "--recipe", "pure", "--tricks",
          "bf16,flash,ckpt", "--quantize", "nf4", "--lora", "16", "--lora-dropout", "0.05", "--lora-targets",
          "q,k,v,o,gate,up,down", "--grad-accum", "2", "--seq", "2048", "--micro-batch", "4"],
    AXOLOTL: ["--model", "NousResearch/Meta-Llama-3-8B", "--stack", "hf", "--recipe", "pure", "--tricks",
              "bf16,flash,ckpt", "--quantize", "nf4", "--lora", "32", "--lora-dropout", "0.05", "--lora-targets",
              "all-linear", "--grad-accum", "4", "--seq", "4096", "--micro-batch", "2", "--optimizer", "paged-adamw",
              "--optimizer-impl", "loop", "--reentrant"],  # axolotl's use_reentrant default
    TORCHTUNE: ["--model", "llama2-7b", "--stack", "torchtune", "--loss", "full", "--tricks", "bf16,flash,ckpt",
                "--lora", "8", "--lora-targets", "q,v", "--grad-accum", "64", "--micro-batch", "2", "--optimizer",
                "adamw", "--optimizer-impl", "foreach"],
}  # fmt: skip


@pytest.fixture
def hub(monkeypatch, tmp_path):
    """The examples' Hub ids in a cache that holds their config.json alone, offline."""
    for name in ENV:
        monkeypatch.delenv(name, raising=False)
    for repo, config in HUB.items():
        cache_with(tmp_path / "cache", repo, ROOT / "examples" / "configs" / config)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def run(*args: str, code: int = 0):
    out = CliRunner().invoke(app, [str(a) for a in args])
    assert out.exit_code == code, out.output
    return out


def answer(*args: str) -> dict:
    return json.loads(run(*args, "--format", "json").stdout)


def uses(data: dict) -> dict[str, tuple[str, str]]:
    return {k["key"]: (k["use"], k["note"]) for k in data["from"]["keys"]}


@pytest.mark.parametrize("recipe", [TRL, AXOLOTL, TORCHTUNE], ids=lambda p: p.name)
def test_the_file_answers_as_its_options_typed_out(hub, recipe):
    """One code path: the file is turned into the options the command line gives, so the answer is the same."""
    read = answer("estimate", "--from", recipe, "--gpu", "a100-80gb")
    typed = answer("estimate", *TYPED[recipe], "--gpu", "a100-80gb")
    assert read.pop("from")["file"] == str(recipe)
    assert read == typed


def test_each_kind_is_told_by_its_keys(hub):
    kinds = {recipe: answer("estimate", "--from", recipe)["from"]["kind"] for recipe in TYPED}
    assert kinds == {TRL: "trainer", AXOLOTL: "axolotl", TORCHTUNE: "torchtune"}


def test_the_trl_file_keys_and_the_stack_it_picks(hub):
    data = answer("estimate", "--from", TRL)
    keys = uses(data)
    assert keys["load_in_4bit"] == ("used", "--quantize nf4") and keys["max_length"] == ("used", "--seq 2048")
    assert keys["torch_dtype"][1].startswith("--recipe pure")
    assert keys["learning_rate"] == ("ignored", "does not change memory")
    assert keys["optim"][0] == "default"  # the Trainer's adamw_torch_fused, the stack's own
    assert "double quantisation" in next(k for k in data["from"]["keys"] if k["key"] == "load_in_4bit")["not_modelled"]
    assert data["from"]["remarks"][0].startswith("--stack trl:0.25")
    assert data["setup"]["stack"]["key"] == "trl:0.25"


def test_typed_options_win_and_the_keys_say_so(hub):
    data = answer("estimate", "--from", AXOLOTL, "--seq", "1024", "--model", "llama3-8b", "--tricks", "bf16,flash")
    keys = uses(data)
    assert data["setup"]["seq_len"] == 1024 and data["trick_sets"] == [["bf16", "flash"]]
    assert keys["sequence_len"] == ("overridden", "--seq typed in its place")
    assert keys["base_model"] == ("overridden", "--model typed in its place")
    assert keys["gradient_checkpointing"][0] == "overridden"
    assert keys["bf16"][0] == "used" and "--recipe pure" in keys["bf16"][1]  # it set --recipe too, not typed
    assert keys["bf16"][1].endswith("--tricks typed in its place")
    assert keys["micro_batch_size"] == ("used", "--micro-batch 2")  # what was not typed still comes from the file
    assert data["model"]["shape"]["name"] == "llama3-8b"


def test_the_table_shows_the_keys_before_the_answer(hub):
    out = run("estimate", "--from", TORCHTUNE, "--gpu", "rtx4090", "--seq", "2048")
    head = " ".join(out.stdout.split("Model: preset llama2-7b")[0].split())  # wrapped to the terminal's width
    assert head.startswith(f"From {TORCHTUNE} (torchtune recipe config)")
    for row in ("model.lora_rank", "--lora 8", "tokenizer.max_seq_len", "overridden: --seq typed in its place",
                "ignored, as they do not change memory: model.apply_lora_to_output", "--loss full",
                "--stack torchtune: the single-device recipe replayed as torchtune runs it"):
        assert row in head, row
    assert "not modelled" not in out.stderr  # torchtune's own LoRALinear, adapters in bf16: nothing stood in for


def test_csv_stays_one_table_and_markdown_shows_the_keys(hub):
    out = run("estimate", "--from", AXOLOTL, "--format", "csv")
    rows = list(csv.reader(io.StringIO(out.stdout)))
    assert rows[0][0] == "tricks" and len(rows) == 2 and "sequence_len" in out.stderr
    markdown = run("estimate", "--from", AXOLOTL, "--format", "markdown").stdout
    assert markdown.startswith(f"### From {AXOLOTL}") or f"From {AXOLOTL}" in markdown.split("\n")[0]


@pytest.mark.slow("test_the_file_answers_as_its_options_typed_out[axolotl-llama3-8b-qlora.yml] (estimate's verdict, "
                  "which fit searches with)")
def test_fit_takes_the_file_too(hub):
    data = answer("fit", "--from", AXOLOTL, "--gpu", "rtx4090")
    keys = uses(data)
    assert data["micro_batch"] == 2 and data["max_seq_len"] > 0
    assert keys["gradient_accumulation_steps"][0] != "not modelled"  # fit solves the step as it accumulates
    same = answer("fit", *TYPED[AXOLOTL], "--gpu", "rtx4090")
    assert {k: v for k, v in data.items() if k != "from"} == same


def write(tmp_path: Path, text: str, name: str = "run.yml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


AXOLOTL_SMALL = "base_model: qwen3-0.6b\nsequence_len: {seq}\nmicro_batch_size: {mb}\n{more}"
TRAINER_SMALL = {"model_name_or_path": "qwen3-0.6b", "max_length": 256, "per_device_train_batch_size": 2}


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seq=st.sampled_from([128, 384]), mb=st.integers(1, 3), ckpt=st.booleans(), precision=st.sampled_from(["bf16",
       "fp16", "fp32"]), flash=st.booleans(), rank=st.sampled_from([0, 4]), targets=st.sampled_from(["q,v", "all"]))  # fmt: skip
def test_any_axolotl_file_answers_as_typed(tmp_path, seq, mb, ckpt, precision, flash, rank, targets):
    """Property: whatever an axolotl file sets among what memcalc models, --from gives the typed answer."""
    more = f"gradient_checkpointing: {str(ckpt).lower()}\nattn_implementation: {'sdpa' if flash else 'eager'}\n"
    more += {"bf16": "bf16: true\n", "fp16": "fp16: true\nbf16: false\n", "fp32": "bf16: false\n"}[precision]
    tricks = ",".join([precision] + ["flash"] * flash + ["ckpt"] * ckpt)
    typed = ["--model", "qwen3-0.6b", "--seq", str(seq), "--micro-batch", str(mb), "--tricks", tricks, "--stack", "hf"]
    typed += ["--recipe", "pure"] if precision != "fp32" else []
    typed += ["--reentrant"] if ckpt else []  # axolotl's use_reentrant default
    if rank:
        more += f"adapter: lora\nlora_r: {rank}\n" + ("lora_target_linear: true\n" if targets == "all" else
                                                     "lora_target_modules: [q_proj, v_proj]\n")  # fmt: skip
        typed += ["--lora", str(rank), "--lora-targets", "all-linear" if targets == "all" else "q,v"]
    path = write(tmp_path, AXOLOTL_SMALL.format(seq=seq, mb=mb, more=more))
    read = answer("estimate", "--from", path)
    read.pop("from")
    assert read == answer("estimate", *typed)


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(stack=st.sampled_from([None, "hf", "trl:0.14", "trl:0.21"]), ckpt=st.sampled_from([None, True, False]),
       bf16=st.sampled_from([None, True, False]))  # fmt: skip
def test_trl_defaults_follow_the_release_line(tmp_path, stack, ckpt, bf16):
    """SFTConfig's defaults are the TRL line's: bf16 on from 0.19 (trl:0.21, trl:0.25), checkpointing on from 0.22
    (trl:0.25); the Trainer's (hf) neither. A key the file sets is taken as it is."""
    config = dict(TRAINER_SMALL) | ({} if ckpt is None else {"gradient_checkpointing": ckpt})
    config |= {} if bf16 is None else {"bf16": bf16}
    path = write(tmp_path, json.dumps(config), "args.json")
    data = answer("estimate", "--from", path, *(["--stack", stack] if stack else []))
    line = stack or "trl:0.25"
    (tricks,) = data["trick_sets"]
    assert tricks[0] == ("bf16" if bf16 or bf16 is None and line in ("trl:0.21", "trl:0.25") else "fp32")
    assert ("ckpt" in tricks) == bool(ckpt or ckpt is None and line == "trl:0.25")
    assert data["setup"]["stack"]["key"] == line and data["setup"]["micro_batch"] == 2


def test_nested_sections_and_a_deepspeed_config(tmp_path):
    """model_init_kwargs (dtype, attention, a BitsAndBytesConfig) and a PEFT peft_config section; a DeepSpeed
    JSON named by its path, read beside the file: the same answer as typed."""
    args = TRAINER_SMALL | {"per_device_train_batch_size": 1, "model_init_kwargs": {
        "dtype": "bfloat16", "attn_implementation": "eager", "device_map": "auto",
        "quantization_config": {"load_in_4bit": True, "bnb_4bit_use_double_quant": True}},
        "peft_config": {"r": 8, "target_modules": ["q_proj", "k_proj"], "lora_dropout": 0.1, "task_type": "CAUSAL_LM"}}
    read = answer("estimate", "--from", write(tmp_path, json.dumps(args), "sft.json"))
    assert not [k for k in read["from"]["keys"] if k["use"] in ("not read", "not modelled") or k["not_modelled"]]
    typed = ["--model", "qwen3-0.6b", "--stack", "trl:0.25", "--recipe", "pure", "--tricks", "bf16,ckpt", "--quantize",
             "nf4", "--lora", "8", "--lora-targets", "q,k", "--lora-dropout", "0.1", "--seq", "256"]
    assert {k: v for k, v in read.items() if k != "from"} == answer("estimate", *typed)
    write(tmp_path, json.dumps({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}), "ds.json")
    full = write(tmp_path, json.dumps(TRAINER_SMALL | {"deepspeed": "ds.json", "bf16": True}), "full.json")
    read = answer("estimate", "--from", full, "--gpus", "4")
    assert uses(read)["deepspeed"] == ("used", "--zero 2; --offload")
    same = answer("estimate", "--model", "qwen3-0.6b", "--stack", "trl:0.25", "--tricks", "bf16,flash,ckpt", "--seq",
                  "256", "--micro-batch", "2", "--zero", "2", "--offload", "--gpus", "4")
    assert {k: v for k, v in read.items() if k != "from"} == same


def test_use_dora_reads_as_dora(tmp_path):
    """use_dora (TRL's ModelConfig, a PEFT LoraConfig section) and axolotl's peft_use_dora: --dora, the same
    answer as typed."""
    trl = write(tmp_path, json.dumps(TRAINER_SMALL | {"use_peft": True, "lora_r": 8, "use_dora": True}), "dora.json")
    read = answer("estimate", "--from", trl)
    assert uses(read)["use_dora"] == ("used", "--dora")
    typed = answer("estimate", "--model", "qwen3-0.6b", "--stack", "trl:0.25", "--tricks", "bf16,flash,ckpt", "--seq",
                   "256", "--micro-batch", "2", "--lora", "8", "--lora-dropout", "0.05", "--lora-targets", "q,v",
                   "--dora")  # fmt: skip
    assert {k: v for k, v in read.items() if k != "from"} == typed
    section = TRAINER_SMALL | {"peft_config": {"r": 8, "use_dora": True, "task_type": "CAUSAL_LM"}}
    assert uses(answer("estimate", "--from", write(tmp_path, json.dumps(section), "s.json")))["peft_config.use_dora"] \
        == ("used", "--dora")  # fmt: skip
    axolotl = write(tmp_path, "base_model: Qwen/Qwen3-0.6B\nadapter: lora\nlora_r: 8\nlora_target_linear: true\n"
                              "peft_use_dora: true\nsequence_len: 256\nbf16: true\n", "run.yml")  # fmt: skip
    assert uses(answer("estimate", "--from", axolotl, "--model", "qwen3-0.6b"))["peft_use_dora"] == ("used", "--dora")


def test_modules_to_save_reads_as_typed(tmp_path):
    """TRL's lora_modules_to_save, a LoraConfig section's modules_to_save and axolotl's lora_modules_to_save:
    --modules-to-save (the embedding and the head trained whole, as PEFT's copies)."""
    trl = TRAINER_SMALL | {"use_peft": True, "lora_r": 8, "lora_modules_to_save": ["embed_tokens", "lm_head"]}
    read = answer("estimate", "--from", write(tmp_path, json.dumps(trl), "saved.json"), "--model", "qwen3-8b")
    assert uses(read)["lora_modules_to_save"] == ("used", "--modules-to-save embed_tokens,lm_head")
    typed = answer("estimate", "--model", "qwen3-8b", "--stack", "trl:0.25", "--tricks", "bf16,flash,ckpt", "--seq",
                   "256", "--micro-batch", "2", "--lora", "8", "--lora-dropout", "0.05", "--lora-targets", "q,v",
                   "--modules-to-save", "embed_tokens,lm_head")  # fmt: skip
    assert {k: v for k, v in read.items() if k != "from"} == typed
    axolotl = write(tmp_path, "base_model: Qwen/Qwen3-8B\nadapter: lora\nlora_r: 8\nlora_target_linear: true\n"
                              "lora_modules_to_save: [lm_head]\nsequence_len: 256\nbf16: true\n", "run.yml")  # fmt: skip
    assert uses(answer("estimate", "--from", axolotl, "--model", "qwen3-8b"))["lora_modules_to_save"] == \
        ("used", "--modules-to-save lm_head")  # fmt: skip
