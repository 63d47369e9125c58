"""Hostile config.json and calibration files: every one is refused in one line, exit code 2, with a
bounded read (issue 10, defects 4 and 8)."""

import json
import os

import pytest
from typer.testing import CliRunner

from memcalc.cli import app
from memcalc.errors import InputError
from memcalc.model.hfconfig import config_model
from memcalc.model.jsonfile import MAX_BYTES
from memcalc.time.calibration import calibration_for

WIDE = {"COLUMNS": "200", "TERMINAL_WIDTH": "200", "NO_COLOR": "1"}
CONFIG = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
          "num_key_value_heads": 2, "intermediate_size": 160, "vocab_size": 200}  # fmt: skip
CALIBRATION = {"format": "memcalc-calibration/1", "gpu": "h100-sxm",
               "parameters": {"matmul": {"value": 0.7, "provenance": "measured"}}}  # fmt: skip
HUGE_INT = "1" * 5000  # past Python's 4,300-digit int conversion limit: ValueError before the fix
WIDE_INT = "9" * 400  # an int no float holds: OverflowError where a fraction is expected
DEEP = "[" * 100_000 + "]" * 100_000  # RecursionError in the JSON decoder


def with_value(base: dict, key: str, raw: str) -> str:
    """base as JSON text with key's value replaced by raw JSON text (which json.dumps cannot write)."""
    return json.dumps({**base, key: "@@"}).replace('"@@"', raw)


def with_cal_value(raw: str) -> str:
    return json.dumps(CALIBRATION).replace("0.7", raw)


HOSTILE_CONFIGS = {
    "huge int": with_value(CONFIG, "hidden_size", HUGE_INT),
    "deep nesting": DEEP,
    "deep nesting in a field": with_value(CONFIG, "hidden_size", DEEP),
    "wide int as a fraction": with_value(CONFIG, "attention_dropout", WIDE_INT),
    "float overflow to inf": with_value(CONFIG, "attention_dropout", "1e400"),
    "NaN literal": with_value(CONFIG, "attention_dropout", "NaN"),
    "Infinity literal": with_value(CONFIG, "hidden_size", "Infinity"),
    "-Infinity literal": with_value(CONFIG, "attention_dropout", "-Infinity"),
    "list": "[1, 2]",
    "number": "42",
    "null": "null",
    "string head_dim": with_value(CONFIG, "head_dim", '"16"'),
    "float kv heads": with_value(CONFIG, "num_key_value_heads", "2.5"),
    "object ffn": with_value(CONFIG, "intermediate_size", '{"a": 1}'),
    "string model_type": with_value(CONFIG, "model_type", '["llama"]'),
}
HOSTILE_CALIBRATIONS = {
    "huge int": with_cal_value(HUGE_INT),
    "wide int": with_cal_value(WIDE_INT),
    "deep nesting": DEEP,
    "float overflow to inf": with_cal_value("1e400"),
    "NaN literal": with_cal_value("NaN"),
    "Infinity literal": with_cal_value("Infinity"),
    "list": "[]",
    "string value": with_cal_value('"0.7"'),
    "bool value": with_cal_value("true"),
}


def run(*args):
    return CliRunner().invoke(app, list(args), env=WIDE)


def one_line_exit_2(result) -> str:
    assert result.exit_code == 2, (result.exit_code, result.output[-500:])
    assert "Traceback" not in result.output
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr[-500:]
    assert len(lines[0]) < 300, lines[0][:300]  # the offending value is shown briefly, not echoed whole
    return lines[0]


@pytest.mark.parametrize("name", HOSTILE_CONFIGS)
def test_hostile_config_is_one_line(tmp_path, name):
    """Defect 4: every malformed config.json is an InputError, and one line with exit 2 from the CLI."""
    path = tmp_path / "config.json"
    path.write_text(HOSTILE_CONFIGS[name])
    with pytest.raises(InputError):
        config_model(path)
    one_line_exit_2(run("estimate", "--config", str(path)))


@pytest.mark.parametrize("name", HOSTILE_CALIBRATIONS)
def test_hostile_calibration_is_one_line(tmp_path, name):
    """Defect 4: every malformed calibration file is an InputError, and one line with exit 2 from the CLI."""
    path = tmp_path / "cal.json"
    path.write_text(HOSTILE_CALIBRATIONS[name])
    with pytest.raises(InputError):
        calibration_for("h100-sxm", str(path))
    one_line_exit_2(run("estimate", "--params", "8e9", "--calibration", str(path)))


