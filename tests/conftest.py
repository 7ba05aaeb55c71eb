"""The suite runs on pytest-xdist workers (pytest.ini: `-n auto --maxprocesses 2 --dist loadgroup`).

Two things keep the parallel run as fast and as exact as the serial one:
- each worker's torch uses cores / workers threads (1 on 2 cores), and so do the runs it starts: two workers of
  two threads each on 2 cores oversubscribe them, which slows small torch ops several-fold;
- the tests of a file that builds a module- or session-scoped fixture (a trained run, a loaded model) go to one
  worker together, so the fixture is built once; every other test is handed to whichever worker is free.
"""
import os

import pytest


def pytest_configure(config):
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        threads = str(max(1, (os.cpu_count() or 1) // workers))
        os.environ["OMP_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = threads  # subprocesses inherit it
        import torch
        torch.set_num_threads(int(threads))


def _shares_a_fixture(item):
    info = getattr(item, "_fixtureinfo", None)
    defs = getattr(info, "name2fixturedefs", {}) if info is not None else {}
    return any(d and d[-1].scope in ("module", "package", "session") for d in defs.values())


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook, which reads the marks into the test ids
def pytest_collection_modifyitems(config, items):
    for item in items:
        if _shares_a_fixture(item):
            item.add_marker(pytest.mark.xdist_group(item.module.__name__))
