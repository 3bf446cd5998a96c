"""The model's contract: caching, kept rows, trimmed mask rows and frozen layers change
nothing a caller reads. Every decoder's exactness rests on these properties."""
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, strategies as st

from conftest import tiny_llama
from engine.draft import lower, upper
from engine.kvcache import KVCache
import engine.llama
from engine.llama import apply_rope, attention_kernels, causal_mask, rope
from engine.load.config import config_from_hf

ATOL = 1e-10


def tokens_for(seed, T, V=16):
    return torch.randint(0, V, (1, T), generator=torch.Generator().manual_seed(seed))


@given(seed=st.integers(0, 2**16), T=st.integers(2, 12), data=st.data())
def test_incremental_decode_matches_full_forward(seed, T, data):
    # Why: every decoder feeds the prompt in chunks; the cache must make that invisible.
    model = tiny_llama(seed % 3, tie=bool(seed % 2))
    tokens = tokens_for(seed, T)
    full = model(tokens, torch.arange(T))                                   # (1, T, V)
    cuts = sorted(set(data.draw(st.lists(st.integers(1, T - 1), max_size=3))))
    cache, parts = KVCache.for_model(model, T), []
    for a, b in zip([0] + cuts, cuts + [T]):
        parts.append(model(tokens[:, a:b], torch.arange(a, b), cache))
    torch.testing.assert_close(torch.cat(parts, 1), full, atol=ATOL, rtol=0)
    assert cache.length == T


@given(seed=st.integers(0, 2**16), T=st.integers(1, 10), data=st.data())
def test_kept_rows_equal_the_same_rows_of_a_full_forward(seed, T, data):
    # Why: decoders ask for logits of a few rows; `keep` must return exactly those rows.
    model = tiny_llama(seed % 3)
    tokens = tokens_for(seed, T)
    keep = data.draw(st.lists(st.integers(0, T - 1), min_size=1, max_size=T, unique=True))
    full = model(tokens, torch.arange(T))
    kept = model(tokens, torch.arange(T), keep=torch.tensor(keep))
    torch.testing.assert_close(kept, full[:, keep], atol=ATOL, rtol=0)


def test_negative_keep_counts_from_the_end(model):
    tokens = tokens_for(0, 5)
    full = model(tokens, torch.arange(5))
    torch.testing.assert_close(model(tokens, torch.arange(5), keep=[-1]), full[:, [4]])


@given(seed=st.integers(0, 2**16), P=st.integers(1, 6), T=st.integers(1, 6), data=st.data())
def test_trimmed_mask_rows_leave_the_kept_rows_unchanged(seed, P, T, data):
    # Why: lookahead sends only the query rows it needs. A row's output depends on the keys it
    # sees, not on which other queries were sent, so dropping rows nobody attends to is exact.
    model = tiny_llama(seed % 3)
    tokens = tokens_for(seed, P + T)
    cache = KVCache.for_model(model, P + T)
    model(tokens[:, :P], torch.arange(P), cache)
    full = model(tokens[:, P:], torch.arange(P, P + T), cache)              # causal, all rows
    cache.truncate(P)
    # the last r rows are attended by no kept row, so they may be dropped from the query
    r = data.draw(st.integers(0, T - 1))
    mask = causal_mask(P, T - r)
    trimmed = model(tokens[:, P:P + T - r], torch.arange(P, P + T - r), cache, mask=mask)
    torch.testing.assert_close(trimmed, full[:, :T - r], atol=ATOL, rtol=0)


@given(seed=st.integers(0, 2**16), T=st.integers(2, 10), data=st.data())
def test_trim_last_layer_is_exact(seed, T, data):
    # Why: in the last layer no later layer reads a frozen row's K/V, so m=1 must be exact.
    model = tiny_llama(seed % 3)
    tokens = tokens_for(seed, T)
    keep = data.draw(st.lists(st.integers(0, T - 1), min_size=1, max_size=T, unique=True))
    full = model(tokens, torch.arange(T), keep=torch.tensor(keep))
    trimmed = model(tokens, torch.arange(T), keep=torch.tensor(keep), trim_layers=1)
    torch.testing.assert_close(trimmed, full, atol=ATOL, rtol=0)


