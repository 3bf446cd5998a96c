"""Batch invariance: a row's bits never depend on how many rows share its forward.

Lookahead, lookup and speculative decoding verify k rows in one forward and keep the tokens
plain decoding would have drawn, one row at a time. That holds bit for bit only where every
kernel rounds a row alike in a k-row call and in a one-row call; then every decoder prints
plain's tokens on that path, fp32, bf16 or 4-bit (`--batch-invariant`, packed.prepack):
- matmuls: oneDNN's 2..32-row kernel, one row sent as two (packed.PackedLinear, min_rows=2);
  torch's int4 kernel, row-invariant as measured here;
- attention: `invariant_attention` below, in place of SDPA, whose key blocks follow the call's
  shape;
- the probe `rows_round_alike(model)`, which the CLI's "exact path" claim rests on, per CPU.
A reader learning the decoders may skip this file: on an inexact path they are still exact in
law, and differ from plain only where a near-tie falls the other way.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from engine.llama import Llama

MOST_ROWS = 32   # rows per batch-invariant matmul call (packed.PackedLinear): oneDNN's 2..32-row kernel
BLOCK = 32    # keys per block of invariant_attention's p @ v
ROWS = {torch.bfloat16: 256, torch.float32: 16}   # query rows per pass (a long prompt goes in
                                                   # chunks; fp32's mm holds rows x keys x D)


def invariant_attention(q: Tensor, k: Tensor, v: Tensor, attn_mask: Tensor | None = None,
                        enable_gqa: bool = True) -> Tensor:
    """SDPA's softmax(q k^T / sqrt(D) + log mask) v for bf16 or fp32 q (B, H, T, D), k, v (B, Hkv, S, D),
    with each row's bits independent of the other rows and of the keys it may not see.

    SDPA's CPU kernel is not: it walks keys in blocks whose bounds depend on the call's shape,
    so a verified row (k rows, masked, its keys at other slots) rounds apart from plain's one
    row. Here every sum over a row's keys reads its visible keys in position order, grouped by
    position the same way in every call:
    - scores: one matmul (`mm`) over D, accumulated in fp32; the weights e = exp((s - max) /
      sqrt(D)) in fp32 (the max is exact), cast to the model's dtype, not yet normalised;
    - e @ [v | 1]: in blocks of BLOCK positions, one `mm` each (K = BLOCK in every call),
      the blocks summed in order by cumsum; the column of ones gives each row's sum of e
      from the same blocks, so y = (e @ v) / (e @ 1). Where a row's visible keys have gaps
      (lookahead's tree: other rows' keys between its own), the keys past the blocks every
      row sees are gathered per row, visible ones first in slot order (= position order). A
      plain row at position t and a verified row at t then multiply the same blocks of the
      same keys, and a masked key's 0 adds nothing.
    What this rests on, measured (tests/test_invariant.py) and probed per CPU (rows_round_alike):
    oneDNN's bf16 matmul rounds a row alike whatever the other rows, given two or more (one
    row may take a matrix-vector kernel: `mm` pads it). fp32 matmuls (MKL) do not (one and
    two rows take kernels of their own), so in fp32 `mm` multiplies and sums instead. Where it
    does not hold, the answer is still this attention, only not row-invariant.
    subtle: one matmul over all S keys for e @ v (this function's first version) is not
    enough: the kernels pair or unroll keys by index, so zero-weight keys of other rows
    between a row's own move its sums (2 rows in 1,000 on AVX-512, ~15 under AVX2).
    """
    B, H, T, D = q.shape
    n = ROWS.get(q.dtype, 16)
    if T > n:   # each row's bits are its own, so rows can go in chunks: bounded memory
        return torch.cat([invariant_attention(q[:, :, i:i + n], k, v, attn_mask if attn_mask is None
                                              else attn_mask[i:i + n]) for i in range(0, T, n)], 2)
    Hkv, S = k.shape[1], k.shape[2]
    g = H // Hkv
    qg = q.reshape(B, Hkv, g * T, D)                                   # (B, Hkv, gT, D), head h -> h // g
    s = mm(qg, k.transpose(-1, -2)).float()                             # (B, Hkv, gT, S)
    if attn_mask is not None:
        s.view(B, Hkv, g, T, S).masked_fill_(~attn_mask, float("-inf"))  # mask (T, S), each of g heads
    e = s.sub_(s.amax(-1, keepdim=True)).mul_(D ** -0.5).exp_().to(q.dtype)  # exp((s - max) / sqrt(D))
    # A row with gaps sees a key after one it may not; without gaps, slot order is position
    # order and every block is shared. f: the keys in blocks every row sees. Neither choice
    # moves a bit (gathering a row without gaps keeps its order; f only splits the work).
    # subtle: both read the mask's data, which is why tools/compiled.py leaves this eager
    gaps = attn_mask is not None and bool((attn_mask[:, 1:] > attn_mask[:, :-1]).any())
    f = int(attn_mask.all(0).cumprod(0).sum()) // BLOCK * BLOCK if gaps else S
    blocks = []                                                         # each (B, Hkv, gT, n, D + 1), by position
    if f:
        ev = pad_keys(e[..., :f], -1), with_ones(v[:, :, :f])          # (B, Hkv, gT, n BLOCK), (B, Hkv, n BLOCK, D + 1)
        blocks.append(mm(ev[0].unflatten(-1, (-1, BLOCK)).transpose(2, 3),   # (B, Hkv, n, gT, BLOCK)
                         ev[1].unflatten(2, (-1, BLOCK))).transpose(2, 3))
    if gaps:
        blocks.append(gathered(e[..., f:], with_ones(v[:, :, f:]), attn_mask[:, f:], g))
    y = (blocks[0] if len(blocks) == 1 else torch.cat(blocks, 3)).float().cumsum(3)[:, :, :, -1]  # (B, Hkv, gT, D + 1)
    return (y[..., :D] / y[..., D:]).to(q.dtype).view(B, H, T, D)      # (B, H, T, D)


def gathered(p: Tensor, v: Tensor, mask: Tensor, g: int) -> Tensor:
    """invariant_attention's tail: each row's visible keys (p (B, Hkv, gT, St), v (B, Hkv, St, Dv),
    mask (T, St)) gathered first, in slot order, then in blocks -> (B, Hkv, gT, nt, Dv)."""
    (B, Hkv, gT, St), T, D = p.shape, mask.shape[0], v.shape[-1]
    order = torch.sort((~pad_keys(mask, -1)).to(torch.uint8), stable=True).indices  # (T, St + pad)
    p = pad_keys(p, -1).view(B, Hkv, g, T, -1).gather(-1, order.expand(B, Hkv, g, T, -1))
    v = pad_keys(v, 2)[:, :, order]                                     # (B, Hkv, T, St + pad, Dv)
    parts = mm(p.unflatten(-1, (-1, BLOCK)).permute(0, 1, 3, 4, 2, 5),  # (B, Hkv, T, nt, g, BLOCK)
               v.unflatten(3, (-1, BLOCK)))                             # (B, Hkv, T, nt, g, Dv)
    return parts.permute(0, 1, 4, 2, 3, 5).reshape(B, Hkv, gT, -1, D)  # (B, Hkv, gT, nt, Dv)


def with_ones(v: Tensor) -> Tensor:
    """[v | 1] (B, Hkv, S, D) -> (B, Hkv, n BLOCK, D + 1), padded to whole BLOCKs of keys, in
    one copy. A padded key is all ones, which its weight, padded with 0, cancels."""
    return F.pad(v, (0, 1, 0, -v.shape[2] % BLOCK), value=1.0)


def pad_keys(x: Tensor, dim: int) -> Tensor:
    """x with zeros appended along `dim` (its keys) to a whole number of BLOCKs."""
    pad = -x.shape[dim] % BLOCK
    return F.pad(x, (0, pad) if dim == -1 else (0, 0, 0, pad)) if pad else x


def mm(a: Tensor, b: Tensor) -> Tensor:
    """a @ b, with a one-row a sent as two rows: the matrix-vector kernel a single row takes
    rounds apart from the matrix-matrix one that two or more take. In fp32, sum_k a_mk b_kn as
    a product and a sum over k (each sum a reduction of its own, whatever the other rows):
    MKL's fp32 kernels round a row by the call's row count."""
    if a.dtype == torch.float32:
        return (a.unsqueeze(-1) * b.unsqueeze(-3)).sum(-2)            # (..., M, K, N) -> (..., M, N)
    if a.shape[-2] != 1:
        return a @ b
    return (F.pad(a, (0, 0, 0, 1)) @ b)[..., :1, :]


def rows_round_alike(model: Llama, k: int = 2 * MOST_ROWS + 3) -> bool:
    """Whether this model's kernels round a row alike in a one-row and a k-row call on this CPU,
    probed on random rows: one layer's projections, the head, and the attention (k rows of a
    lookahead-like step, each seeing the cache and every other new key up to itself, against
    each row alone over its own keys, as plain sends it). A CPU whose kernel picks another path
    by row count (AMX's, say), or attention that is not invariant_attention, answers False,
    and its k-row forwards may then leave plain's tokens."""
    c = model.config
    g = torch.Generator().manual_seed(0)
    x = torch.randn(k, c.dim, generator=g).to(model.tok_embeddings.weight)
    layers = [model.layers[0].attention.wqkv, model.layers[0].feed_forward.w13,
              model.packed_head or (lambda h: model.head(h[None])[0])]
    n = 300     # cached keys: several of invariant_attention's blocks, and past SDPA's first split
    q = torch.randn(1, c.n_heads, k, c.head_dim, generator=g).to(x)
    kv = [torch.randn(1, c.n_kv_heads, n + k, c.head_dim, generator=g).to(x) for _ in range(2)]
    mask = torch.ones(k, n + k, dtype=torch.bool)
    mask[:, n:] = (torch.arange(k)[None, :] <= torch.arange(k)[:, None]) & (torch.arange(k) % 2 == 0)
    mask[torch.arange(k), n + torch.arange(k)] = True                  # (k, n + k): own key, even ones
    mask = mask.to(x.device)
    attend = model.layers[0].attention.attend
    with torch.inference_mode():
        rows = attend(q, *kv, attn_mask=mask, enable_gqa=True)       # (1, H, k, D)
        alone = torch.cat([attend(q[:, :, r:r + 1], *(t[:, :, mask[r]] for t in kv), enable_gqa=True)
                           for r in range(k)], 2)
        return torch.equal(rows, alone) and \
            all(torch.equal(f(x), torch.cat([f(x[i:i + 1]) for i in range(k)])) for f in layers)
