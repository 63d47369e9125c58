"""The files a report writes (--png, --svg, --snapshot, --trace): where each may go, and writing it into a
file or a named pipe whose reader is waiting; a path that cannot be written is bad input, in one line."""

from __future__ import annotations

import errno
import os
from pathlib import Path

from memcalc.errors import InputError


def check_path(path: str, suffix: str, flag: str, kind: str) -> str:
    """Where `flag` may write `kind` ("a PNG file"): a new file, a file or a named pipe, ending in the suffix,
    in a folder that exists. Nothing is opened here: opening a pipe tells its reader the data begins."""
    p = Path(path)
    if p.suffix.lower() != suffix:
        raise InputError(f"{flag} writes {kind}: give a path ending in {suffix}, got {path!r}")
    if p.is_dir():
        raise InputError(f"{flag} {path} is a folder: give a file path, e.g. {p / ('timeline' + suffix)}")
    if not p.parent.is_dir():
        raise InputError(f"{flag} {path}: the folder {p.parent} does not exist")
    if p.exists() and not (p.is_file() or p.is_fifo()):
        raise InputError(f"{flag} {path} is not a file: give a file path or a named pipe")
    return path


def write_file(path: str, data: bytes) -> None:
    """data into the file or named pipe at path; one that cannot be written is bad input."""
    try:
        write_out(path, data)
    except OSError as e:
        raise InputError(f"cannot write {path}: {e.strerror or e}") from None


def write_out(path: str, data: bytes) -> None:
    """data into the file at path, or into the named pipe there when a process reads it. A pipe is opened
    without waiting (open(2) of a FIFO for writing blocks until a reader opens it; with O_NONBLOCK it fails
    at once with ENXIO when none has: fifo(7)), then written whole, waiting on a slow reader."""
    if not Path(path).is_fifo():
        Path(path).write_bytes(data)
        return
    try:
        fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
    except OSError as e:
        if e.errno == errno.ENXIO:
            raise OSError(e.errno, "no process is reading this named pipe (start its reader first)") from None
        raise
    with os.fdopen(fd, "wb") as pipe:
        os.set_blocking(fd, True)
        pipe.write(data)