def test_trim_layers_changes_only_rows_that_attend_to_frozen_rows(model):
    # Why: for m>1, a kept row is exact when every row it sees is kept too (lookahead's
    # verification rows); a kept row that sees a frozen row does change, so the knob is real.
    T = 6
    tokens = tokens_for(3, T)
    mask = causal_mask(0, T)
    mask[5, 2:5] = False                                 # row 5 sees only rows 0, 1 and itself
    full = model(tokens, torch.arange(T), mask=mask)
    keep = torch.tensor([0, 1, 5])
    trimmed = model(tokens, torch.arange(T), mask=mask, keep=keep, trim_layers=2)
    torch.testing.assert_close(trimmed, full[:, keep], atol=ATOL, rtol=0)
    causal = model(tokens, torch.arange(T), keep=[5])                 # row 5 sees rows 2..4 too
    frozen = model(tokens, torch.arange(T), keep=[5], trim_layers=2)
    assert (frozen - causal).abs().max() > 1e-3


def test_repeated_positions_give_identical_rows(model):
    # Why: lookahead sends several tokens with one position; positions are not slots.
    cache = KVCache.for_model(model, 8)
    model(tokens_for(1, 3), torch.arange(3), cache)
    tok = torch.tensor([[5, 5]])
    mask = torch.tensor([[1, 1, 1, 1, 0], [1, 1, 1, 0, 1]], dtype=torch.bool)
    out = model(tok, torch.tensor([3, 3]), cache, mask=mask)
    torch.testing.assert_close(out[:, 0], out[:, 1], atol=ATOL, rtol=0)


def test_attention_matches_explicit_softmax_math():
    # Why: the model calls SDPA with a boolean (T, S) mask and GQA; this is the formula it means.
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 4, 3, 8, generator=g, dtype=torch.float64)
    k = torch.randn(1, 2, 5, 8, generator=g, dtype=torch.float64)
    v = torch.randn(1, 2, 5, 8, generator=g, dtype=torch.float64)
    mask = causal_mask(2, 3)
    mask[2, 0] = False
    kk, vv = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
    scores = (q @ kk.transpose(-1, -2)) / 8 ** 0.5
    ref = scores.masked_fill(~mask, float("-inf")).softmax(-1) @ vv
    got = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    torch.testing.assert_close(got, ref, atol=1e-12, rtol=0)


