"""Replayed steps remembered on disk, so that `memcalc estimate` starts as fast as typer itself.

A verdict replays each trick set's step (two and three blocks: a few ms each), some 30 ms for the default
progression, a third of the whole command. The result depends only on the call's arguments and on the
simulator's source, so it is kept in one small file per call under $MEMCALC_CACHE (default
$XDG_CACHE_HOME/memcalc, else ~/.cache/memcalc), keyed by both; MEMCALC_CACHE=off turns it off. A cache
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

SOURCES = Path(__file__).parent  # the simulator: a change to any of its files is a new cache
MODEL_SOURCES = ("stacks.py", "shape.py", "sizes.py", "moe_mla.py", "params.py", "tricks.py")  # of memcalc.model


def folder() -> Path | None:
    where = os.environ.get("MEMCALC_CACHE", "")
    if where.lower() in ("off", "0", "no", "false"):
        return None
    if where:
        return Path(where)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "memcalc"


@functools.cache
def source_stamp() -> str:
    """memcalc's version and each simulator file's size and modification time: cheap, and new on any edit."""
    model = SOURCES.parent / "model"
    files = sorted(SOURCES.glob("*.py")) + [model / name for name in MODEL_SOURCES]
    stats = [(f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in files]
    return f"{__version__} {stats}"


def remembered(kind: str, key: tuple, compute: Callable[[], dict]) -> dict:
    """compute()'s result (a JSON-able dict) for key, from the cache when it holds it."""
    where = folder()
    if where is None:
        return compute()
    try:
        name = hashlib.sha256(f"{kind} {source_stamp()} {key!r}".encode()).hexdigest()[:32]
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
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_bytes(zlib.compress(json.dumps(value).encode()))
        os.replace(tmp, path)  # whole or not at all, whoever else writes it
    except OSError:
        pass
    return value


def read(path: Path) -> dict:
    """One remembered result, as remembered() wrote it."""
    return json.loads(zlib.decompress(path.read_bytes()))
