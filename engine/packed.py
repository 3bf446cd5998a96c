"""Fast CPU matmuls: every projection and the LM head on oneDNN-reordered weights.

A k-row forward must cost about what a one-row forward costs, or lookahead and speculative
decoding (which verify k rows per forward) cannot win. F.linear (MKL) leaves its one-row
routine for k > 1 rows and repacks W on every call; oneDNN on a weight reordered once into
its blocked layout streams it once for all k rows (`python -m tools.bench --forward-cost`).

    model = prepack(load_model(ckpt))   # in place; CUDA, fp64 and fp16 models keep nn.Linear

`quantize_int4` goes further where exactness is not asked for: 4-bit weights in groups of 32,
as GGUF's Q4_1 stores them, through torch's int4 kernel with bf16 activations, so a one-row
step reads about 6x fewer layer bytes than fp32 (codes plus a bf16 scale and zero per 32).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from engine.llama import Llama


MOST_ROWS = 32   # batch-invariant PackedLinear calls take 2..32 rows (see its forward)
# the op's one overload, bound once: a call through the packet resolves it every time
LINEAR = torch.ops.mkldnn._linear_pointwise.default if torch.backends.mkldnn.is_available() else None
INT4_MM = torch.ops.aten._weight_int4pack_mm_for_cpu.default


class PackedLinear(nn.Module):
    """y = x W^T through oneDNN, W reordered once into its blocked layout (CPU, fp32 or bf16).

    Only the reordered copy is kept (the weights' memory is not doubled), so prepack after
    the weights are final; the module has no `weight`.
    """

    def __init__(self, weight: Tensor, min_rows: int = 1):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.min_rows = min_rows
        # the batch-size hint only tunes the blocked layout; one reordering serves every k
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 8)

    def forward(self, x: Tensor) -> Tensor:
        # min_rows 1, the default, skips the row count: the hot path of every step
        n = x.numel() // x.shape[-1]                                  # rows, B*T
        if self.min_rows == 1 or self.min_rows <= n <= MOST_ROWS:
            return LINEAR(x, self.packed, None, "none", [], "")
        # subtle: oneDNN takes a matrix-vector kernel for one row, a matrix-matrix kernel for
        # 2..32, and on an AMX CPU a tile kernel from 33 rows; they round differently. The
        # 2..32 one gives every row the same bits whatever the row count, so one row is sent
        # with a zero row, and more than 32 in calls of at most 32
        x2 = x.reshape(n, -1)
        if n > MOST_ROWS:
            y = torch.cat([self(x2[i:i + MOST_ROWS]) for i in range(0, n, MOST_ROWS)])  # (n, out)
        else:
            y = LINEAR(F.pad(x2, (0, 0, 0, self.min_rows - n)), self.packed, None, "none", [], "")[:n]
        return y.view(*x.shape[:-1], -1)                              # (..., out)


def q4_groups(w: Tensor, group: int = 32) -> tuple[Tensor, Tensor, Tensor]:
    """(out, in) weights -> codes q (out, in) in 0..15, scales d and mins m (out, in/group).

    w ~ d q + m per group, with m = min, d = (max - min) / 15 (Q4_1's rule). A group that
    already lies on such a grid (the shipped checkpoint's layers, dequantized from Q4_1) gets
    its codes back exactly: the min maps to 0, the max to 15.
    """
    out, n = w.shape
    g = w.float().view(out, n // group, group)                        # (out, in/group, group)
    m, d = g.amin(-1), (g.amax(-1) - g.amin(-1)) / 15                  # (out, in/group)
    q = ((g - m[..., None]) / d.clamp(min=1e-30)[..., None]).round().clamp(0, 15)
    return q.view(out, n).to(torch.int32), d, m


class Int4Linear(nn.Module):
    """y = x W^T with W = d q + m in 4-bit groups of 32, bf16 activations (CPU).

    torch's kernel takes w = (q - 8) * scale + zero, so scale = d and zero = m + 8 d; both are
    stored in bf16, which rounds them (GGUF keeps fp16): the weights move by about 2^-9.
    """

    def __init__(self, weight: Tensor, group: int = 32):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        if self.in_features % group or self.out_features % 16:
            raise ValueError(f"int4 needs in % {group} == 0 and out % 16 == 0, got {tuple(weight.shape)}")
        q, d, m = q4_groups(weight, group)
        self.group = group
        self.register_buffer("packed", torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1))
        zeros = torch.stack([d, m + 8 * d], dim=-1)                    # (out, in/group, 2)
        self.register_buffer("scales", zeros.transpose(0, 1).contiguous().bfloat16())

    def forward(self, x: Tensor) -> Tensor:
        y = INT4_MM(x.reshape(-1, self.in_features).bfloat16(), self.packed, self.group, self.scales)
        return y.view(*x.shape[:-1], self.out_features)               # (..., out) bf16


def quantize_int4(model: Llama) -> Llama:
    """Every layer projection -> Int4Linear (from the model's fp32 weights, so that Q4_1 grids
    come back exactly), then the rest (embeddings, norms, head) -> bf16, in place. CPU only."""
    w = model.tok_embeddings.weight
    if w.device.type != "cpu" or w.dtype != torch.float32:
        raise ValueError(f"int4 quantizes a float32 CPU model, got {w.dtype} on {w.device}")
    swap_projections(model, Int4Linear)
    return model.to(torch.bfloat16)


def swap_projections(model: Llama, make) -> None:
    """Replace every layer's bias-free nn.Linear (wqkv, wo, w13, w2) with make(its weight)."""
    for block in model.layers:
        for parent in (block.attention, block.feed_forward):
            for name, child in list(parent.named_children()):
                if isinstance(child, nn.Linear) and child.bias is None:
                    setattr(parent, name, make(child.weight))


CPU_ONLY = ("--batch-invariant runs on the CPU only: its row-invariant kernels are oneDNN's and its own; "
            "on CUDA the rows of a k-row forward round apart whatever it does (docs/cuda.md)")


def prepack(model: Llama, batch_invariant: bool = False) -> Llama:
    """Swap every projection and the LM head for a PackedLinear, in place; a no-op unless
    the model is fp32 or bf16 on a CPU with oneDNN (CUDA and other dtypes keep nn.Linear).

    batch_invariant: a row's outputs never depend on how many rows shared its forward: every
    matmul call takes 2..MOST_ROWS rows (oneDNN's kernel for those rounds a row alike), and on bf16
    (bf16, --int4) and fp32 attention is `invariant_attention`. There, with torch's int4
    kernel (row-invariant as measured here), every decoder prints that path's plain tokens.
    Off by default: it makes a one-row step slower (docs/speed.md).
    """
    if batch_invariant and model.tok_embeddings.weight.device.type != "cpu":
        raise ValueError(CPU_ONLY)
    m = 2 if batch_invariant else 1
    if batch_invariant and model.tok_embeddings.weight.dtype in (torch.bfloat16, torch.float32):
        for block in model.layers:
            block.attention.attend = invariant_attention
    if not can_prepack(model.tok_embeddings.weight):
        return model
    swap_projections(model, lambda weight: PackedLinear(weight, m))
    if not model.config.tie_embeddings:
        model.packed_head = PackedLinear(model.output.weight, m)
        del model.output                 # the packed copy replaces it, as in every layer
    else:  # the embedding table stays for lookups; the head reads its packed copy
        model.packed_head = PackedLinear(model.tok_embeddings.weight, m)
    return model


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
    What this rests on, measured (tests/test_packed.py) and probed per CPU (rows_round_alike):
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


def can_prepack(w: Tensor) -> bool:
    """oneDNN takes fp32 on any x86 CPU, bf16 only where the CPU has bf16 conversions."""
    # subtle: an AVX2-only CPU (or a VM that hides AVX-512) has no oneDNN bf16 path; reordering
    # a bf16 weight there raises, so such models keep nn.Linear
    if w.device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    return w.dtype == torch.float32 or (w.dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported())