def test_rope_is_a_rotation_by_position_times_frequency():
    # Why: pin the HF half-split convention: pair (i, i + D/2) turns by p * theta^(-2i/D).
    D, p = 8, 7
    cos, sin = rope(torch.tensor([p]), D, 10000.0, torch.float64)
    x = torch.zeros(1, 1, 1, D, dtype=torch.float64)
    x[..., 1] = 1.0                                      # unit vector on the first half, pair 1
    y = apply_rope(x, cos, sin)
    angle = torch.tensor(p * 10000.0 ** (-2 * 1 / D), dtype=torch.float64)
    assert torch.isclose(y[..., 1], angle.cos()) and torch.isclose(y[..., 1 + D // 2], angle.sin())



@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_rows_are_the_correctly_rounded_tables_however_many_share_a_call(dtype):
    # Why: a verify forward of k rows and plain's one-row step must rotate a position alike,
    # and two processes must agree; torch's fp32 cos split a 42-row table between threads and
    # came out ~2^-14 off on one thread's rows in some processes (docs/exact-paths.md)
    T, D, theta = 300, 64, 100000.0                     # 300 x 64 entries: past torch's 2,048 split
    cos, sin = rope(torch.arange(T), D, theta, dtype)
    for p in (0, 1, 41, 150, T - 1):
        c, s = rope(torch.tensor([p]), D, theta, dtype)
        assert torch.equal(c[0], cos[p]) and torch.equal(s[0], sin[p])
    f = 1.0 / theta ** (torch.arange(0, D, 2).float() / D)                  # fp32, as frequencies()
    angles = (torch.arange(T).float()[:, None] * f[None, :]).double()       # fp32 angles, exact in fp64
    angles = torch.cat([angles, angles], -1)
    assert torch.equal(cos, torch.from_numpy(np.cos(angles.numpy())).float().to(dtype))
    assert torch.equal(sin, torch.from_numpy(np.sin(angles.numpy())).float().to(dtype))

def test_config_from_hf_reads_the_fields():
    cfg = config_from_hf({"hidden_size": 576, "num_hidden_layers": 30, "num_attention_heads": 9,
                               "num_key_value_heads": 3, "intermediate_size": 1536, "vocab_size": 49152,
                               "rope_theta": 100000.0, "rms_norm_eps": 1e-5, "tie_word_embeddings": True})
    assert (cfg.head_dim, cfg.n_kv_heads, cfg.tie_embeddings, cfg.rope_theta) == (64, 3, True, 100000.0)


def test_wrong_mask_shape_is_a_clear_error(model):
    with pytest.raises(ValueError, match="mask"):
        model(tokens_for(0, 3), torch.arange(3), mask=torch.ones(3, 4, dtype=torch.bool))


@given(seed=st.integers(0, 2**16), split=st.integers(0, 2))
def test_running_the_layers_in_two_pieces_equals_one_forward(seed, split):
    # Why: early exits (contrastive amateur) and self-drafts run the model in pieces.
    model = tiny_llama(seed % 3)
    tokens = tokens_for(seed, 5)
    cache = KVCache.for_model(model, 5)
    x = model.blocks(model.tok_embeddings(tokens), torch.arange(5), cache, stop=split)
    x = model.blocks(x, torch.arange(5), cache, start=split)
    torch.testing.assert_close(model.head(x), model(tokens, torch.arange(5)), atol=ATOL, rtol=0)
    assert cache.length == 0  # blocks() never advances the cache; forward() does


@given(seed=st.integers(0, 2**16), split=st.integers(0, 2), first=st.integers(1, 4))
def test_lower_then_upper_equals_a_cached_forward(seed, split, first):
    # Why: self-drafts and early-exit amateurs feed tokens through `lower` one piece at a
    # time (advancing the cache), then resume all of them at once with `upper`.
    model = tiny_llama(seed % 3)
    tokens = tokens_for(seed, 5)
    cache = KVCache.for_model(model, 5)
    h1 = lower(model, tokens[:, :first], torch.arange(first), cache, split)
    h2 = lower(model, tokens[:, first:], torch.arange(first, 5), cache, split)
    assert cache.length == 5
    x = upper(model, torch.cat([h1, h2], 1), torch.arange(5), cache, 0, split)
    assert cache.length == 5
    want_cache = KVCache.for_model(model, 5)
    want = model(tokens, torch.arange(5), want_cache)
    torch.testing.assert_close(model.head(x), want, atol=ATOL, rtol=0)
    torch.testing.assert_close(cache.k, want_cache.k, atol=ATOL, rtol=0)   # every layer's K/V


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
def test_rms_norm_gives_the_reference_bits(dtype):
    # the reference (HF LlamaRMSNorm): normalise in fp32, cast back, then scale by the weight
    from engine.llama import RMSNorm
    g = torch.Generator().manual_seed(0)
    norm = RMSNorm(96, 1e-5).to(dtype)
    norm.weight.data = torch.randn(96, generator=g).to(dtype)
    for _ in range(20):
        x = (torch.randn(3, 5, 96, generator=g) * 10 * torch.rand(1, generator=g)).to(dtype)
        xf = x.to(torch.promote_types(dtype, torch.float32))
        want = norm.weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5)).to(dtype)
        assert torch.equal(norm(x), want)


