"""Batch invariance (engine/fast/invariant.py): each attention row, and each row the probe checks,
rounds alike however many rows share the call, wherever its masked keys sit; the broken
variants (one matmul over all keys, SDPA over all rows, a kernel that treats one row apart)
are shown to fail the same tests.
"""
import random

import pytest
import torch

from engine.fast import invariant, packed


# --------------------------------------------------------------------------- attention

def chain_and_gaps(S: int, T: int):
    """A k-row mask two ways: a causal chain after S - T cached keys (speculative, lookup), and
    the same rows with 5 masked keys between the cache and them (lookahead's window slots)."""
    n = S - T
    chain = torch.arange(S)[None, :] <= (n + torch.arange(T))[:, None]            # (T, S)
    gaps = torch.cat([chain[:, :n], torch.zeros(T, 5, dtype=torch.bool), chain[:, n:]], 1)  # (T, S + 5)
    return chain, gaps


SDPA = torch.nn.functional.scaled_dot_product_attention


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("S", [37, 300, 700])
def test_row_attention_rows_round_as_plains_one_row_does(S, dtype):
    # Why: a decoder's verified row must get plain's bits, though it shares its forward with
    # other rows and its keys sit beside masked ones; plain computes it alone, unmasked, by SDPA.
    g = torch.Generator().manual_seed(S)
    H, Hkv, D, T = 9, 3, 64, 8
    q = torch.randn(1, H, T, D, generator=g).to(dtype)
    k, v = (torch.randn(1, Hkv, S, D, generator=g).to(dtype) for _ in range(2))
    chain, gaps = chain_and_gaps(S, T)
    junk = lambda x: torch.cat([x[:, :, :S - T], torch.randn(1, Hkv, 5, D, generator=g).to(dtype), x[:, :, S - T:]], 2)
    rows = invariant.row_attention(q, k, v, attn_mask=chain)                          # (1, H, T, D)
    gapped = invariant.row_attention(q, junk(k), junk(v), attn_mask=gaps)
    for t in range(T):                     # plain: row t alone, over its own keys [0, S - T + t]
        alone = SDPA(q[:, :, t:t + 1], k[:, :, :S - T + t + 1], v[:, :, :S - T + t + 1], enable_gqa=True)
        assert torch.equal(rows[:, :, t:t + 1], alone) and torch.equal(gapped[:, :, t:t + 1], alone)
    # and it is the attention SDPA computes over all rows, to the dtype's rounding
    ref = SDPA(q.double(), k.double(), v.double(), attn_mask=chain, enable_gqa=True)
    assert (rows.double() - ref).abs().max() < (0.02 if dtype == torch.bfloat16 else 1e-5)


def tree_rows_apart(attend, seed: int, H: int = 9, Hkv: int = 3, dtype=torch.bfloat16) -> int:
    """How many rows of a random lookahead-like step (a tree of T rows after c cached keys, each
    row seeing the cache and its ancestors) differ from the row alone over its own keys in
    position order, as plain computes it (SDPA, one row, no mask)."""
    rng, g = random.Random(seed), torch.Generator().manual_seed(seed)
    D, c, T = 64, rng.randint(5, 150), rng.randint(2, 12)
    parent = [-1] + [rng.randint(0, i - 1) for i in range(1, T)]
    q = torch.randn(1, H, T, D, generator=g).to(dtype)
    k, v = (torch.randn(1, Hkv, c + T, D, generator=g).to(dtype) for _ in range(2))
    mask = torch.zeros(T, c + T, dtype=torch.bool)
    mask[:, :c] = True
    keys = []
    for r in range(T):
        mine, j = [c + r], parent[r]
        while j >= 0:
            mine, j = [c + j] + mine, parent[j]
        mask[r, mine] = True
        keys.append(list(range(c)) + mine)
    rows = attend(q, k, v, attn_mask=mask)
    return sum(not torch.equal(rows[:, :, r:r + 1], SDPA(q[:, :, r:r + 1], k[:, :, keys[r]], v[:, :, keys[r]],
                                                         enable_gqa=True)) for r in range(T))


@pytest.mark.parametrize("H, Hkv", [(9, 3), (4, 4), (8, 2)], ids=["SmolLM2", "MHA", "g4"])
def test_row_attention_rows_of_a_tree_step_round_as_plain_rows(H, Hkv):
    # Why: lookahead's rows see the cache and their ancestors, with other rows' keys between;
    # each must get the bits plain gets for it alone, whichever keys its siblings wrote first
    # (and however many query heads share a kv head)
    assert sum(tree_rows_apart(invariant.row_attention, s, H, Hkv) for s in range(200)) == 0


