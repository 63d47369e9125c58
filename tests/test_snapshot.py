"""`--timeline --snapshot FILE.pickle --trace FILE.json` (issue 42): the step's memory as PyTorch's memory
snapshot (torch.cuda.memory._dump_snapshot's pickle, which torch.cuda._memory_viz and pytorch.org/memory_viz
open) and as a Chrome/Perfetto trace; both from the Timeline the chart draws, through the caching allocator."""

import itertools
import json
import pickle
import pickletools

import pytest
from typer.testing import CliRunner

from memcalc.cli import app
from memcalc.exact.allocator.snapshot import dump

ENV = {"NO_COLOR": "1", "COLUMNS": "100"}
TINY = ["--model", "llama3-8b", "--layers", "2", "--hidden", "64", "--heads", "4", "--kv-heads", "2", "--ffn", "160",
        "--vocab", "200", "--seq", "24"]  # fmt: skip
MiB = 1 << 20


def run(*args: str):
    return CliRunner().invoke(app, list(args), env=ENV)


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """Two trick sets' steps: the timeline JSON the chart comes from, the snapshot (loaded), the trace, and
    the snapshot's path."""
    folder = tmp_path_factory.mktemp("exports")
    snap, trace = folder / "step.pickle", folder / "step.json"
    out = run("estimate", *TINY, "--micro-batch", "2", "--tricks", "bf16,flash", "--tricks", "bf16,flash,ckpt",
              "--timeline", "--format", "json", "--snapshot", str(snap), "--trace", str(trace))  # fmt: skip
    assert out.exit_code == 0, out.output
    assert out.stderr.splitlines() == [f"wrote {snap}", f"wrote {trace}"]
    return json.loads(out.stdout)["timeline"], pickle.loads(snap.read_bytes()), json.loads(trace.read_text()), snap


def test_memory_viz_opens_the_snapshot(exported):
    """torch.cuda._memory_viz reads it as it reads _dump_snapshot's: the HTML viewers, the text summaries
    (segsum checks that every segment's blocks add up), the flame graphs' lines."""
    mv = pytest.importorskip("torch.cuda._memory_viz")
    _, snap, _, _ = exported
    assert set(snap) == {"segments", "device_traces"} and len(snap["device_traces"]) == 2
    for html in (mv.trace_plot(snap), mv.segment_plot(snap), mv.trace_plot(snap, plot_segments=True)):
        assert html.lstrip().startswith("<!DOCTYPE html>") and "snapshot.pickle" in html
    assert "segments: " in mv.segsum(snap) and "Device 1 ----" in mv.trace(snap)
    lines = mv.memory(snap, format_flamegraph=lambda text: text).splitlines()
    assert any(";active_allocated;before the step:0:block 1;weights:0:param blocks.1." in x for x in lines)
    flame = mv.segments(snap, format_flamegraph=lambda text: text).splitlines()  # every byte of every segment
    assert sum(int(x.rsplit(" ", 1)[1]) for x in flame) == sum(s["total_size"] for s in snap["segments"])


# The opcodes memory_viz's page reads (torch/utils/viz/MemoryViz.js `unpickle`: any other throws), protocols 2-4
VIEWER_OPCODES = {"APPENDS", "BINGET", "BININT", "BININT1", "BININT2", "EMPTY_DICT", "EMPTY_LIST", "FRAME", "LONG1",
                  "LONG_BINGET", "MARK", "MEMOIZE", "PROTO", "SETITEMS", "SHORT_BINUNICODE", "STOP", "TUPLE2", "APPEND",
                  "NEWFALSE", "BINPUT", "BINUNICODE", "EMPTY_TUPLE", "NEWTRUE", "NONE", "BINFLOAT", "TUPLE", "TUPLE1",
                  "TUPLE3", "LONG_BINPUT", "LIST", "DICT", "SETITEM"}  # fmt: skip


def test_the_page_s_unpickler_reads_it(exported):
    """pytorch.org/memory_viz unpickles in JavaScript, protocols 2 to 4 and a subset of the opcodes."""
    *_, path = exported
    ops = list(pickletools.genops(path.read_bytes()))
    assert ops[0][0].name == "PROTO" and 2 <= ops[0][1] <= 4
    assert {op.name for op, _, _ in ops} <= VIEWER_OPCODES


def test_the_trace_rebuilds_the_timeline(exported):
    """The live bytes rebuilt from each device's trace (its allocations and completed frees, at the bytes asked
    for, as PyTorch records them) are the timeline's, allocation by allocation, from its start to its end and
    through its peak; every allocation's first frame names its op and its event."""
    timelines, snap, _, _ = exported
    for device, t in enumerate(timelines):
        entries = snap["device_traces"][device]
        live, after = t["start_bytes"], []
        for e in entries:
            if e["action"] == "alloc":
                live += e["size"]
                after.append(live)
                frame = e["frames"][0]
                assert t["ops"][frame["line"] - 1] == frame["name"] and e["time_us"] == frame["line"]
            elif e["action"] == "free_completed":
                live -= e["size"]
        assert after == [x for op, x in zip(t["ops"], t["live_bytes"]) if op != "free"]
        assert live == t["end_bytes"] and max(after) == t["peak_bytes"]
        blocks = [b for s in snap["segments"] if s["device"] == device for b in s["blocks"]]
        assert all(b["size"] % 512 == 0 and b["size"] >= b["requested_size"] for b in blocks)  # round_size


