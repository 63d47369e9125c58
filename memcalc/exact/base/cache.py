"""Replayed steps remembered on disk, so that `memcalc estimate` starts as fast as typer itself.

A verdict replays each trick set's step (two and three blocks: a few ms each), some 30 ms for the default
progression, a third of the whole command. The result depends only on the call's arguments and on the
code it runs, so it is kept in one small file per call under $MEMCALC_CACHE (default $XDG_CACHE_HOME/memcalc,
else ~/.cache/memcalc), keyed by both: the code is every module of memcalc that the replay imports, at any
depth (memcalc.exact.base.sources), each by its size and modification time, so an edit to any of them is a
new cache. Finding those modules reads their imports (some 10 ms); the list found is kept beside the results
with the stamps of the files it read, and read again while none of those changed (a file newly imported is
imported by one that changed). MEMCALC_CACHE=off turns the cache off. A cache
that cannot be read or written is ignored: it only ever saves time. Each file is the result's JSON
compressed by zlib: a kernel trace repeats its op and unit names on every row, and compressed it is
a fourteenth of the size (DeepSeek-V3's 256-GPU plan: 0.9 MB of traces, not 12.9) for 0.1 ms more a read.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import zlib
from collections.abc import Callable
from pathlib import Path

from memcalc import __version__

from .sources import PACKAGE, dependencies

SOURCES_FILE = "sources.json"  # in the cache's folder: the replay's modules and their stamps when last found


def folder() -> Path | None:
    where = os.environ.get("MEMCALC_CACHE", "")
    if where.lower() in ("off", "0", "no", "false"):
        return None
    if where:
        return Path(where)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "memcalc"


@functools.cache
def source_stamp(where: Path) -> str:
    """memcalc's version and the stamps of the code the replay runs: cheap, and new on any edit to it."""
    return f"{__version__} {source_stamps(where)}"


def source_stamps(where: Path) -> list[list]:
    """Each file the replay depends on, as [path under memcalc/, size, modification time]: the list kept in
    the cache's folder while its files are as it says, else found again (and kept)."""
    kept = where / SOURCES_FILE
    try:
        listed = json.loads(kept.read_text())
        if all(stamp(PACKAGE / name) == [name, size, mtime] for name, size, mtime in listed):
            return listed
    except (OSError, ValueError, TypeError):
        pass  # none kept, unreadable, or a file gone: found again
    listed = [stamp(f) for f in dependencies()]
    try:
        where.mkdir(parents=True, exist_ok=True)
        write_whole(kept, json.dumps(listed).encode())
    except OSError:
        pass
    return listed


def stamp(path: Path) -> list:
    info = path.stat()
    return [path.relative_to(PACKAGE).as_posix(), info.st_size, info.st_mtime_ns]


def remembered(kind: str, key: tuple, compute: Callable[[], dict]) -> dict:
    """compute()'s result (a JSON-able dict) for key, from the cache when it holds it."""
    where = folder()
    if where is None:
        return compute()
    try:
        name = hashlib.sha256(f"{kind} {source_stamp(where)} {key!r}".encode()).hexdigest()[:32]
    except OSError:
        return compute()
    path = where / f"{kind}-{name}.json.zlib"
    try:
        return read(path)
    except (OSError, ValueError, zlib.error):
        pass
    value = compute()
    try:
        where.mkdir(parents=True, exist_ok=True)
        write_whole(path, zlib.compress(json.dumps(value).encode()))
    except OSError:
        pass
    return value


def write_whole(path: Path, data: bytes) -> None:
    """Written whole or not at all, whoever else writes it."""
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def read(path: Path) -> dict:
    """One remembered result, as remembered() wrote it."""
    return json.loads(zlib.decompress(path.read_bytes()))
