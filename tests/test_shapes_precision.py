"""The shapes model under --mixed-precision bf16: its training forward's attention runs in float32
(families/shapes.py _Float32TrainingAttention: torch's fused CPU SDPA backward is slow in bf16), the forwards
without gradients keep bf16 attention, and without autocast the model computes exactly what diffusers' processor
does."""
import torch

from families import shapes


def _inputs(batch=2):
    g = torch.Generator().manual_seed(0)
    return dict(hidden_states=torch.randn(batch, 3, 32, 32, generator=g),
                timestep=torch.rand(batch, generator=g) * 1000,
                encoder_hidden_states=torch.randn(batch, 16, 128, generator=g),
                pooled_projections=torch.randn(batch, 128, generator=g), return_dict=False)


def _attention_dtypes(transformer, grad, autocast):
    """The dtype of every joint attention's output in one forward."""
    seen = []
    handles = [m.register_forward_hook(lambda m, a, out: seen.append(out[0].dtype))
               for m in transformer.modules() if hasattr(m, "processor")]
    try:
        with torch.set_grad_enabled(grad), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            transformer(**_inputs())
    finally:
        for h in handles:
            h.remove()
    return set(seen), len(seen)


def test_training_attention_runs_in_float32_under_bf16_autocast(one_thread):
    transformer = shapes.build().transformer
    assert _attention_dtypes(transformer, grad=True, autocast=True) == ({torch.float32}, 6)  # 6 joint blocks
    assert _attention_dtypes(transformer, grad=False, autocast=True) == ({torch.bfloat16}, 6)
    assert _attention_dtypes(transformer, grad=True, autocast=False) == ({torch.float32}, 6)


def test_float32_forward_is_diffusers_processor_bit_for_bit(one_thread):
    transformer = shapes.build().transformer
    wrapped = transformer(**_inputs())[0]
    for m in transformer.modules():
        if hasattr(m, "processor"):
            assert isinstance(m.processor, shapes._Float32TrainingAttention)
            m.set_processor(m.processor.processor)  # diffusers' JointAttnProcessor2_0 as it loads
    assert torch.equal(wrapped, transformer(**_inputs())[0])
