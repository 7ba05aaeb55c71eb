"""The suite runs on pytest-xdist workers: `-n auto --dist loadfile --no-loadscope-reorder`, added by
pytest_cmdline_main below where xdist is loaded and the command line chose no -n or --dist of its own (in pytest.ini's
addopts they would be refused as unknown flags under `-p no:xdist`, which then runs the suite in one process).

- A test file runs whole on one worker, so a module-scoped fixture (a trained run, a loaded model) is built once.
- Workers: one more than the cores (at most 8). Many tests wait (on a subprocess starting, a rank, a signal, a file
  being written); the extra worker fills those waits. Each worker's torch, and the runs it starts, use
  cores / workers threads, at least one: more threads than cores slows small torch ops several-fold.
- The longest files start first (LONGEST_FIRST), so that the workers finish together; the rest keep their order.
"""
import os

import pytest

# The files whose tests take longest in all (about 1 to 3 minutes each on one thread), longest first.
LONGEST_FIRST = ("test_default_run.py", "test_fsdp.py", "test_faults.py", "test_train.py", "test_golden.py",
                 "test_recipes.py", "test_bench.py", "test_run_safety.py", "test_forward_train.py", "test_ranks.py")


@pytest.hookimpl(wrapper=True)  # around xdist's own pytest_cmdline_main, which turns -n into workers
def pytest_cmdline_main(config):
    if config.pluginmanager.hasplugin("xdist") and not hasattr(config, "workerinput"):  # a worker runs its share
        if config.option.numprocesses is None:  # no -n given
            config.option.numprocesses = "auto"
        if config.option.dist == "no":  # no --dist given
            config.option.dist = "loadfile"
        config.option.loadscopereorder = False
    return (yield)


@pytest.hookimpl(optionalhook=True)  # xdist's hook: unknown, and unused, under -p no:xdist
def pytest_xdist_auto_num_workers(config):
    return min(8, (os.cpu_count() or 1) + 1)


def pytest_configure(config):
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        threads = str(max(1, (os.cpu_count() or 1) // workers))
        os.environ["OMP_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = threads  # subprocesses inherit it
        import torch
        torch.set_num_threads(int(threads))


def pytest_collection_modifyitems(config, items):
    def rank(item):
        name = os.path.basename(str(item.path))
        return LONGEST_FIRST.index(name) if name in LONGEST_FIRST else len(LONGEST_FIRST)
    items.sort(key=rank)  # stable: within a file, and among the other files, collection order
