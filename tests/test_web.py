"""`memcalc web`'s server (memcalc.web): the page's files from the package, the commands it may run and what
they print, equal to the command line's own output, and the uploaded and cached models it offers. The page in a
real browser: tests/test_web_browser.py."""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from typer.testing import CliRunner

from memcalc.cli import app
from memcalc.errors import InputError
from memcalc.model import hub
from memcalc.web.calls import Calls, Printed, checked
from memcalc.web.server import make_server

ROOT = Path(__file__).resolve().parents[1]
GPT2 = ["--model", "gpt2", "--seq", "512", "--gpu", "rtx4090"]


@contextlib.contextmanager
def served(**env: str):
    """`memcalc web --port 0` in a process of its own (a command prints to its process's stdout, which pytest
    swaps between tests: a server thread in the test's process would lose what it prints), and its address."""
    server = subprocess.Popen([sys.executable, "-m", "memcalc", "web", "--port", "0"], stderr=subprocess.PIPE,
                              text=True, cwd=ROOT, env={**os.environ, **env})  # fmt: skip
    try:
        said = server.stderr.readline()
        address = re.match(r"memcalc web: serving (http://\S+/) \(Ctrl-C stops\)", said)
        assert address, said
        yield address.group(1).rstrip("/")
    finally:
        server.terminate()
        server.wait(10)
        server.stderr.close()


@pytest.fixture(scope="module")
def url():
    with served() as address:
        yield address


def get(url: str) -> tuple[int, bytes, str]:
    try:
        with urllib.request.urlopen(url, timeout=60) as r:
            return r.status, r.read(), r.headers["Content-Type"]
    except urllib.error.HTTPError as e:
        return e.code, e.read(), e.headers["Content-Type"]


def post(url: str, body: object) -> tuple[int, dict]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    try:
        with urllib.request.urlopen(urllib.request.Request(url, data=data, method="POST"), timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def terminal(*argv: str) -> subprocess.CompletedProcess:
    """`memcalc *argv` as typer's CliRunner runs it in this process (what a shell gets, without a process's
    start): its exit code, stdout and stderr."""
    got = CliRunner().invoke(app, list(argv), env={"COLUMNS": "400", "NO_COLOR": "1"})
    return subprocess.CompletedProcess(argv, got.exit_code, got.stdout, got.stderr)


def cli(*argv: str) -> subprocess.CompletedProcess:
    """`memcalc *argv` in a shell of its own, wide enough that no line of its tables wraps."""
    env = {**os.environ, "COLUMNS": "400"}
    return subprocess.run([sys.executable, "-m", "memcalc", *argv], capture_output=True, text=True, cwd=ROOT, env=env)


def test_the_page_and_its_files_come_from_the_package(url):
    status, body, kind = get(url + "/")
    assert status == 200 and kind.startswith("text/html") and b'src="/static/page.js"' in body
    for name, kind_of in (("page.js", "text/javascript"), ("page.css", "text/css")):
        status, body, kind = get(f"{url}/static/{name}")
        assert status == 200 and kind.startswith(kind_of)
        assert body == (ROOT / "memcalc" / "web" / "static" / name).read_bytes()
    for path in ("/static/../calls.py", "/static/server.py", "/memcalc/web/server.py", "/api/run"):
        assert get(url + path)[0] == 404, path
    assert b"http" not in get(url + "/")[1].replace(b'name="viewport"', b""), "the page loads nothing from outside"


def test_a_command_prints_on_the_page_what_it_prints_in_a_terminal(url):
    argv = ["estimate", *GPT2, "--format", "markdown"]
    status, got = post(url + "/api/run", {"argv": argv})
    shell = terminal(*argv)
    assert status == 200 and got == {"code": 0, "out": shell.stdout, "error": ""}
    fit = ["fit", *GPT2, "--tricks", "bf16,flash", "--format", "json"]
    assert json.loads(post(url + "/api/run", {"argv": fit})[1]["out"]) == json.loads(terminal(*fit).stdout)


@pytest.mark.parametrize("argv", [
    ["estimate", "--model", "gpt2", "--seq", "0"],  # the engine's refusal (InputError)
    ["estimate", "--model", "no-such-model"],
    ["fit", "--model", "gpt2", "--lora", "16", "--tricks", "bf16", "--micro-batch", "x"],
    ["estimate", "--model", "gpt2", "--no-such-option"],  # click's usage error
])
def test_a_refusal_is_the_terminals_one_line(url, argv):
    status, got = post(url + "/api/run", {"argv": argv})
    shell = terminal(*argv)
    assert shell.returncode == 2 and len(shell.stderr.strip().splitlines()) == 1
    assert status == 200 and got["code"] == 2 and got["out"] == ""
    assert "error: " + got["error"] == shell.stderr.strip()


@pytest.mark.parametrize("argv, said", [
    ("estimate", "a command is a list of strings"),
    ([], "a command is a list of strings"),
    (["verify", "--model", "gpt2"], "the page runs estimate, fit, presets, gpus, not 'verify'"),
    (["estimate", "--model", "gpt2", "--timeline", "--png", "x.png"], "--png is refused"),
    (["estimate", "--from=recipe.yaml"], "--from is refused"),
    (["estimate", 3], "a command is a list of strings"),
])
def test_the_page_runs_only_what_it_builds(url, argv, said):
    with pytest.raises(InputError, match=said):
        checked(argv)
    status, got = post(url + "/api/run", {"argv": argv})
    assert status == 400 and said in got["error"]


def test_choices_are_the_commands_lists_and_the_hub_cache(monkeypatch, tmp_path):
    from test_hub import cache_with

    monkeypatch.setenv("HF_HUB_CACHE", str(cache_with(tmp_path / "cache", "meta-llama/Meta-Llama-3-8B")))
    (tmp_path / "cache" / "models--org--no-config").mkdir()  # a download that never got its config.json
    with served() as url:
        status, body, _ = get(url + "/api/choices")
    choices = json.loads(body)
    assert [p["name"] for p in json.loads(terminal("presets", "--format", "json").stdout)] == choices["presets"]
    gpus = json.loads(terminal("gpus", "--format", "json").stdout)
    assert [g["key"] for g in gpus] == [g["key"] for g in choices["gpus"]]
    assert choices["hub"] == ["meta-llama/Meta-Llama-3-8B"] == hub.cached_repos()
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "nowhere"))
    assert hub.cached_repos() == []


