"""What makes the suite fast on a 2-core machine; no test's check depends on it.

pyproject.toml runs the tests on pytest-xdist workers, one per core (`-n auto`), each test on
whichever worker is free: a test must not count on another having run in its process.
`python -m pytest -n0 ...` runs them all in the pytest process instead.
"""

import functools
import gc
import os
import shutil
import tempfile

import pytest
import typer.testing
from hypothesis import settings

# No per-example deadline: a property holds or not whatever the machine's load, and a shared CI
# runner (or two xdist workers on two cores) can stretch one example past hypothesis's 200 ms.
settings.register_profile("memcalc", deadline=None)
settings.load_profile("memcalc")

# typer's CliRunner builds the click command from the app's functions' signatures at every invoke (~8 ms,
# a thousand invokes a run): build each app's once. A click command keeps no state between invocations.
if hasattr(typer.testing, "_get_command"):
    typer.testing._get_command = functools.cache(typer.testing._get_command)

# One intra-op thread per process, set before torch is imported. The tensors here are tiny: with
# two xdist workers on two cores, two OpenMP threads each only contend (the CPU stand-in tests
# of test_verify_cuda.py ran 1.5x slower even alone). A value set by the user is kept.
os.environ.setdefault("OMP_NUM_THREADS", "1")

# memcalc remembers replayed steps on disk (memcalc.exact.base.cache): the tests keep theirs apart, fresh for
# each run, so that they replay every step and never read a developer's cache. One folder per run: the
# pytest process makes it and its xdist workers inherit it through the environment (the environment is
# copied when they start), so a step one worker replayed the other reads (the cache writes each file
# whole: memcalc.exact.base.cache.remembered). A worker takes the folder only where MEMCALC_TEST_CACHE names
# the MEMCALC_CACHE its own run made; else (a worker of no such run) it makes its own. The tests of the
# cache itself point MEMCALC_CACHE at folders of their own (tmp_path).
_RUN_CACHE = "MEMCALC_TEST_CACHE"
_inherited = os.environ.get(_RUN_CACHE, "")
_SHARED = bool(os.environ.get("PYTEST_XDIST_WORKER") and _inherited and _inherited == os.environ.get("MEMCALC_CACHE")
               and os.path.isdir(_inherited))  # fmt: skip
if not _SHARED:
    os.environ["MEMCALC_CACHE"] = os.environ[_RUN_CACHE] = tempfile.mkdtemp(prefix="memcalc-cache-")


def pytest_configure(config):
    config.addinivalue_line("markers", "slow(fast): a slow example that runs where MEMCALC_SLOW=1 (.ci/run sets it); "
                                       "fast names the check of the same thing that runs everywhere")


def pytest_collection_modifyitems(config, items):
    """Tests marked slow are skipped unless MEMCALC_SLOW is set (CI sets it: .ci/run), as tests/test_docs.py
    skips the examples that take minutes: each names the quick check of the same thing that always runs."""
    if os.environ.get("MEMCALC_SLOW"):
        return
    for item in items:
        mark = item.get_closest_marker("slow")
        if mark is not None:
            assert mark.args, f"{item.nodeid}: @pytest.mark.slow(fast) names the quick check that always runs"
            item.add_marker(pytest.mark.skip(reason=f"slow, runs where MEMCALC_SLOW=1; everywhere: {mark.args[0]}"))


def pytest_unconfigure(config):
    """The run's cache folder goes when the process that made it ends (its workers have ended by then)."""
    if not _SHARED:
        shutil.rmtree(os.environ[_RUN_CACHE], ignore_errors=True)


def pytest_runtest_setup(item):
    """Every measurement starts with gc.collect() (verify/track.py's LiveBytes, verify/cuda.py's
    release), and a collection scans every object alive: some 300,000 once torch, hypothesis and
    the test modules are loaded, 0.15 s a call, hundreds of calls. So before each test, collect the
    garbage and freeze the survivors into the generation the collector skips: a test's own
    collections scan only what it created. (A frozen object that later becomes garbage is never
    freed, so it cannot be freed in the middle of a measurement either.)"""
    gc.collect()
    gc.freeze()
