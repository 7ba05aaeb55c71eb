# Lets tests import the flat modules at the repository root (sde, losses, rewards, ...).
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # tests never reach a model hub