def test_an_uploaded_config_is_kept_by_its_content(url):
    text = (ROOT / "examples" / "configs" / "llama3-8b.json").read_bytes()
    status, kept = post(url + "/api/config", text)
    assert status == 200 and Path(kept["path"]).read_bytes() == text
    assert post(url + "/api/config", text)[1] == kept
    argv = ["estimate", "--config", kept["path"], "--seq", "1024", "--tricks", "bf16,flash,ckpt", "--format", "json"]
    page = json.loads(post(url + "/api/run", {"argv": argv})[1]["out"])
    assert page["verdict"] == json.loads(terminal(*argv).stdout)["verdict"]
    assert post(url + "/api/config", b"[1, 2]") == (400, {"error": "config.json: not a JSON object"})
    assert post(url + "/api/config", b"{not json") == (400, {"error": "config.json: not a JSON object"})


def test_a_command_runs_once_while_the_server_runs():
    ran = []
    calls = Calls(lambda argv: ran.append(argv) or Printed(0, " ".join(argv), ""))
    assert calls(("estimate", "--seq", "1k")).out == "estimate --seq 1k"
    assert calls(("estimate", "--seq", "1k")).out == "estimate --seq 1k"
    calls(("fit",))
    assert ran == [("estimate", "--seq", "1k"), ("fit",)]


def test_ahead_runs_the_next_commands_into_the_disk_cache(url):
    argv = ["estimate", "--model", "gpt2", "--seq", "384", "--gpu", "rtx4090", "--format", "json"]
    status, got = post(url + "/api/ahead", {"argvs": [argv]})
    assert status == 200 and got == {"queued": 1}
    for _ in range(600):
        status, body, _ = get(url + "/api/ahead")
        if json.loads(body) == {"pending": 0, "running": False}:
            break
        time.sleep(0.1)
    assert json.loads(body) == {"pending": 0, "running": False}
    assert post(url + "/api/ahead", {"argvs": [argv]})[1] == {"queued": 0}, "run once"


def test_the_command_refuses_a_bad_port():
    shell = cli("web", "--port", "70000")
    assert shell.returncode == 2 and shell.stderr.startswith("error: ") and "port" in shell.stderr


def test_what_is_kept_has_a_budget(monkeypatch):
    import memcalc.web.calls as calls_module

    monkeypatch.setattr(calls_module, "KEPT_BYTES", 10)
    ran = []
    calls = Calls(lambda argv: ran.append(argv) or Printed(0, "x" * 4, ""))
    for n in range(5):
        calls(("fit", str(n)))
    assert list(calls.kept) == [("fit", "3"), ("fit", "4")] and calls.kept_bytes == 8  # the oldest go first
    calls(("fit", "4"))
    assert len(ran) == 5, "the newest is kept"


def test_a_failure_is_one_line_and_the_server_goes_on(url):
    def broken(argv):
        raise RuntimeError("the timeline peaks at 1 B, the verdict's step at 2 B")

    server = make_server(broken, port=0)  # a run that fails: prints nothing, so a thread of this process serves
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        status, got = post(f"http://127.0.0.1:{server.server_address[1]}/api/run", {"argv": ["fit"]})
    finally:
        server.shutdown()
        server.server_close()
    assert status == 500 and got == {"code": 1, "out": "", "error": "memcalc failed: RuntimeError: the timeline "
                                     "peaks at 1 B, the verdict's step at 2 B"}  # fmt: skip
    status, got = post(url + "/api/run", {"argv": ["estimate", "--model", "gpt2", "--seq", "64"]})
    assert status == 200 and got["code"] == 0
    for size in ("-1", "x", str(2 << 20)):
        request = urllib.request.Request(url + "/api/run", data=b"{}", method="POST", headers={"Content-Length": size})
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(request, timeout=10)
        assert refused.value.code == 400 and "a request body of" in json.loads(refused.value.read())["error"]
