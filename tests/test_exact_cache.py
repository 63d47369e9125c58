"""memcalc.exact.cache: replayed steps kept on disk give what replaying gives; a cache that cannot be
used costs nothing but time."""

from memcalc.exact import cache
from memcalc.exact.step import step_phases
from memcalc.model.presets import PRESETS
from memcalc.model.tricks import parse_tricks


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
