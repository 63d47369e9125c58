"""--png and --svg into a named pipe (mkfifo): the image is written when a process reads the pipe, and refused
in one line when none does. Opening a pipe with no reader blocked forever (--svg, and verify's), and a PNG
into one said 'cannot write ...: None'. Each command runs in its own process under a timeout, so that a
hang fails the test rather than the suite."""

import importlib.util
import os
import subprocess
import sys
import threading

import pytest

pytest.importorskip("matplotlib")

ESTIMATE = ["estimate", "--model", "gpt2", "--seq", "256", "--tricks", "bf16"]
TINY = ["--model", "llama3-8b", "--layers", "2", "--hidden", "64", "--heads", "4", "--kv-heads", "2", "--ffn", "160",
        "--vocab", "200", "--seq", "24", "--tricks", "bf16"]  # fmt: skip
VERIFY = ["verify", "--device", "meta", *TINY, "--timeline"]
NEEDS_TORCH = pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="verify needs torch")
MAGIC = {".png": b"\x89PNG\r\n\x1a\n", ".svg": b"<?xml"}


def memcalc(args: list[str]) -> subprocess.CompletedProcess:
    env = {**os.environ, "NO_COLOR": "1", "COLUMNS": "120"}
    return subprocess.run([sys.executable, "-m", "memcalc", *args], capture_output=True, text=True, timeout=120,
                          env=env)  # fmt: skip


def fifo(tmp_path, suffix: str) -> str:
    path = str(tmp_path / f"chart{suffix}")
    os.mkfifo(path)
    return path


# Each case starts a process (2-4 s): one per writer always runs (the SVG, the timeline's PNG, verify's), the
# others where MEMCALC_SLOW=1, as CI runs them.
SLOW = pytest.mark.slow("the same writer's refusal, and the sweep's PNG read whole, which always run")


@pytest.mark.parametrize("args, suffix", [
    ([*ESTIMATE, "--timeline"], ".svg"),
    pytest.param([*ESTIMATE, "--timeline"], ".png", marks=SLOW),
    ([*ESTIMATE, "--sweep", "seq=256:512"], ".png"),
    pytest.param(VERIFY, ".svg", marks=[NEEDS_TORCH, SLOW]),
    pytest.param(VERIFY, ".png", marks=NEEDS_TORCH),
])  # fmt: skip
def test_a_pipe_nobody_reads_is_refused_in_one_line(tmp_path, args, suffix):
    path = fifo(tmp_path, suffix)
    out = memcalc([*args, "--" + suffix[1:], path])
    assert out.returncode == 2, out.stderr
    assert out.stderr.strip().splitlines() == [f"error: cannot write {path}: no process is reading this named pipe "
                                               "(start its reader first)"]  # fmt: skip


@pytest.mark.parametrize("args, suffix", [
    pytest.param([*ESTIMATE, "--timeline"], ".svg", marks=SLOW),
    ([*ESTIMATE, "--sweep", "seq=256:512"], ".png"),
    pytest.param(VERIFY, ".png", marks=[NEEDS_TORCH, SLOW]),
])  # fmt: skip
def test_a_pipe_with_a_reader_gets_the_whole_image(tmp_path, args, suffix):
    path, got = fifo(tmp_path, suffix), []

    def read():
        with open(path, "rb") as pipe:  # blocks until memcalc opens it to write
            got.append(pipe.read())

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        out = memcalc([*args, "--" + suffix[1:], path])
    finally:
        if reader.is_alive() and not got:  # memcalc never opened it: let the reader's open return
            try:
                os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
            except OSError:
                pass
        reader.join(10)
    assert out.returncode == 0, out.stderr
    assert f"wrote {path}" in out.stderr
    assert got and got[0].startswith(MAGIC[suffix]) and len(got[0]) > 1000


def test_what_is_neither_a_file_nor_a_pipe_is_refused_before_the_work(tmp_path):
    """A socket (or a device) named chart.png: refused with the others, before anything is computed."""
    import socket

    path = tmp_path / "chart.png"
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(path))
        out = memcalc([*ESTIMATE, "--sweep", "seq=256:512", "--png", str(path)])
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [f"error: --png {path} is not a file: give a file path or a named pipe"]