@pytest.mark.parametrize("H, Hkv", [(9, 3), (4, 4)], ids=["SmolLM2", "MHA"])
def test_fp32_row_attention_rows_of_a_tree_step_round_as_plain_rows(H, Hkv):
    # Why: --batch-invariant on fp32 promises plain's bits for every verified row, as on bf16
    assert sum(tree_rows_apart(invariant.row_attention, s, H, Hkv, torch.float32) for s in range(60)) == 0


def test_a_tree_whose_rows_share_and_leave_a_path_rounds_as_plain_rows():
    # Why: row_attention writes a gapped row's own keys past the shared ones and keeps what the
    # row before it wrote where their key lists agree; a fixed tree pins both edges (a sibling
    # that differs in its last key, a cousin that differs earlier, a row shorter than the last)
    g = torch.Generator().manual_seed(3)
    c, H, Hkv, D = 40, 9, 3, 64
    visible = [[], [0], [0, 1], [0, 1, 2], [0, 1, 4], [0, 5], [0, 5, 6], [7]]   # new keys each row sees
    T = len(visible)
    mask = torch.zeros(T, c + T, dtype=torch.bool)
    mask[:, :c] = True
    for r, mine in enumerate(visible):
        mask[r, [c + j for j in mine + [r]]] = True
    q = torch.randn(1, H, T, D, generator=g).bfloat16()
    k, v = (torch.randn(1, Hkv, c + T, D, generator=g).bfloat16() for _ in range(2))
    rows = invariant.row_attention(q, k, v, attn_mask=mask)
    for r in range(T):
        keys = mask[r].nonzero().squeeze(1)
        assert torch.equal(rows[:, :, r:r + 1], SDPA(q[:, :, r:r + 1], k[:, :, keys], v[:, :, keys], enable_gqa=True)), r


def one_matmul(q, k, v, attn_mask=None, enable_gqa=True):
    """The broken variant: p @ v as one bf16 matmul over all S keys, the masked ones at weight 0."""
    B, H, T, D = q.shape
    g = H // k.shape[1]
    s = (q * D ** -0.5).reshape(B, k.shape[1], g * T, D) @ k.transpose(-1, -2)
    s = s.float().masked_fill(~attn_mask.repeat(g, 1), float("-inf")) if attn_mask is not None else s.float()
    e = (s - s.amax(-1, keepdim=True)).exp()
    return ((e / e.cumsum(-1)[..., -1:]).to(q.dtype) @ v).view(B, H, T, D)


def test_one_matmul_over_all_keys_fails_the_tree_test():
    assert sum(tree_rows_apart(one_matmul, s) for s in range(20)) > 0


def test_sdpa_over_all_rows_fails_the_row_invariance_test():
    # the broken variant: SDPA over all rows at once (its blocks follow the call's shape) is caught
    g = torch.Generator().manual_seed(700)
    S, H, Hkv, D, T = 700, 9, 3, 64, 8
    q = torch.randn(1, H, T, D, generator=g).bfloat16()
    k, v = (torch.randn(1, Hkv, S, D, generator=g).bfloat16() for _ in range(2))
    chain, gaps = chain_and_gaps(S, T)
    junk = lambda x: torch.cat([x[:, :, :S - T], torch.randn(1, Hkv, 5, D, generator=g).bfloat16(), x[:, :, S - T:]], 2)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    rows = sdpa(q, k, v, attn_mask=chain, enable_gqa=True)
    gapped = sdpa(q, junk(k), junk(v), attn_mask=gaps, enable_gqa=True)
    alone = [sdpa(q[:, :, t:t + 1], k[:, :, :S - T + t + 1], v[:, :, :S - T + t + 1], enable_gqa=True)
             for t in range(T)]
    assert not all(torch.equal(rows[:, :, t:t + 1], a) and torch.equal(gapped[:, :, t:t + 1], a)
                   for t, a in enumerate(alone))


@pytest.mark.parametrize("q8_head", [True, False])
def test_the_row_probe_sees_a_kernel_that_rounds_by_row_count(q8_head, monkeypatch):
    # Why: the CLI calls a --batch-invariant run exact only where this probe says the kernels
    # round rows alike; a kernel that takes another path for one row must make it say False.
    # Both int4 heads (the Q8 one, and bf16 where the dispatch is AVX2) round rows alike
    monkeypatch.setattr(packed, "Q8_HEAD", q8_head)
    from engine.llama import Llama, LlamaConfig
    cfg = LlamaConfig(dim=64, n_layers=1, n_heads=9, n_kv_heads=3, hidden_dim=96, vocab_size=64,
                      head_dim=64)   # SmolLM2's heads: where SDPA is seen to round rows apart
    torch.manual_seed(0)
    q = packed.prepack(packed.quantize_int4(Llama(cfg).float().requires_grad_(False)), batch_invariant=True)
    assert invariant.rows_round_alike(q)
    class OneRowApart(torch.nn.Module):       # the broken variant: one row rounds another way
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, x):
            return self.inner(x) * (1 + 2 ** -7 * (x.shape[0] == 1))
    w13 = q.layers[0].feed_forward.w13
    q.layers[0].feed_forward.w13 = OneRowApart(w13)
    assert not invariant.rows_round_alike(q)
    # and attention whose key blocks follow the call's shape (SDPA). The rarer, value-dependent
    # misses of one_matmul are the tree test's to catch: one probe cannot draw enough rows
    q.layers[0].feed_forward.w13 = w13
    q.layers[0].attention.attend = torch.nn.functional.scaled_dot_product_attention
    assert not invariant.rows_round_alike(q)
    # fp32: exact with --batch-invariant; plain fp32 (SDPA) rounds a verified row apart
    torch.manual_seed(0)
    assert invariant.rows_round_alike(packed.prepack(Llama(cfg).float().requires_grad_(False), batch_invariant=True))
    assert not invariant.rows_round_alike(packed.prepack(Llama(cfg).float().requires_grad_(False)))


