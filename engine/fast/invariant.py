"""Batch invariance: a row's bits never depend on how many rows share its forward.

Lookahead, lookup and speculative decoding verify k rows in one forward and keep the tokens
plain decoding would have drawn, one row at a time. That holds bit for bit only where every
kernel rounds a row alike in a k-row call and in a one-row call; then every decoder prints
plain's tokens on that path, fp32, bf16 or 4-bit (`--batch-invariant`, packed.prepack):
- matmuls: oneDNN's 2..32-row kernel, one row sent as two (packed.PackedLinear, min_rows=2);
  torch's int4 kernel, row-invariant as measured here; on CUDA, cuBLAS at one row count, 32
  (packed.PaddedLinear);
- attention: `row_attention` below, SDPA called for each row alone, as plain calls it (a
  prompt excepted: one call, the same in every decoder, whose first forward is plain's);
- the probe `rows_round_alike(model)`, which the CLI's "exact path" claim rests on, per machine.
A reader learning the decoders may skip this file: on an inexact path they are still exact in
law, and differ from plain only where a near-tie falls the other way.
"""
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from engine.fast.machine import attention_dtype
from engine.llama import Llama, attention_kernels

MOST_ROWS = 32   # rows per batch-invariant matmul call: oneDNN's 2..32-row kernel (packed.PackedLinear),
                 # and on CUDA every call's row count (packed.PaddedLinear)


def row_attention(q: Tensor, k: Tensor, v: Tensor, attn_mask: Tensor | None = None,
                  enable_gqa: bool = True) -> Tensor:
    """SDPA's softmax(q k^T / sqrt(D) + log mask) v for q (B, H, T, D), k, v (B, Hkv, S, D) and a
    bool attn_mask (T, S) shared by the batch (True = may attend), grouped-query always: each
    query row computed alone over its own visible keys, in slot order, with no mask, as plain
    decoding computes that row in its one-row step. So a row's bits depend on its query and its
    keys' values only, never on the other rows of the forward or on keys it may not see (a
    prompt from an empty cache excepted: one call, made alike by every decoder).

    SDPA over all T rows at once is not that: its CPU kernel walks queries and keys in blocks
    whose bounds follow the call's shape, and it adds a mask, so a verified row (one of k,
    masked, its keys beside other rows' keys) rounds apart from plain's one-row step, in fp32
    as in bf16 (tests/test_invariant.py). A one-row step is SDPA's call as it is; a k-row
    forward pays k calls per layer (docs/archive/speed-log.md).
    - a prompt (causal rows from an empty cache) is one SDPA call, as plain's prefill is;
    - a row whose keys are slots [0, n) attends to a view of the cache, no copy (a plain step,
      speculative's and lookup's chains, lookahead's copy);
    - a row with gaps (lookahead's tree: other rows' keys between its own): `gapped_rows`.
    """
    T, sdpa = q.shape[2], F.scaled_dot_product_attention
    if attn_mask is None and T == 1:                                  # plain's step
        return sdpa(q, k, v, enable_gqa=True)
    if attn_mask is None:                                             # every row sees every key
        attn_mask = torch.ones(T, k.shape[2], dtype=torch.bool, device=q.device)
    S = attn_mask.shape[1]
    if S == T and torch.equal(attn_mask, torch.ones_like(attn_mask).tril()):
        # a prompt, causal from an empty cache: every decoder's first forward is its prompt
        # alone, as plain's (engine/generate.py), so these rows need not round as one-row
        # calls would: the same call in every decoder gives every decoder the same bits
        return sdpa(q, k, v, attn_mask=attn_mask, enable_gqa=True)
    # the mask read in NumPy: a few microseconds an op where torch's small ops take ~10 (every
    # layer of a k-row forward reads it: 1-2 ms a forward saved); the same numbers either way
    visible = attn_mask.cpu().numpy()                                 # (T, S) bool
    seen = visible.sum(1).tolist()                                    # keys each row sees
    # of them, leading from slot 0: up to the row's first masked key (argmin: the first False);
    # subtle: no cumprod, which makes a (T, S) int64 (512 MiB an 8k-token prompt's layer)
    lead = np.where(visible.all(1), S, visible.argmin(1)).tolist()
    rows = q.split(1, 2)                                              # T x (B, H, 1, D)
    y = [sdpa(x, k.narrow(2, 0, n), v.narrow(2, 0, n), enable_gqa=True) if n == m else None
         for x, n, m in zip(rows, seen, lead)]
    for r, keys, values in gapped_rows(k, v, visible, min(lead, default=0), [r for r in range(T) if y[r] is None]):
        y[r] = sdpa(rows[r], keys, values, enable_gqa=True)
    return torch.cat(y, 2)                                            # (B, H, T, D)


