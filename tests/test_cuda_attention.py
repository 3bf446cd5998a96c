"""tools/cuda_attention.py: the GPU diagnostic leaves the engine's kernel choice as it found it
and names the kernel torch would pick (its timings mean something on a GPU only)."""
import pytest
from torch.nn.attention import SDPBackend as B

import engine.llama
from conftest import tiny_llama
from tools.cuda_attention import chosen, step_ms


def test_timing_a_kernel_set_restores_the_engines_choice_even_when_a_step_fails(monkeypatch):
    model, before = tiny_llama(), engine.llama.CUDA_ATTENTION
    step_ms(model, [B.MATH], steps=2, prompt=4)
    assert engine.llama.CUDA_ATTENTION is before
    forward = model.forward
    monkeypatch.setattr(model, "forward", lambda t, *a, **k: forward(t, *a, **k) if t.shape[1] > 1 else 1 / 0)
    with pytest.raises(ZeroDivisionError):
        step_ms(model, [B.CUDNN_ATTENTION], steps=2, prompt=4)
    assert engine.llama.CUDA_ATTENTION is before


def test_it_names_the_kernel_torch_picks_and_none_where_no_allowed_kernel_fits():
    model = tiny_llama()
    assert chosen(model, [B.MATH]) == "MATH"
    assert chosen(model, [B.CUDNN_ATTENTION]) == "none"      # no cuDNN on a CPU: said, not raised
