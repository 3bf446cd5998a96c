"""The cache's contract: rolling back or compacting slots equals never having written them."""
import pytest
import torch
from hypothesis import given, strategies as st

from conftest import tiny_llama
from engine.fast import machine
from engine.kvcache import KVCache


def toks(seed, T):
    return torch.randint(0, 16, (1, T), generator=torch.Generator().manual_seed(seed))


@given(seed=st.integers(0, 2**16), P=st.integers(1, 8), R=st.integers(1, 6), T=st.integers(1, 4))
def test_truncate_then_decode_equals_never_written(seed, P, R, T):
    # Why: speculative decoding writes K rejected drafts, truncates, and goes on.
    model = tiny_llama(seed % 3)
    prompt, junk, nxt = toks(seed, P), toks(seed + 1, R), toks(seed + 2, T)
    clean = KVCache.for_model(model, P + R + T)
    model(prompt, torch.arange(P), clean)
    want = model(nxt, torch.arange(P, P + T), clean)
    dirty = KVCache.for_model(model, P + R + T)
    model(prompt, torch.arange(P), dirty)
    model(junk, torch.arange(P, P + R), dirty)
    dirty.truncate(P)
    got = model(nxt, torch.arange(P, P + T), dirty)
    torch.testing.assert_close(got, want, atol=1e-10, rtol=0)


@given(seed=st.integers(0, 2**16), P=st.integers(1, 6), data=st.data())
def test_keep_slots_equals_recompute(seed, P, data):
    # Why: lookahead verifies branches side by side, each token at its true position, and keeps
    # the accepted branch's slots. The kept cache must equal a cache built by plain decoding.
    model = tiny_llama(seed % 3)
    prompt = toks(seed, P)
    a, b = toks(seed + 1, 3), toks(seed + 2, 3)          # two 3-token branches after the prompt
    win = data.draw(st.integers(0, 1))
    n_keep = data.draw(st.integers(0, 3))
    cache = KVCache.for_model(model, P + 6 + 1)
    model(prompt, torch.arange(P), cache)
    # one forward, both branches at positions P..P+2, each branch causal within itself
    branch = torch.zeros(6, 6, dtype=torch.bool)
    branch[:3, :3] = branch[3:, 3:] = torch.tril(torch.ones(3, 3, dtype=torch.bool))
    mask = torch.cat([torch.ones(6, P, dtype=torch.bool), branch], 1)
    model(torch.cat([a, b], 1), torch.arange(P, P + 3).repeat(2), cache, mask=mask)
    cache.compact(P, [P + 3 * win + i for i in range(n_keep)])
    chosen = (a, b)[win][:, :n_keep]
    ref = KVCache.for_model(model, P + 6 + 1)
    model(torch.cat([prompt, chosen], 1), torch.arange(P + n_keep), ref)
    nxt = toks(seed + 3, 1)
    got = model(nxt, torch.tensor([P + n_keep]), cache)
    want = model(nxt, torch.tensor([P + n_keep]), ref)
    torch.testing.assert_close(got, want, atol=1e-10, rtol=0)
    assert cache.length == ref.length == P + n_keep + 1


def test_keep_moves_slots_in_order():
    c = KVCache(1, 1, 1, 10)
    c.k[0, 0, 0, :, 0] = torch.arange(10.0)
    c.length = 10
    c.compact(6, [7, 9])
    assert c.length == 8 and c.k[0, 0, 0, 6:8, 0].tolist() == [7.0, 9.0]


def test_overflow_is_a_clear_error():
    model = tiny_llama(0)
    cache = KVCache.for_model(model, 4)
    with pytest.raises(ValueError, match="capacity"):
        model(toks(0, 5), torch.arange(5), cache)
    assert cache.length == 0
    model(toks(0, 4), torch.arange(4), cache)    # exactly full is not over: a budget that fits runs
    assert cache.length == 4


def test_bad_truncate_and_keep_are_errors():
    c = KVCache(1, 1, 1, 10)
    c.length = 5
    with pytest.raises(ValueError):
        c.truncate(6)
    with pytest.raises(ValueError):
        c.compact(3, [2])
    with pytest.raises(ValueError):   # slot 5 is past the cached slots [0, 5): stale data
        c.compact(3, [4, 5])
    c.compact(3, [4])                    # the last cached slot is a slot like any other
    assert c.length == 4


@pytest.mark.parametrize("native, attends", [(False, torch.float32), (True, torch.bfloat16)])
def test_bf16_attends_in_fp32_only_where_the_cpu_lacks_native_bf16(monkeypatch, native, attends):
    # SDPA in bf16 costs 3.7-6.7x fp32's on a CPU whose ATen kernels are not AVX-512's (docs/archive/speed-log.md),
    # 4.5-8.6x on an AVX-512 EPYC without AMX; BF16_ATTENTION: AVX512 dispatch and AMX
    monkeypatch.setattr(machine, "BF16_ATTENTION", native)
    assert machine.attention_dtype(torch.bfloat16, "cpu") == attends
    assert machine.attention_dtype(torch.bfloat16, "cuda") == torch.bfloat16     # a GPU keeps its own
    for other in (torch.float32, torch.float64, torch.float16):
        assert machine.attention_dtype(other, "cpu") == other
    model = tiny_llama(0).to(torch.bfloat16)
    cache = KVCache.for_model(model, 8)
    assert cache.k.dtype == cache.v.dtype == attends
    seen = []
    for layer in model.layers:     # every layer attends in that dtype, with a cache and without
        attend = layer.attention.attend
        monkeypatch.setattr(layer.attention, "attend",
                            lambda q, k, v, f=attend, **kw: seen.append((q.dtype, k.dtype)) or f(q, k, v, **kw))
    tokens = torch.tensor([[1, 2, 3]])
    with_cache = model(tokens, torch.arange(3), cache)
    alone = model(tokens, torch.arange(3))
    assert seen == [(attends, attends)] * 2 * len(model.layers)
    # a bf16 path rounds by kernel and CPU: the two agree within bf16's rounding, not to the bit
    assert with_cache.dtype == alone.dtype == torch.float32
    torch.testing.assert_close(with_cache, alone, rtol=0, atol=0.05)