def test_one_row_without_a_mask_equals_one_row_with_the_full_mask(model):
    # blocks() skips the mask for a lone new row (it sees every key); that must change no bit
    cache = KVCache.for_model(model, 16)
    model(torch.tensor([[1, 2, 3, 4]]), torch.arange(4), cache)
    a = model(torch.tensor([[5]]), torch.tensor([4]), cache)
    cache.truncate(4)
    b = model(torch.tensor([[5]]), torch.tensor([4]), cache, mask=torch.ones(1, 5, dtype=torch.bool))
    assert torch.equal(a, b)


def test_a_cuda_forward_may_not_use_cudnn_attention_and_a_cpu_one_keeps_torchs_choice():
    # cuDNN plans its kernel per shape, and a decoder's key length changes every step (docs/cuda.md)
    backends = torch.backends.cuda
    before = backends.cudnn_sdp_enabled()
    with attention_kernels(torch.device("cuda")):
        assert not backends.cudnn_sdp_enabled()
        assert backends.flash_sdp_enabled() and backends.mem_efficient_sdp_enabled() and backends.math_sdp_enabled()
    assert backends.cudnn_sdp_enabled() == before             # restored on the way out
    backends.enable_cudnn_sdp(True)
    try:
        with attention_kernels(torch.device("cpu")):
            assert backends.cudnn_sdp_enabled()               # torch's own choice, untouched
    finally:
        backends.enable_cudnn_sdp(before)


def test_every_layer_attends_inside_the_kernel_choice_for_the_forwards_device(model, monkeypatch):
    entered, seen = [], []

    class Spy:
        def __init__(self, device):
            entered.append(device.type)

        def __enter__(self):
            seen.append("in")

        def __exit__(self, *exc):
            seen.append("out")

    monkeypatch.setattr(engine.llama, "attention_kernels", Spy)
    for layer in model.layers:
        attend = layer.attention.attend
        monkeypatch.setattr(layer.attention, "attend", lambda *a, f=attend, **k: seen.append("attend") or f(*a, **k))
    device = model.tok_embeddings.weight.device        # make test-cuda runs this one on a GPU
    model(torch.tensor([[1, 2, 3]], device=device), torch.arange(3, device=device), KVCache.for_model(model, 8))
    assert entered == [device.type]
    assert seen == ["in"] + ["attend"] * len(model.layers) + ["out"]


def test_building_on_meta_imports_no_compiler_and_a_cpu_model_draws_nn_embeddings_init():
    # Why: weights.load_model builds the model on the meta device, then assigns the checkpoint's
    # tensors; nn.Embedding's own init (normal_) there imports torch._dynamo and sympy, ~2.5 s of
    # every CLI run for nothing. The weight is given instead, drawn as nn.Embedding draws it, so
    # a model built on the CPU (the tests' random ones) keeps its bits. Caught broken variants:
    # the plain nn.Embedding(V, C) (torch._dynamo imported); torch.randn on meta (sympy imported)
    script = ("import sys, torch\nfrom engine.llama import Llama, LlamaConfig\n"
              "cfg = LlamaConfig(dim=32, n_layers=1, n_heads=4, n_kv_heads=2, hidden_dim=64, vocab_size=16)\n"
              "with torch.device('meta'):\n    Llama(cfg)\nprint(sorted({'torch._dynamo', 'sympy'} & set(sys.modules)))")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                         cwd=Path(__file__).resolve().parents[1])
    assert out.stdout.strip() == "[]", out.stderr[-1000:]
    cfg = engine.llama.LlamaConfig(dim=32, n_layers=1, n_heads=4, n_kv_heads=2, hidden_dim=64, vocab_size=16)
    torch.manual_seed(3)
    ours = engine.llama.Llama(cfg).tok_embeddings.weight
    torch.manual_seed(3)
    assert torch.equal(ours, torch.nn.Embedding(16, 32).weight)
