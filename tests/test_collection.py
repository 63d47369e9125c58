"""memcalc.exact.base.collection: the collector held off inside the engine's blocks; the command line (one command,
then exit) freezes what survives them, verify (torch's objects in cycles) never does."""

import gc

from typer.testing import CliRunner

from memcalc.cli import app
from memcalc.exact.base import collection


def test_a_block_turns_the_collector_back_on_and_freezes_only_when_told(monkeypatch):
    for freeze in (False, True):
        monkeypatch.setattr(collection, "FREEZE", freeze)
        before = gc.get_freeze_count()
        with collection.no_collection():
            assert not gc.isenabled()
            kept = [[i] for i in range(1000)]  # survivors of the block
        assert gc.isenabled() and kept
        assert (gc.get_freeze_count() > before) is freeze
        gc.unfreeze()


def test_verify_keeps_the_collector(monkeypatch):
    monkeypatch.setattr(collection, "FREEZE", True)  # as memcalc.cli.main leaves it for every command
    result = CliRunner().invoke(app, ["verify", "--device", "meta", "--model", "qwen3-0.6b", "--layers", "2",
                                      "--no-linearity"])  # fmt: skip
    assert result.exit_code == 0, result.output
    assert collection.FREEZE is False
