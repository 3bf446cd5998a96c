"""Fast CPU matmuls: every projection and the LM head on oneDNN-reordered weights (and on
CUDA, batch-invariant ones: PaddedLinear).

A k-row forward must cost about what a one-row forward costs, or lookahead and speculative
decoding (which verify k rows per forward) cannot win. F.linear (MKL) leaves its one-row
routine for k > 1 rows and repacks W on every call; oneDNN on a weight reordered once into
its blocked layout streams it once for all k rows (`python -m tools.bench --forward-cost`).

    model = prepack(load_model(ckpt))   # in place; fp64 and fp16 models keep nn.Linear, and
                                        # CUDA ones unless batch_invariant

`quantize_int4` goes further where exactness is not asked for: 4-bit weights in groups of 32,
as GGUF's Q4_1 stores them, through torch's int4 kernel with bf16 activations, so a one-row
step reads about 6x fewer layer bytes than fp32 (codes plus a bf16 scale and zero per 32),
and (under the AVX512 dispatch) the LM head in 8-bit groups, Q8_0's: ~0.6x its bf16 bytes.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from engine.fast.invariant import MOST_ROWS, row_attention
from engine.fast.machine import ATEN_CAPABILITY
from engine.llama import Llama


# the op's one overload, bound once: a call through the packet resolves it every time
ONEDNN_LINEAR = torch.ops.mkldnn._linear_pointwise.default if torch.backends.mkldnn.is_available() else None
INT4_MM = torch.ops.aten._weight_int4pack_mm_for_cpu.default
# the 4-bit kernel's AVX-512 path reads an 8-bit head for one row faster than oneDNN reads a bf16
# one; its AVX2 path does not (3.0 ms against bf16's 1.4 under that dispatch; docs/archive/speed-log.md)
Q8_HEAD = ATEN_CAPABILITY == "AVX512"


class PackedLinear(nn.Module):
    """y = x W^T through oneDNN, W reordered once into its blocked layout (CPU, fp32 or bf16).

    Only the reordered copy is kept (the weights' memory is not doubled), so prepack after
    the weights are final; the module has no `weight`.
    """

    def __init__(self, weight: Tensor, bias: Tensor | None = None, min_rows: int = 1):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.min_rows = min_rows
        # the batch-size hint only tunes the blocked layout; one reordering serves every k
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 8)
        # + b, added by oneDNN once the row's sums are done: elementwise, so a row's bits still
        # depend on that row alone (Qwen2's q, k, v)
        self.bias = None if bias is None else bias.detach()

    def forward(self, x: Tensor) -> Tensor:
        # min_rows 1, the default, skips the row count: the hot path of every step
        n = x.numel() // x.shape[-1]                                  # rows, B*T
        if self.min_rows == 1 or self.min_rows <= n <= MOST_ROWS:
            return ONEDNN_LINEAR(x, self.packed, self.bias, "none", [], "")
        # subtle: oneDNN takes a matrix-vector kernel for one row, a matrix-matrix kernel for
        # 2..32, and on an AMX CPU a tile kernel from 33 rows; they round differently. The
        # 2..32 one gives every row the same bits whatever the row count, so one row is sent
        # with a zero row, and more than 32 in calls of at most 32
        x2 = x.reshape(n, -1)
        if n > MOST_ROWS:
            y = torch.cat([self(x2[i:i + MOST_ROWS]) for i in range(0, n, MOST_ROWS)])  # (n, out)
        else:
            y = ONEDNN_LINEAR(F.pad(x2, (0, 0, 0, self.min_rows - n)), self.packed, self.bias, "none", [], "")[:n]
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
    A bias (Qwen2's q, k, v) is added to the kernel's bf16 output, in bf16: elementwise, so a
    row still rounds alike at every row count.
    """

    def __init__(self, weight: Tensor, bias: Tensor | None = None, group: int = 32):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        if not packs(weight, group):
            raise ValueError(f"int4 needs in % {group} == 0 and out % 16 == 0, got {tuple(weight.shape)}")
        q, d, m = q4_groups(weight, group)
        self.group = group
        self.register_buffer("packed", torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1))
        zeros = torch.stack([d, m + 8 * d], dim=-1)                    # (out, in/group, 2)
        self.register_buffer("scales", zeros.transpose(0, 1).contiguous().bfloat16())
        self.register_buffer("bias", None if bias is None else bias.detach().bfloat16())

    @classmethod
    def empty(cls, out: int, n: int, group: int = 32, bias: bool = False) -> Int4Linear:
        """One with the buffers' shapes and nothing in them (on the current device: meta, for a
        model whose tensors are assigned from a file, engine/fast/prepared.py)."""
        self = cls.__new__(cls)
        nn.Module.__init__(self)
        self.out_features, self.in_features, self.group = out, n, group       # the kernel's columns
        self.register_buffer("packed", torch.empty(out, n // 2, dtype=torch.uint8))
        self.register_buffer("scales", torch.empty(n // group, out, 2, dtype=torch.bfloat16))
        self.register_buffer("bias", torch.empty(out, dtype=torch.bfloat16) if bias else None)
        return self

    def forward(self, x: Tensor) -> Tensor:
        y = INT4_MM(x.reshape(-1, self.in_features).bfloat16(), self.packed, self.group, self.scales)
        y = y if self.bias is None else y + self.bias                # (n, out) bf16
        return y.view(*x.shape[:-1], self.out_features)               # (..., out) bf16


class Q8Linear(Int4Linear):
    """y = x W^T with W = d q in 8-bit groups of 32 (GGUF's Q8_0: d = max|w| / 127, q in
    -127..127), bf16 activations (CPU): the 4-bit path's LM head, in ~0.6x the bytes of bf16.

    torch has no grouped 8-bit kernel; its 4-bit one serves twice over. With q + 128 = 16 hi + lo
    (hi, lo 4-bit codes), W = W_hi + W_lo where, in the kernel's (code - 8) scale + zero form,
        W_hi = (hi - 8) 16d + 0,    W_lo = (lo - 8) d + 8d,    so x W^T = [x, x] [W_hi | W_lo]^T:
    one call over twice the columns. A group already on a Q8_0 grid (the shipped head,
    dequantized) gets its codes back exactly; d is kept in bf16, as Int4Linear keeps its scales.
    The trade: a one-row step 0.92x as long, but the kernel pays per row where oneDNN's bf16
    head is flat to 16 rows, so an 8-row verify costs 1.08x (docs/archive/speed-log.md).
    """

    def __init__(self, weight: Tensor, group: int = 32):
        # subtle: Int4Linear's __init__ would quantize `weight` to 4 bits; only its forward is shared
        nn.Module.__init__(self)
        out, n = weight.shape
        if not packs(weight, group):
            raise ValueError(f"q8 needs in % {group} == 0 and out % 16 == 0, got {(out, n)}")
        self.out_features, self.in_features, self.group = out, 2 * n, group   # the kernel's columns
        g = weight.float().view(out, n // group, group)                   # (out, n/group, group)
        d = g.abs().amax(-1) / 127                                         # (out, n/group)
        u = (g / d.clamp(min=1e-30)[..., None]).round().view(out, n).to(torch.int32) + 128  # (out, n) 1..255
        codes = torch.cat([u // 16, u % 16], 1)                            # (out, 2n): hi | lo
        self.register_buffer("packed", torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1))
        hi, lo = torch.stack([16 * d, torch.zeros_like(d)], -1), torch.stack([d, 8 * d], -1)  # each (out, n/group, 2): scale, zero
        self.register_buffer("scales", torch.cat([hi, lo], 1).transpose(0, 1).contiguous().bfloat16())  # (2n/group, out, 2)
        self.bias = None

    @classmethod
    def empty(cls, out: int, n: int, group: int = 32) -> Q8Linear:
        return super().empty(out, 2 * n, group)                           # twice the columns

    def forward(self, x: Tensor) -> Tensor:
        return super().forward(torch.cat([x, x], -1))                      # (..., out) bf16


def packs(weight: Tensor, group: int = 32) -> bool:
    """Whether torch's 4-bit kernel takes this (out, in) weight: in whole groups, out in tiles of 16."""
    return weight.shape[1] % group == 0 and weight.shape[0] % 16 == 0


def quantize_int4(model: Llama, head_bits: int = 8) -> Llama:
    """Every layer projection -> Int4Linear (from the model's fp32 weights, so that Q4_1 grids
    come back exactly), the LM head -> Q8Linear (under the AVX512 dispatch, where its shape
    packs): as the GGUF stores them, Q4_1 layers and a Q8_0 head. Then the rest (embeddings,
    norms) -> bf16, in place. CPU only.

    head_bits=4: the head in 4-bit groups too (Int4Linear), for a speculative draft alone: its
    rounding moves no token (the target's verdicts decide them all), and a wide vocabulary's
    head is much of a small model's step (Qwen2.5-Coder-0.5B's, 151936 x 896: 11.3 ms in 8 bits,
    4.7 in 4, beside a 31 ms compiled step, on a 2-vCPU Xeon)."""
    w = model.tok_embeddings.weight
    if w.device.type != "cpu" or w.dtype != torch.float32:
        raise ValueError(f"int4 quantizes a float32 CPU model, got {w.dtype} on {w.device}")
    if head_bits not in (4, 8):
        raise ValueError(f"head_bits is 4 or 8, got {head_bits!r}")
    swap_projections(model, Int4Linear)
    tied = model.config.tie_embeddings
    head = w if tied else model.output.weight                          # (V, C)
    if head_bits == 4 and packs(head):
        model.packed_head = Int4Linear(head)
        if not tied:
            del model.output
    elif Q8_HEAD and packs(head):                                     # else prepack's bf16 head
        model.packed_head = Q8Linear(head)
        if not tied:
            del model.output
    return model.to(torch.bfloat16)


def swap_projections(model: Llama, make) -> None:
    """Replace every layer's nn.Linear (wqkv, wo, w13, w2) with make(its weight, its bias or None)."""
    for block in model.layers:
        for parent in (block.attention, block.feed_forward):
            for name, child in list(parent.named_children()):
                if isinstance(child, nn.Linear):
                    setattr(parent, name, make(child.weight, child.bias))


class PaddedLinear(nn.Module):
    """y = x W^T with every call MOST_ROWS rows long (CUDA, batch-invariant): zero rows pad a
    short call, a long one goes in slices of MOST_ROWS.

    cuBLAS picks its kernel by the call's shape, and kernels round a row apart; with one row
    count there is one kernel, and a row of it depends on its own input alone. The price is
    launches, which bound a GPU's step: bf16 plain ran at 0.63x on an H200 (docs/cuda.md).
    """

    def __init__(self, weight: Tensor, bias: Tensor | None = None):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.weight, self.bias = weight, bias

    def forward(self, x: Tensor) -> Tensor:
        x2 = x.reshape(-1, self.in_features)                          # (n, in)
        n = x2.shape[0]
        # subtle: every call must be exactly MOST_ROWS rows, one row as much as a prompt; an
        # F.linear(x) shortcut for "small" calls would bring back the per-shape kernels
        parts = F.pad(x2, (0, 0, 0, -n % MOST_ROWS)).split(MOST_ROWS)   # each (MOST_ROWS, in)
        if len(parts) == 1:                                           # <= 32 rows: no concatenation
            y = F.linear(parts[0], self.weight, self.bias)            # (MOST_ROWS, out)
        else:
            y = torch.cat([F.linear(p, self.weight, self.bias) for p in parts])  # (MOST_ROWS * parts, out)
        return y[:n].view(*x.shape[:-1], -1)                          # (..., out)


def prepack(model: Llama, batch_invariant: bool = False) -> Llama:
    """Swap every projection and the LM head for a PackedLinear, in place, where the model is
    fp32 or bf16 on a CPU with oneDNN (other dtypes keep nn.Linear, and CUDA unless below).

    batch_invariant: a row's outputs never depend on how many rows shared its forward, and
    attention is engine/fast/invariant.py's `row_attention`. On a CPU every matmul call takes
    2..MOST_ROWS rows (oneDNN's kernel for those rounds a row alike), for fp32 and bf16; with
    torch's int4 kernel (row-invariant as measured here) every decoder prints that path's plain
    tokens. On CUDA, every dtype: each matmul a PaddedLinear of exactly MOST_ROWS rows.
    Off unless asked; engine.fast.paths.build (the doors' loader) asks for it on bf16 and 4-bit CPU
    models (`exact_by_default`), and elsewhere only with --batch-invariant.
    """
    w = model.tok_embeddings.weight
    cuda = w.device.type == "cuda"
    if batch_invariant and w.device.type not in ("cpu", "cuda"):
        raise ValueError(f"batch-invariant kernels run on a CPU or CUDA, not on {w.device.type}")
    if batch_invariant and (cuda or w.dtype in (torch.bfloat16, torch.float32)):
        for block in model.layers:
            block.attention.attend = row_attention
    if cuda and batch_invariant:
        swap = PaddedLinear
    elif can_prepack(w):
        swap = lambda weight, bias=None: PackedLinear(weight, bias, 2 if batch_invariant else 1)
    else:
        return model
    swap_projections(model, swap)
    if model.packed_head is not None:    # a head packed already: a 4-bit model's Q8Linear
        return model
    # the embedding table stays for lookups (tied: the head reads a copy or the same tensor)
    model.packed_head = swap(w if model.config.tie_embeddings else model.output.weight)
    if not model.config.tie_embeddings:
        del model.output                 # the packed copy replaces it, as in every layer
    return model


def exact_by_default(model: Llama) -> bool:
    """Whether prepack's batch_invariant is on by default: for bf16 and 4-bit models on a CPU,
    whose one-row step it costs about nothing (docs/archive/speed-log.md; whether rows then round
    alike is this CPU's probe to say: invariant.rows_round_alike). fp32 pays ~9%: a flag."""
    w = model.tok_embeddings.weight
    return w.dtype == torch.bfloat16 and w.device.type == "cpu"


def can_prepack(w: Tensor) -> bool:
    """oneDNN takes fp32 on any x86 CPU, bf16 only where the CPU has bf16 conversions."""
    # subtle: an AVX2-only CPU (or a VM that hides AVX-512) has no oneDNN bf16 path; reordering
    # a bf16 weight there raises, so such models keep nn.Linear
    if w.device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    return w.dtype == torch.float32 or (w.dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported())
