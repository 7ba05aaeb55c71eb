# Lets tests import the flat modules at the repository root (sde, losses, rewards, ...) and the scripts (bench, league,
# hacking from scripts/).
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(ROOT, "scripts"))
sys.path.insert(0, ROOT)
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # tests never reach a model hub
# One OpenMP thread per process, set before torch loads (subprocesses inherit it): the test models are too small
# to gain from threads, and on a 2-core machine idle OpenMP threads spin-wait for the core that the reward thread,
# OCR's onnxruntime or a second process needs; a 7 s test took 41 s that way.
os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(scope="module")
def one_thread():
    """torch on one intra-op thread for a module, even where OMP_NUM_THREADS asks for more: the modules that use
    it work on tiny tensors, where extra threads only contend with other processes (10x slower when loaded)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
