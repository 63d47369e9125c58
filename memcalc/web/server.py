"""`memcalc web`: a local HTTP server (the standard library's) for the page in memcalc/web/static, which asks
it to run memcalc's own commands and shows what they print.

  GET  /                 the page; GET /static/NAME its script and style, from the package (no network)
  GET  /api/choices      the presets and GPUs (`memcalc presets|gpus --format json`) and the Hub ids cached here
  POST /api/run          {"argv": [...]}: the command run (calls.checked), {"code", "out", "error"}
  POST /api/ahead        {"argvs": [[...], ...]}: commands the page may ask next, run ahead (calls.Ahead);
                         GET: {"pending", "running"}, how far it is
  POST /api/config       a config.json's text: kept for this server's life, {"path"} to pass as --config
"""

from __future__ import annotations

import hashlib
import json
import tempfile
from collections.abc import Callable
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources
from pathlib import Path

from memcalc.errors import InputError
from memcalc.model.hub import cached_repos

from .calls import Calls, Printed, checked

STATIC = {"index.html": "text/html", "page.js": "text/javascript", "page.css": "text/css"}
MAX_BODY = 1 << 20  # a config.json is a few kB; a request body larger than 1 MiB is refused


class Page:
    """What the handlers share: the commands' runner and the folder uploaded configs are kept in."""

    def __init__(self, run: Callable[[tuple[str, ...]], Printed]):
        self.calls = Calls(run)
        self.folder = tempfile.TemporaryDirectory(prefix="memcalc-web-")  # removed as the server's process ends
        self.configs = Path(self.folder.name)

    def choices(self) -> dict:
        presets, gpus = self.calls(("presets", "--format", "json")), self.calls(("gpus", "--format", "json"))
        return {"presets": [p["name"] for p in json.loads(presets.out)],
                "gpus": [{"key": g["key"], "name": g["name"]} for g in json.loads(gpus.out)],
                "hub": cached_repos()}  # fmt: skip

    def keep_config(self, text: bytes) -> dict:
        """An uploaded config.json, kept under its content's hash (the same file, the same path)."""
        try:
            if not isinstance(json.loads(text), dict):
                raise ValueError
        except ValueError:
            raise InputError("config.json: not a JSON object") from None
        path = self.configs / f"{hashlib.sha256(text).hexdigest()[:16]}-config.json"
        path.write_bytes(text)
        return {"path": str(path)}


def handler(page: Page) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        server_version = "memcalc-web"

        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            path = self.path.split("?", 1)[0].split("#", 1)[0]
            if path == "/":
                path = "/static/index.html"
            name = path.removeprefix("/static/")
            if path.startswith("/static/") and name in STATIC:
                body = (resources.files("memcalc.web") / "static" / name).read_bytes()
                return self.send(HTTPStatus.OK, body, STATIC[name] + "; charset=utf-8")
            if path == "/api/choices":
                return self.send_json(page.choices())
            if path == "/api/ahead":
                return self.send_json(page.calls.ahead.status())
            if path == "/favicon.ico":
                return self.send(HTTPStatus.NO_CONTENT, b"", "image/x-icon")
            self.send(HTTPStatus.NOT_FOUND, b"not found\n", "text/plain")

        def do_POST(self) -> None:  # noqa: N802
            try:
                size = int(self.headers.get("Content-Length") or 0)
            except ValueError:
                size = -1
            if not 0 <= size <= MAX_BODY:
                too_big = {"error": f"a request body of {size:,} bytes; 0 to {MAX_BODY:,}"}
                return self.send_json(too_big, HTTPStatus.BAD_REQUEST)
            body = self.rfile.read(size)
            try:
                if self.path == "/api/config":
                    return self.send_json(page.keep_config(body))
                asked = json.loads(body or b"{}")
                if self.path == "/api/run":
                    argv = checked(asked.get("argv"))
                    try:
                        printed = page.calls(argv)
                    except Exception as e:  # a bug, not bad input: said on the page, and the server goes on
                        failed = {"code": 1, "out": "", "error": f"memcalc failed: {type(e).__name__}: {e}"}
                        return self.send_json(failed, HTTPStatus.INTERNAL_SERVER_ERROR)
                    return self.send_json({"code": printed.code, "out": printed.out,
                                           "error": printed.error if printed.code else ""})  # fmt: skip
                if self.path == "/api/ahead":
                    argvs = [checked(a) for a in asked.get("argvs") or []]
                    return self.send_json({"queued": page.calls.ahead.want(argvs)})
            except (InputError, ValueError, AttributeError) as e:
                return self.send_json({"error": str(e) or "bad request"}, HTTPStatus.BAD_REQUEST)
            self.send(HTTPStatus.NOT_FOUND, b"not found\n", "text/plain")

        def send_json(self, data: dict, status: HTTPStatus = HTTPStatus.OK) -> None:
            self.send(status, json.dumps(data).encode(), "application/json")

        def send(self, status: HTTPStatus, body: bytes, kind: str) -> None:
            self.send_response(status)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Cache-Control", "no-store")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args) -> None:  # the terminal shows the address, not each request
            pass

    return Handler


def make_server(run: Callable[[tuple[str, ...]], Printed], host: str = "127.0.0.1",
                port: int = 8000) -> ThreadingHTTPServer:  # fmt: skip
    """The server, bound (port 0: a free one); serve_forever() serves it."""
    server = ThreadingHTTPServer((host, port), handler(Page(run)))
    server.daemon_threads = True
    return server
