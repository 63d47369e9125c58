"""memcalc verify --step MODULE:FUNCTION: the user's own model and training step, measured as verify
measures its own (verify/meta.py: every storage the step makes and frees, what forward saves for
backward), at full size on the meta device, beside memcalc's prediction for the closest stack.

The function is called as FUNCTION(device, seq_len, micro_batch) and returns (model, optimizer, loss):
the model built on `device` (on meta nothing is allocated), a torch.optim optimizer over its
parameters, and loss(), which runs one forward pass and returns the scalar loss. memcalc runs a warm-up
step (loss().backward(), optimizer.step(), optimizer.zero_grad(set_to_none=True)), then the measured
one, phase by phase. examples/custom_step.py is one.
"""

from __future__ import annotations

import gc
import importlib
import importlib.util
import sys
import traceback
from pathlib import Path

import torch

from memcalc.errors import InputError

from .meta import StepBytes
from .track import LiveBytes, SavedBytes

TORCH_VERSION = torch.__version__


def load(spec: str):
    """'path/to/file.py:build' or 'package.module:build' -> the function, or a one-line InputError."""
    where, sep, name = spec.rpartition(":")
    if not sep or not where or not name:
        raise InputError(f"--step takes MODULE:FUNCTION or path/to/file.py:FUNCTION, got {spec!r}")
    if where.endswith(".py"):
        path = Path(where)
        if not path.is_file():
            raise InputError(f"--step: no file {where}")
        module_spec = importlib.util.spec_from_file_location(path.stem, path)
        module = importlib.util.module_from_spec(module_spec)
        sys.modules.setdefault(path.stem, module)
        module_spec.loader.exec_module(module)
    else:
        try:
            module = importlib.import_module(where)
        except ImportError as e:
            raise InputError(f"--step: cannot import {where}: {e}") from None
    fn = getattr(module, name, None)
    if not callable(fn):
        raise InputError(f"--step: {where} has no function {name}")
    return fn


def measure_user_step(fn, seq_len: int, micro_batch: int, device: str = "meta") -> tuple[StepBytes, int]:
    """Build the user's model, a warm-up step, then the measured step: its phases, saved bytes, parameters.
    An exception in the user's code is one line: what it was and where, in their file."""
    try:
        return measure(fn, seq_len, micro_batch, device)
    except InputError:
        raise
    except Exception as e:
        frames = traceback.extract_tb(e.__traceback__)
        user = [f for f in frames if "site-packages" not in f.filename and "/verify/" not in f.filename] or frames
        where = f"{user[-1].filename}:{user[-1].lineno}"
        raise InputError(f"--step: your step raised {type(e).__name__}: {e} ({where})") from None


def measure(fn, seq_len: int, micro_batch: int, device: str) -> tuple[StepBytes, int]:
    dev = torch.device(device)
    live = LiveBytes(dev.type)
    with live:  # entered before the build: every storage the user's code makes is counted by its op
        with dev:
            built = fn(dev, seq_len, micro_batch)
        # The build's garbage in reference cycles goes now, not whenever gc next runs (LiveBytes disables it):
        # a process's first build can leave its temporaries in one (torch's lazy first-call paths catch an
        # exception whose traceback keeps the caller's frame), and the measurement must not depend on it.
        gc.collect()
        if not (isinstance(built, tuple) and len(built) == 3 and callable(built[2])):
            raise InputError("--step: the function must return (model, optimizer, loss), loss a function of no arguments")
        model, optimizer, loss_fn = built
        gc.collect()  # what the build left in reference cycles (first calls into torch make some) is freed, as
        # Python's collector frees it before long; the tracker keeps gc off from here, so the phases are the step's
        saved = SavedBytes(list(model.parameters()) + list(model.buffers()), live)
        weights = live.live_bytes  # parameters, buffers and whatever else the build kept (inputs)
        step(loss_fn, optimizer)  # warm-up: makes the optimizer's state
        before = live.live_bytes
        live.phase = "forward"
        live.reset_peak()
        with saved.hooks():
            loss = loss_fn()
        saved.release()
        retained = live.live_bytes - before
        forward = (live.peak_bytes, live.peak_at)
        live.phase = "backward"
        live.reset_peak()
        loss.backward()
        del loss
        backward = (live.peak_bytes, live.peak_at)
        grads = live.live_bytes - before
        live.phase = "optimizer"
        live.reset_peak()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        opt = (live.peak_bytes, live.peak_at)
    layers = sum(1 for m in model.modules() if isinstance(m, torch.nn.ModuleList) for _ in m) or 1
    by_op = tuple(sorted(saved.by_op().items(), key=lambda kv: -kv[1]))
    n_params = sum(p.numel() for p in model.parameters())
    return StepBytes(layers, weights, 0, before, saved.total_bytes, retained, grads, forward[0], backward[0], opt[0],
                     forward[1], backward[1], opt[1], by_op), n_params  # fmt: skip


def step(loss_fn, optimizer) -> None:
    loss = loss_fn()
    loss.backward()
    del loss
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