def step_back(snap: dict, device: int) -> tuple[dict, dict]:
    """The allocator's state before the trace, as memory_viz's segment view rebuilds it (MemoryViz.js
    simulate_memory: from the snapshot's segments, each trace entry undone, the last first); each undo must
    find what it undoes, and no block outlives its segment."""
    segments = {s["address"]: s["total_size"] for s in snap["segments"] if s["device"] == device}
    blocks = {b["address"]: b["requested_size"] for s in snap["segments"] if s["device"] == device
              for b in s["blocks"] if b["state"] == "active_allocated"}  # fmt: skip
    for e in reversed(snap["device_traces"][device]):
        action, addr = e["action"], e["addr"]
        if action == "alloc":
            assert blocks.pop(addr) == e["size"]
        elif action == "free_completed":
            assert addr not in blocks
            blocks[addr] = e["size"]
        elif action == "free_requested":
            assert blocks[addr] == e["size"]
        elif action == "segment_alloc":
            assert segments.pop(addr) == e["size"]
            assert not [b for b in blocks if addr <= b < addr + e["size"]]
        else:
            raise AssertionError(f"{action}: not made by the default allocator with no limit")
    return segments, blocks


def test_memory_viz_can_step_back_to_the_step_s_start(exported):
    """Undone to the start, what is allocated is the model state the step starts with."""
    timelines, snap, _, _ = exported
    for device, t in enumerate(timelines):
        _, blocks = step_back(snap, device)
        assert sum(blocks.values()) == t["start_bytes"]


def test_the_perfetto_trace(exported):
    """Per trick set a process: the allocated counter is the timeline (its highest value the peak), the
    reserved one never under it and ending where the snapshot's segments add up; the phases as slices and
    the peak as an instant at its event."""
    timelines, snap, trace, _ = exported
    events = trace["traceEvents"]
    for pid, t in enumerate(timelines, start=1):
        mine = [e for e in events if e["pid"] == pid]
        allocated = [e["args"]["bytes"] for e in mine if e["ph"] == "C" and e["name"] == "allocated"]
        reserved = [e["args"]["bytes"] for e in mine if e["ph"] == "C" and e["name"] == "reserved"]
        assert allocated == [t["start_bytes"], *t["live_bytes"]] and max(allocated) == t["peak_bytes"]
        assert all(r >= a for r, a in zip(reserved, allocated, strict=True))
        assert reserved[-1] == sum(s["total_size"] for s in snap["segments"] if s["device"] == pid - 1)
        phases = [(e["name"], e["ts"], e["dur"]) for e in mine if e["ph"] == "X" and e["cat"] == "phase"]
        assert phases == [(p["phase"], p["start"], p["end"] - p["start"]) for p in t["phases"]]
        (peak,) = [e for e in mine if e["ph"] == "i"]
        assert peak["ts"] == t["peak_index"] + 1 and peak["name"] == f"peak: {t['peak_at']}"
        assert sum(e["ph"] == "X" and e["cat"] != "phase" for e in mine) == len(t["ops"])
    names = {e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    assert names == {"bf16+flash (reference)", "bf16+flash+ckpt (reference)"}


def test_segments_tile_as_snapshot_reports_them():
    """The allocator's segments after its events: blocks tile each segment from its address, free ones are
    never side by side (free_block merges them), and the segments add up to what is reserved; with expandable
    segments, each mapped run is a segment."""
    events = [("a", 3 * MiB, 0), ("b", 1000, 0), ("c", 30 * MiB, 0), ("a", -3 * MiB, 0), ("d", 5 * MiB, 0)]
    for expandable in (False, True):
        d = dump(events, start=2, expandable=expandable)
        assert d.trace[0][4] == 2 and d.reserved_bytes[-1] == sum(s.total_size for s in d.segments)
        for s in d.segments:
            assert [b.address for b in s.blocks] == [s.address + sum(b.size for b in s.blocks[:k])
                                                      for k in range(len(s.blocks))]  # fmt: skip
            free = [b.key is None for b in s.blocks]
            assert not any(x and y for x, y in itertools.pairwise(free))
        assert {b.key for s in d.segments for b in s.blocks} - {None} == {"b", "c", "d"}


@pytest.mark.parametrize("args,message", [
    (("estimate", *TINY, "--snapshot", "s.pickle"), "--snapshot exports the step's timeline: add --timeline"),
    (("estimate", *TINY, "--trace", "t.json"), "--trace exports the step's timeline: add --timeline"),
    (("estimate", *TINY, "--timeline", "--trace", "t.txt"), "--trace writes a JSON file"),
    (("estimate", *TINY, "--timeline", "--snapshot", "no/such/s.pickle"), "the folder no/such does not exist"),
    (("verify", *TINY, "--device", "meta", "--snapshot", "s.pickle"), "--snapshot exports the step's timeline"),
])  # fmt: skip
def test_refused_in_one_line(args, message):
    out = run(*args)
    assert out.exit_code == 2 and message in out.stderr and len(out.stderr.strip().splitlines()) == 1


def test_verify_exports_the_predicted_step(tmp_path):
    """verify --timeline --snapshot: the prediction laid under the measurement, as estimate exports it."""
    pytest.importorskip("torch")
    snap = tmp_path / "v.pickle"
    out = run("verify", *TINY, "--tricks", "bf16", "--device", "meta", "--timeline", "--no-linearity",
              "--format", "json", "--snapshot", str(snap))  # fmt: skip
    assert out.exit_code == 0, out.output
    predicted = json.loads(out.stdout)["timeline"]["predicted"]
    allocs = [e for e in pickle.loads(snap.read_bytes())["device_traces"][0] if e["action"] == "alloc"]
    assert len(allocs) == sum(op != "free" for op in predicted["ops"])
