"""scripts/family_memory.py: the activation formula per block against a count by hand."""
import importlib.util
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
spec = importlib.util.spec_from_file_location("family_memory", os.path.join(ROOT, "scripts", "family_memory.py"))
family_memory = importlib.util.module_from_spec(spec)
spec.loader.exec_module(family_memory)


def test_block_bytes_by_hand():
    L, h = 100, 10
    # bf16 (2 bytes) per element, per token: attention 2 (norm input) + 2 (qkv input) + 6 (q, k, v) + 2 (output);
    # GELU MLP 2 (norm input) + 2 (first layer input) + 2 r (GELU input) + 2 r (GELU output) = 32 at r = 4
    assert family_memory.block_bytes(L, h, 4) == 32 * L * h
    # SwiGLU: gate, up, SiLU(gate) and their product, 2 r each
    assert family_memory.block_bytes(L, h, 3, swiglu=True) == (12 + 4 + 8 * 3) * L * h
    # Wan: a cross-attention to T text tokens adds its norm and query inputs, q and its output over the L video
    # tokens, and k and v over the T text tokens
    r = 8960 / 1536
    assert family_memory.block_bytes(L, h, r, text_tokens=512) == pytest.approx(
        (12 + 4 + 4 * r) * L * h + (2 + 2 + 2 + 2) * L * h + (2 + 2) * 512 * h)
