"""memcalc.exact.base.cache: replayed steps kept on disk give what replaying gives; a cache that cannot be
used costs nothing but time."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

from memcalc.exact.base import cache, sources
from memcalc.exact.step import step_phases
from memcalc.model.presets import PRESETS
from memcalc.model.tricks import parse_tricks

ROOT = Path(__file__).parent.parent


def test_a_remembered_result_is_read_back(tmp_path, monkeypatch):
    monkeypatch.setenv("MEMCALC_CACHE", str(tmp_path))
    calls = []

    def compute():
        calls.append(1)
        return {"bytes": 42}

    assert cache.remembered("probe", ("a", 1), compute) == {"bytes": 42}
    assert cache.remembered("probe", ("a", 1), compute) == {"bytes": 42}
    assert len(calls) == 1 and len(list(tmp_path.glob("probe-*.json.zlib"))) == 1
    assert cache.remembered("probe", ("a", 2), compute) == {"bytes": 42} and len(calls) == 2  # another key


def test_off_and_unusable_caches_compute(tmp_path, monkeypatch):
    calls = []

    def compute():
        calls.append(1)
        return {"n": len(calls)}

    monkeypatch.setenv("MEMCALC_CACHE", "off")
    assert cache.remembered("probe", (), compute) == {"n": 1} and cache.remembered("probe", (), compute) == {"n": 2}
    blocked = tmp_path / "file"
    blocked.write_text("not a folder")
    monkeypatch.setenv("MEMCALC_CACHE", str(blocked))  # mkdir fails: computed, nothing raised
    assert cache.remembered("probe", (), compute) == {"n": 3}
    monkeypatch.setenv("MEMCALC_CACHE", str(tmp_path))
    cache.remembered("probe", (), compute)
    for f in tmp_path.glob("probe-*.json.zlib"):
        f.write_bytes(b"{not json")  # a torn or foreign file: replaced by the computed result
    assert cache.remembered("probe", (), compute) == {"n": 5}


def test_cached_phases_equal_replayed_ones(tmp_path, monkeypatch):
    monkeypatch.setenv("MEMCALC_CACHE", str(tmp_path))
    args = (PRESETS["qwen3-0.6b"], 512, 1, parse_tricks("bf16,flash,ckpt"))
    step_phases.cache_clear()
    fresh = step_phases(*args)
    step_phases.cache_clear()  # the next call reads the file
    assert step_phases(*args) == fresh
    (entry,) = tmp_path.glob("phases-*.json.zlib")
    assert cache.read(entry)["optimizer_peak_bytes"] == fresh.optimizer_peak_bytes


def test_an_edit_to_any_module_the_replay_imports_is_a_new_cache(tmp_path):
    """The cache is keyed on every module the replay imports, at any depth: an edit to memcalc/model/finetune.py
    once left a cached QLoRA step as it was before the edit. Here the edit leaves down_proj out of the projections
    bitsandbytes quantises (PROJECTIONS, read by memcalc.exact.hf.qlora), which the cache's key cannot see: the
    adapters' targets are named, so the Finetune record in the key is the same."""
    copy = tmp_path / "src"
    shutil.copytree(ROOT / "memcalc", copy / "memcalc", ignore=shutil.ignore_patterns("__pycache__"))

    def estimate(cache: str) -> str:
        command = [sys.executable, "-m", "memcalc", "estimate", "--model", "qwen3-0.6b", "--seq", "512", "--lora", "8",
                   "--lora-targets", "q_proj,v_proj", "--quantize", "nf4", "--tricks", "bf16",
                   "--format", "json"]  # fmt: skip
        env = {**os.environ, "MEMCALC_CACHE": cache}
        done = subprocess.run(command, cwd=copy, env=env, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        return done.stdout

    cached = str(tmp_path / "cache")
    before = estimate(cached)
    assert any(tmp_path.glob("cache/phases-*")), "the copy's replay was not cached"
    finetune = copy / "memcalc/model/finetune.py"
    text = finetune.read_text()
    assert text.count('"gate_proj", "up_proj", "down_proj")') == 1
    finetune.write_text(text.replace('"gate_proj", "up_proj", "down_proj")', '"gate_proj", "up_proj")'))
    after = estimate(cached)
    assert after == estimate("off")  # what a replay without the cache gives
    assert after != before


def test_the_replay_s_sources_are_found_by_its_imports():
    """Every module memcalc.exact imports, at any depth, and none it does not (the report, the CLI)."""
    found = {p.relative_to(sources.PACKAGE).as_posix() for p in sources.dependencies()}
    assert {"model/finetune.py", "model/shape.py", "errors.py", "exact/replay/meta.py", "exact/base/kernel.py",
            "__init__.py", "model/__init__.py"} <= found  # fmt: skip
    assert not any(f.startswith(("report/", "cli/", "engine/", "time/")) for f in found)
    (lines,) = [sources.names("(a,  # why\n b as c)")]
    assert lines == ["a", "b"]