def test_a_prompt_from_an_empty_cache_is_one_sdpa_call_and_a_tree_there_is_not():
    # Why: every decoder's first forward is its prompt alone (engine/generate.py), so the exact
    # path may send a prompt as one SDPA call, plain's prefill; any other rows from an empty
    # cache (a tree, or causal rows after cached keys) must still be computed row by row
    g = torch.Generator().manual_seed(5)
    T, H, Hkv, D = 40, 9, 3, 64
    q = torch.randn(1, H, T, D, generator=g).bfloat16()
    k, v = (torch.randn(1, Hkv, T, D, generator=g).bfloat16() for _ in range(2))
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    assert torch.equal(invariant.row_attention(q, k, v, attn_mask=causal),
                       SDPA(q, k, v, attn_mask=causal, enable_gqa=True))
    tree = causal.clone()
    tree[T // 2:, T // 2 - 1] = False                     # the second half skips one key
    rows = invariant.row_attention(q, k, v, attn_mask=tree)
    for r in range(T):
        keys = tree[r].nonzero().squeeze(1)
        assert torch.equal(rows[:, :, r:r + 1], SDPA(q[:, :, r:r + 1], k[:, :, keys], v[:, :, keys], enable_gqa=True)), r


def test_the_row_probe_attends_under_the_kernels_a_forward_on_its_device_may_use(monkeypatch):
    # on CUDA a forward may not use cuDNN (engine/llama.py); a probe free to would judge another kernel
    from engine.llama import Llama, LlamaConfig
    cfg = LlamaConfig(dim=32, n_layers=1, n_heads=4, n_kv_heads=2, hidden_dim=48, vocab_size=32)
    model, inside, calls = Llama(cfg).float().requires_grad_(False), [], []

    class Spy:
        def __init__(self, device):
            self.device = device

        def __enter__(self):
            inside.append(self.device.type)

        def __exit__(self, *exc):
            inside.pop()

    monkeypatch.setattr(invariant, "attention_kernels", Spy)
    def attend(*a, **k):
        calls.append(list(inside))
        return SDPA(*a, **k)

    monkeypatch.setattr(model.layers[0].attention, "attend", attend)
    invariant.rows_round_alike(model)
    assert calls and all(c == ["cpu"] for c in calls)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_batch_invariant_verify_rows_get_plains_one_row_logits_on_the_tests_device(dtype):
    # Why: the flag's promise on any device it runs on (make test-cuda runs this on a GPU):
    # a verify step's rows carry plain's one-row logits bit for bit, so no decoder can leave
    # plain's tokens. Without the flag, fp32's SDPA (and on CUDA, cuBLAS) round rows apart
    from conftest import DEVICE
    from engine.llama import Llama, LlamaConfig
    from tools.exact import margin
    cfg = LlamaConfig(dim=64, n_layers=2, n_heads=9, n_kv_heads=3, hidden_dim=96, vocab_size=64,
                      head_dim=64)   # SmolLM2's heads, where SDPA rounds a row by the call's shape
    prompts = {"a#0": list(range(1, 40)), "b#0": [5, 9, 2, 7] * 5}
    model = lambda: Llama(cfg).requires_grad_(False).to(DEVICE, dtype)
    torch.manual_seed(0)
    exact = packed.prepack(model(), batch_invariant=True)
    if DEVICE.type == "cpu" and not invariant.rows_round_alike(exact):   # as the CLI's claim, per CPU
        pytest.skip("invariant.rows_round_alike: this CPU's kernels round a row by row count")
    assert invariant.rows_round_alike(exact)
    assert margin(exact, prompts, 20, rows=8)["max_diff"] == 0
    torch.manual_seed(0)
    near = packed.prepack(model())
    if dtype == torch.float32 or DEVICE.type == "cuda":   # the broken variant: no flag
        assert margin(near, prompts, 20, rows=8)["max_diff"] > 0 and not invariant.rows_round_alike(near)
