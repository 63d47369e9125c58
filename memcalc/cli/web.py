"""`memcalc web`: the local page (memcalc.web) served until Ctrl-C, its commands run by this process.

No `from __future__ import annotations` here: typer reads every option's annotation.
"""

import sys
from typing import Annotated

import typer

from memcalc.errors import InputError

from .inputs import fail

Host = Annotated[str, typer.Option("--host", help="The address to listen on; 127.0.0.1 keeps the page to this machine.", metavar="ADDR")]  # fmt: skip
Port = Annotated[str, typer.Option("--port", help="The port (0: any free one).", metavar="N")]  # fmt: skip
Open = Annotated[bool, typer.Option("--open", help="Open the page in the default browser.")]  # fmt: skip


def web(host: Host = "127.0.0.1", port: Port = "8000", open_page: Open = False) -> None:
    """A local web page with the same answers: the verdict per trick set, what fits, the timeline."""
    try:
        from memcalc.model.shape import parse_count

        number = 0 if port.strip() == "0" else parse_count(port, "port", 65535)
        from memcalc.web.server import make_server

        from .inprocess import run

        try:
            server = make_server(run, host, number)
        except OSError as e:
            raise InputError(f"cannot listen on {host}:{number}: {e.strerror or e}") from None
    except InputError as e:
        fail(str(e))
    url = f"http://{host}:{server.server_address[1]}/"
    print(f"memcalc web: serving {url} (Ctrl-C stops)", file=sys.stderr, flush=True)
    if open_page:
        import webbrowser

        webbrowser.open(url)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