@pytest.mark.parametrize("flag", ["--config", "--calibration"])
def test_file_size_is_capped(tmp_path, flag):
    """Defect 4: a file over MAX_BYTES (1 MiB) is refused without being read whole, even valid JSON."""
    path = tmp_path / "big.json"
    body = CONFIG if flag == "--config" else CALIBRATION
    path.write_text(json.dumps(body) + " " * MAX_BYTES)
    args = ["--config", str(path)] if flag == "--config" else ["--params", "8e9", "--calibration", str(path)]
    assert "1 MiB" in one_line_exit_2(run("estimate", *args))


def file_args(flag: str, path) -> list[str]:
    return ["--config", str(path)] if flag == "--config" else ["--params", "8e9", "--calibration", str(path)]


@pytest.mark.skipif(not os.path.exists("/dev/zero"), reason="needs /dev/zero")
@pytest.mark.parametrize("flag", ["--config", "--calibration"])
def test_dev_zero_is_refused_without_eating_memory(flag):
    """Defect 4: --config /dev/zero read without end before the fix; now it is refused unread (not a file)."""
    assert "not a regular file" in one_line_exit_2(run("estimate", *file_args(flag, "/dev/zero")))


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs named pipes")
@pytest.mark.parametrize("flag", ["--config", "--calibration"])
def test_a_named_pipe_is_refused_without_waiting_for_a_writer(tmp_path, flag):
    """--config FIFO blocked forever in open(); the CLI runs in a subprocess so that the test cannot hang."""
    import subprocess
    import sys

    fifo = tmp_path / "config.json"
    os.mkfifo(fifo)
    out = subprocess.run([sys.executable, "-m", "memcalc", "estimate", *file_args(flag, fifo)],
                         capture_output=True, text=True, timeout=60)  # fmt: skip
    assert out.returncode == 2 and out.stderr.count("\n") == 1, out.stderr[-500:]
    assert out.stderr.startswith("error: ") and "not a regular file" in out.stderr


@pytest.mark.parametrize("flag", ["--config", "--calibration"])
def test_a_utf8_byte_order_mark_is_read(tmp_path, flag):
    """A config.json saved with a BOM (Windows editors) was refused with json's "Unexpected UTF-8 BOM"."""
    path = tmp_path / "with-bom.json"
    path.write_bytes(b"\xef\xbb\xbf" + json.dumps(CONFIG if flag == "--config" else CALIBRATION).encode())
    out = run("estimate", *file_args(flag, path), "--seq", "128", "--tricks", "bf16")
    assert out.exit_code == 0, out.output[-500:]


def test_a_whole_number_written_as_a_float_is_read(tmp_path):
    """"hidden_size": 256.0 was refused as "must be a whole number, got 256.0"; 256.5 still is."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**CONFIG, "hidden_size": 256.0, "num_hidden_layers": 2.0}))
    assert (config_model(path).shape.hidden, config_model(path).shape.n_layers) == (256, 2)
    path.write_text(with_value(CONFIG, "hidden_size", "256.5"))
    message = one_line_exit_2(run("estimate", "--config", str(path)))
    assert message == "error: config 'hidden_size' must be a whole number, got 256.5"


@pytest.mark.parametrize("flag", ["--config", "--calibration"])
def test_unreadable_paths(tmp_path, flag):
    """Defect 4: a folder, and bytes that are not UTF-8, are one line too."""
    binary = tmp_path / "weights.safetensors"
    binary.write_bytes(b"\xff\xfe\x00\x81" * 100)
    for path in (tmp_path, binary):
        args = ["--config", str(path)] if flag == "--config" else ["--params", "8e9", "--calibration", str(path)]
        one_line_exit_2(run("estimate", *args))


@pytest.mark.parametrize("value", ['"false"', '"true"', "0", "1", '"no"', "[]"])
def test_tie_word_embeddings_must_be_a_json_boolean(tmp_path, value):
    """Defect 8: "tie_word_embeddings": "false" (a string) was read as true; a non-boolean is refused."""
    path = tmp_path / "config.json"
    path.write_text(with_value(CONFIG, "tie_word_embeddings", value))
    with pytest.raises(InputError, match="tie_word_embeddings.*true or false"):
        config_model(path)
    one_line_exit_2(run("estimate", "--config", str(path)))


@pytest.mark.parametrize("value,tied", [("false", False), ("true", True), ("null", False)])
def test_tie_word_embeddings_booleans_are_read(tmp_path, value, tied):
    """Defect 8: JSON booleans are read as themselves; null takes the architecture's default (llama: untied)."""
    path = tmp_path / "config.json"
    path.write_text(with_value(CONFIG, "tie_word_embeddings", value))
    assert config_model(path).shape.tied_embeddings is tied


def test_a_valid_config_still_reads(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**CONFIG, "attention_dropout": 0.0, "rope_theta": 500000.0, "eos_token_id": 2}))
    assert config_model(path).shape.hidden == 64