def gapped_rows(k: Tensor, v: Tensor, mask: np.ndarray, f: int, rows: list[int]):
    """(row, its keys, its values) for each row of `rows`, whose visible keys have gaps: the
    keys every row sees, [0, f), copied once into a buffer, then the row's own keys past f,
    in slot order. Rows go in the order of their key lists, so a row after its parent
    writes one key (what the last row wrote stays where the two lists agree). The keys and
    values yielded are views of that buffer: each holds only until the next row is asked for."""
    if not rows:
        return
    mine = {r: [] for r in rows}
    row_of, key_of = np.nonzero(mask[:, f:])                         # row by row, in slot order
    for r, j in zip(row_of.tolist(), key_of.tolist()):
        if r in mine:
            mine[r].append(f + j)                                     # slots past f
    B, Hkv, _, D = k.shape
    bufs = [torch.empty(B, Hkv, f + max(map(len, mine.values())), D, dtype=k.dtype, device=k.device)
            for _ in (k, v)]                                          # (B, Hkv, f + most, D) each
    for buf, x in zip(bufs, (k, v)):
        buf[:, :, :f] = x[:, :, :f]
    held: list[int] = []                                              # slots now at bufs[:, :, f:]
    for r, slots in sorted(mine.items(), key=lambda item: item[1]):
        same = next((i for i, (a, b) in enumerate(zip(held, slots)) if a != b), min(len(held), len(slots)))
        if same < len(slots):
            at = torch.tensor(slots[same:], device=k.device)
            for buf, x in zip(bufs, (k, v)):
                buf[:, :, f + same:f + len(slots)] = x[:, :, at]
        held, n = slots, f + len(slots)
        yield r, bufs[0][:, :, :n], bufs[1][:, :, :n]


def rows_round_alike(model: Llama, k: int = 2 * MOST_ROWS + 3) -> bool:
    """Whether this model's kernels round a row alike in a one-row and a k-row call on this
    machine, probed on random rows: one layer's projections, a norm, the head, and the
    attention (k rows of a lookahead-like step, each seeing the cache and every other new key
    up to itself, against each row alone over its own keys, as plain sends it). A kernel that
    picks another path by row count (AMX's, say; cuBLAS's unpadded), or attention that is not
    row_attention, answers False, and its k-row forwards may then leave plain's tokens."""
    c = model.config
    g = torch.Generator().manual_seed(0)
    x = torch.randn(k, c.dim, generator=g).to(model.tok_embeddings.weight)
    layers = [model.layers[0].attention.wqkv, model.layers[0].feed_forward.w13, model.norm,
              model.packed_head or (lambda h: model.head(h[None])[0])]
    n = 300     # cached keys: past SDPA's first split of keys
    a = attention_dtype(x.dtype, x.device)                            # the dtype the model attends in
    q = torch.randn(1, c.n_heads, k, c.head_dim, generator=g).to(x.device, a)
    kv = [torch.randn(1, c.n_kv_heads, n + k, c.head_dim, generator=g).to(x.device, a) for _ in range(2)]
    mask = torch.ones(k, n + k, dtype=torch.bool)
    mask[:, n:] = (torch.arange(k)[None, :] <= torch.arange(k)[:, None]) & (torch.arange(k) % 2 == 0)
    mask[torch.arange(k), n + torch.arange(k)] = True                  # (k, n + k): own key, even ones
    mask = mask.to(x.device)
    attend = model.layers[0].attention.attend
    with torch.inference_mode(), attention_kernels(x.device):       # the kernels a forward may use
        rows = attend(q, *kv, attn_mask=mask, enable_gqa=True)       # (1, H, k, D)
        alone = torch.cat([attend(q[:, :, r:r + 1], *(t[:, :, mask[r]] for t in kv), enable_gqa=True)
                           for r in range(k)], 2)
        return torch.equal(rows, alone) and \
            all(torch.equal(f(x), torch.cat([f(x[i:i + 1]) for i in range(k)])) for f in layers)
