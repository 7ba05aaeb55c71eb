# Lets tests import the flat modules at the repository root (sde, losses, rewards, ...).
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # tests never reach a model hub
# One OpenMP thread per process, set before torch loads (subprocesses inherit it): the test models are too small
# to gain from threads, and on a 2-core machine idle OpenMP threads spin-wait for the core that the reward thread,
# OCR's onnxruntime or a second process needs; a 7 s test took 41 s that way.
os.environ.setdefault("OMP_NUM_THREADS", "1")
