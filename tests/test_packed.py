"""The packed CPU linear path: a kernel swap that must give nn.Linear's logits (to the
dtype's rounding), and with batch_invariant a row's outputs must not depend on how many rows share
its forward.
"""
import pytest
import torch

from engine import packed
from engine.kvcache import KVCache
from conftest import tiny_llama

needs_onednn = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="no oneDNN")


def pair(tie=False, dtype=torch.float32):
    from engine.bench import twin
    model = tiny_llama(0, vocab=64, tie=tie).to(dtype)
    return twin(model), packed.prepack(model)


@needs_onednn
@pytest.mark.parametrize("tie, dtype, tol", [(False, torch.float32, 1e-5), (True, torch.float32, 1e-5),
                                             (False, torch.bfloat16, 3e-2)])
def test_prepacked_model_gives_the_logits_of_nn_linear(tie, dtype, tol):
    # why: prepack is a kernel swap, never a model change (bf16: to a bf16 rounding or two)
    naive, fast = pair(tie, dtype)
    assert isinstance(fast.layers[0].feed_forward.w13, packed.PackedLinear)
    tokens, pos = torch.randint(0, 64, (1, 7)), torch.arange(7)
    a = naive(tokens, pos, KVCache.for_model(naive, 8))
    b = fast(tokens, pos, KVCache.for_model(fast, 8))
    torch.testing.assert_close(a, b, rtol=tol, atol=tol)


def test_prepack_leaves_float64_models_alone():
    # why: the exactness tests run float64 models; they must keep nn.Linear
    model = packed.prepack(tiny_llama(0))
    assert type(model.layers[0].attention.wqkv) is torch.nn.Linear and model.packed_head is None


@needs_onednn
@pytest.mark.parametrize("shape", [(96, 40), (576, 1536)])  # (576, 1536): SmolLM2's down proj
def test_batch_invariant_rows_do_not_depend_on_the_row_count(shape):
    # why: a decoder verifying k rows must round row t exactly as a one-row step would
    lin = packed.PackedLinear(torch.randn(shape), min_rows=2)  # prepack(batch_invariant=True)
    x = torch.randn(1, 23, shape[1])
    full = lin(x)
    for n in range(1, 23):
        assert torch.equal(lin(x[:, :n]), full[:, :n])
        assert torch.equal(lin(x[:, n - 1:n]), full[:, n - 1:n])


@needs_onednn
def test_one_row_kernel_rounds_differently_so_the_padding_is_needed():
    # the broken variant: without the zero row, a one-row step takes oneDNN's matrix-vector
    # kernel, whose bits differ; the test above must be able to see that
    g = torch.Generator().manual_seed(0)
    lin = packed.PackedLinear(torch.randn(576, 1536, generator=g), min_rows=1)
    x = torch.randn(1, 8, 1536, generator=g)
    full = lin(x)
    assert any(not torch.equal(lin(x[:, t:t + 1]), full[:, t:t + 1]) for t in range(8))
