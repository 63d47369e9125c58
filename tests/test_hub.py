"""--model ORG/NAME and --config ORG/NAME: a Hugging Face Hub id, its config.json from the local cache first
(huggingface_hub's layout: models--ORG--NAME/refs/main -> snapshots/<commit>/config.json), offline with
HF_HUB_OFFLINE=1, downloaded alone (never the weights) through huggingface_hub otherwise."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from memcalc.cli import app
from memcalc.errors import InputError
from memcalc.model import hub
from memcalc.model.hfconfig import hub_model

ROOT = Path(__file__).resolve().parents[1]
LLAMA = ROOT / "examples" / "configs" / "llama3-8b.json"  # meta-llama/Meta-Llama-3-8B's config.json, as shipped
COMMIT = "d04e592bb4f6aa9cfee91e2e20afa771667e1d4b"
ENV = ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HOME", "XDG_CACHE_HOME", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")


def cache_with(root: Path, repo_id: str, config: Path = LLAMA, ref: str = "main") -> Path:
    """A Hub cache holding one model's config.json and nothing else."""
    repo = root / ("models--" + repo_id.replace("/", "--"))
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / ref).write_text(COMMIT)
    snapshot = repo / "snapshots" / COMMIT
    snapshot.mkdir(parents=True)
    shutil.copy(config, snapshot / "config.json")
    return root


@pytest.fixture
def env(monkeypatch, tmp_path):
    for name in ENV:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    return monkeypatch


def test_offline_from_a_cache_that_holds_only_the_config(env, tmp_path):
    """The issue's command: HF_HUB_OFFLINE=1 memcalc estimate --model meta-llama/Llama-3.1-8B."""
    env.setenv("HF_HUB_CACHE", str(cache_with(tmp_path / "cache", "meta-llama/Llama-3.1-8B")))
    env.setenv("HF_HUB_OFFLINE", "1")
    out = CliRunner().invoke(app, ["estimate", "--model", "meta-llama/Llama-3.1-8B", "--seq", "8192"])
    assert out.exit_code == 0, out.output
    assert "8,030,261,248 parameters" in out.output and "Hugging Face meta-llama/Llama-3.1-8B" in out.output
    assert f"snapshot {COMMIT[:12]}" in out.output
    same = CliRunner().invoke(app, ["estimate", "--config", "meta-llama/Llama-3.1-8B", "--seq", "8192"])
    assert same.exit_code == 0 and "8,030,261,248 parameters" in same.output


@pytest.mark.parametrize("variable, folder", [("HF_HOME", "hub"), ("XDG_CACHE_HOME", "huggingface/hub"),
                                              ("HUGGINGFACE_HUB_CACHE", "")])  # fmt: skip
def test_the_cache_is_found_as_huggingface_hub_finds_it(env, tmp_path, variable, folder):
    cache_with(tmp_path / "base" / folder, "org/model")
    env.setenv(variable, str(tmp_path / "base"))
    assert hub.cache_dir() == tmp_path / "base" / folder
    assert hub_model("org/model").n_params == 8_030_261_248
    cache_with(tmp_path / "home" / ".cache" / "huggingface" / "hub", "org/other")  # and with none set
    env.delenv(variable)
    assert hub.cached_config("org/other") is not None


def test_what_is_a_hub_id(tmp_path, monkeypatch):
    assert hub.is_hub_id("meta-llama/Llama-3.1-8B") and hub.is_hub_id("Qwen/Qwen3-8B")
    for text in ("llama3-8b", "a/b/c", "../x", "configs/llama.json", "/abs/path", "org/"):
        assert not hub.is_hub_id(text), text
    monkeypatch.chdir(tmp_path)
    (tmp_path / "org").mkdir()
    (tmp_path / "org" / "model").write_text("{}")
    assert not hub.is_hub_id("org/model")  # a file of that name here is read as the file


def test_offline_without_the_file_is_one_line(env, tmp_path):
    env.setenv("HF_HUB_CACHE", str(tmp_path / "empty"))
    env.setenv("HF_HUB_OFFLINE", "1")
    out = CliRunner().invoke(app, ["estimate", "--model", "meta-llama/Llama-3.1-70B"])
    assert out.exit_code == 2 and out.output.count("\n") == 1
    assert "no config.json in the Hugging Face cache" in out.output and "--config PATH" in out.output


def test_a_download_is_the_config_alone(env, tmp_path, monkeypatch):
    """Online, the missing config.json is fetched with hf_hub_download(repo, "config.json"), nothing else,
    after one HEAD of its URL (hub.answered) that the Hub answers."""
    import huggingface_hub

    env.setenv("HF_HUB_CACHE", str(tmp_path / "empty"))
    asked, heads = [], []

    def fake(repo_id, filename, **kwargs):
        asked.append((repo_id, filename))
        return str(LLAMA)

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", fake)
    monkeypatch.setattr(huggingface_hub, "get_hf_file_metadata", lambda url, **kwargs: heads.append(url))
    assert hub_model("meta-llama/Llama-3.1-8B").n_params == 8_030_261_248
    assert asked == [("meta-llama/Llama-3.1-8B", "config.json")]
    assert heads == [huggingface_hub.hf_hub_url("meta-llama/Llama-3.1-8B", "config.json")]


@pytest.mark.parametrize("refusing", ["get_hf_file_metadata", "hf_hub_download"])
def test_gated_and_missing_repos_say_what_to_do(env, tmp_path, monkeypatch, refusing):
    """The Hub refuses the first HEAD (hub.answered) or, where that passed, the download."""
    import huggingface_hub
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError

    env.setenv("HF_HUB_CACHE", str(tmp_path / "empty"))
    monkeypatch.setattr(huggingface_hub, "get_hf_file_metadata", lambda url, **kwargs: None)
    for error, message in ((GatedRepoError, "gated on the Hub"), (RepositoryNotFoundError, "no such model")):
        def raising(*args, error=error, **kwargs):
            e = error.__new__(error)  # as huggingface_hub raises it, without the HTTP response it is built from
            Exception.__init__(e, "refused")
            raise e

        monkeypatch.setattr(huggingface_hub, refusing, raising)
        with pytest.raises(InputError, match=message):
            hub_model("meta-llama/Llama-3.1-8B")


def test_an_unreachable_hub_is_one_line_at_once(env, tmp_path):
    """No network, the model not cached: huggingface_hub retried its HEAD five times with back-off (1+2+4+8+8 s)
    and logged every try, 13 lines over 23 s. Here the Hub is a localhost port nothing listens on (bound, so
    that nothing else takes it, and never listened on: each connection is refused), in its own process."""
    import os
    import socket
    import subprocess
    import sys
    import time

    pytest.importorskip("huggingface_hub")
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        endpoint = f"http://127.0.0.1:{closed.getsockname()[1]}"
        env = {**os.environ, "HF_ENDPOINT": endpoint, "HF_HUB_CACHE": str(tmp_path / "empty"), "NO_COLOR": "1"}
        start = time.monotonic()
        out = subprocess.run([sys.executable, "-m", "memcalc", "estimate", "--model", "some-org/some-model", "--seq",
                              "2048"], capture_output=True, text=True, timeout=60, env=env)  # fmt: skip
        took = time.monotonic() - start
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.splitlines() == [
        f"error: some-org/some-model: the Hugging Face Hub ({endpoint}) could not be reached (Connection refused) and "
        f"the cache ({tmp_path / 'empty'}) has no config.json for it: retry online, or pass --config PATH"]
    assert took < 10, f"{took:.1f} s"
