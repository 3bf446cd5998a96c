"""A minimal Llama, written as a pure function of (weights, tokens, positions, cache, mask).

Llama 2 / Llama 3 architecture (Touvron et al. 2023, arXiv 2307.09288): RMSNorm, rotary
position embeddings (Su et al. 2021, arXiv 2104.09864; HF half-split layout), grouped-query
attention (Ainslie et al. 2023, arXiv 2305.13245) and a SwiGLU MLP (Shazeer 2020). Its
variants are config switches: Mistral is a Llama below its sliding window, Qwen2 (Qwen team
2024, arXiv 2407.10671) a Llama with biases on q, k and v (`qkv_bias`) and an untied head.

Two things set it apart from a textbook Llama, because the decoders need them:
- Positions are not cache slots: RoPE uses `positions`, K/V land at `cache.length`.
- One mask row per query: `mask` is (T, S), so a caller sends only the queries it needs,
  and `keep` / `trim_layers` skip work for rows whose outputs nobody reads.

Shape letters, used in every comment of the engine:
  B batch, T queries (new tokens), S keys (= cached + T), C model dim, H query heads,
  Hkv key/value heads, D head dim, F FFN hidden dim, V vocab, L layers, K draft length.

The seams, every place a fast path (engine/fast/) may swap a piece of this model; nothing
else of it changes, so every decoder sees the same function, only faster:
  Attention.attend        SDPA, or fast.invariant.row_attention (each row's keys on its own)
  Attention.wqkv, .wo,    nn.Linear, or fast.packed's PackedLinear / Int4Linear / PaddedLinear:
  FeedForward.w13, .w2    the same y = x W^T, prepacked, in 4-bit groups, or padded to 32 rows
  Llama.packed_head       None (F.linear on the head weight), or a module for the head (bf16,
                          Q8_0 groups); then `output` may be gone
  Llama.blocks            the method, or an instance attribute of the same signature set by
                          fast.aot.compile_step: the layer stack compiled (fast.aot.compiled(model))
Whether a model so swapped prints its plain's tokens bit for bit is one function's to say:
engine/fast/paths.py's on_exact_path(model).

But: no batching logic (decoders run B=1), no training, no dropout, no weight init.
"""
from __future__ import annotations

import math
from contextlib import nullcontext
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from engine.fast.machine import attention_dtype
from engine.kvcache import KVCache


@dataclass(frozen=True)
class RopeScaling:
    """How RoPE's frequencies are rescaled, as HF's Llama names it (`rope_type`); see frequencies()."""
    kind: str = "default"          # default | linear | dynamic | llama3
    factor: float = 1.0
    low_freq_factor: float = 1.0   # llama3 only
    high_freq_factor: float = 4.0  # llama3 only
    original_context: int = 8192   # llama3: original_max_position_embeddings; dynamic: the context


@dataclass(frozen=True)
class LlamaConfig:
    dim: int            # C
    n_layers: int       # L
    n_heads: int        # H
    n_kv_heads: int     # Hkv
    hidden_dim: int     # F
    vocab_size: int     # V
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_seq_len: int = 2048
    tie_embeddings: bool = False
    rope_scaling: RopeScaling | None = None   # None = plain RoPE
    head_dim: int | None = None    # D; None = C / H (some checkpoints set it: H x D != C)
    attention_bias: bool = False   # biases on q, k, v and o
    qkv_bias: bool = False         # biases on q, k and v only (Qwen2)
    mlp_bias: bool = False         # biases on gate, up and down
    sliding_window: int | None = None  # set when it capped max_seq_len (engine/load/config.py)

    def __post_init__(self):
        if self.head_dim is None:
            object.__setattr__(self, "head_dim", self.dim // self.n_heads)


# --------------------------------------------------------------------------- pieces

class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        # w * x / sqrt(mean(x^2) + eps); F.rms_norm gives the bits of the reference's
        # w * (x * rsqrt(x.pow(2).mean(-1) + eps)) in fp32 and fp64 (tests/test_llama.py)
        if x.dtype in (torch.float32, torch.float64):
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        # fp16 / bf16: normalised in fp32, cast back, then scaled, as the reference does
        return self.weight * F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).to(x.dtype)


def frequencies(head_dim: int, theta: float, scaling: RopeScaling | None, work: torch.dtype,
                device=None) -> Tensor:
    """RoPE's D/2 frequencies f_i = theta^(-2i/D), rescaled as HF's Llama does, in HF's order
    of operations: in fp32 they are HF's bits (tests/test_variants.py)."""
    s = scaling
    if s is not None and s.kind == "dynamic":
        # NTK-aware: at context n, theta' = theta (factor n / n0 - (factor - 1))^(D / (D - 2)).
        # HF grows theta' only once a forward runs past n0 = max_position_embeddings; the engine
        # never does (max_seq_len <= n0), so this is HF's own value at n = n0, ~= theta
        n0 = s.original_context
        theta = theta * ((s.factor * n0 / n0) - (s.factor - 1)) ** (head_dim / (head_dim - 2))
    f = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=device).to(work) / head_dim)  # (D/2,)
    if s is None or s.kind in ("default", "dynamic"):   # dynamic: theta' is in f already
        return f
    if s.kind == "linear":  # angle (p / factor) f_i
        return f / s.factor  # subtle: as p (f_i / factor), which HF rounds, not (p / factor) f_i
    if s.kind == "llama3":
        # Llama 3.1's per-frequency rule, with wavelength w_i = 2 pi / f_i and n0 the original context:
        #   w_i < n0 / high  ->  f_i                                    (short waves kept)
        #   w_i > n0 / low   ->  f_i / factor                           (long waves interpolated)
        #   otherwise        ->  (1 - a) f_i / factor + a f_i,  a = (n0 / w_i - low) / (high - low)
        n0, lo, hi, k = s.original_context, s.low_freq_factor, s.high_freq_factor, s.factor
        wavelen = 2 * math.pi / f                                                        # (D/2,)
        a = (n0 / wavelen - lo) / (hi - lo)                                              # (D/2,)
        mid = (1 - a) * f / k + a * f
        return torch.where(wavelen > n0 / lo, f / k, torch.where(wavelen < n0 / hi, f, mid))
    raise ValueError(f"RoPE scaling {s.kind!r} is not one of default, linear, dynamic, llama3")


def rope(positions: Tensor, head_dim: int, theta: float, dtype: torch.dtype,
         scaling: RopeScaling | None = None) -> tuple[Tensor, Tensor]:
    """cos, sin (T, D) for the given positions; angle_i(p) = p * f_i (see frequencies), in the
    work dtype as HF rounds it; on a CPU, cos and sin of those angles in float64, rounded once."""
    work = torch.promote_types(dtype, torch.float32)  # fp32 tables for fp16/bf16 models
    inv_freq = frequencies(head_dim, theta, scaling, work, positions.device)   # (D/2,)
    angles = positions.to(work)[:, None] * inv_freq[None, :]          # (T, D/2)
    angles = torch.cat([angles, angles], dim=-1)                      # (T, D) half-split layout
    if angles.device.type != "cpu":
        return angles.cos().to(dtype), angles.sin().to(dtype)
    # subtle: not torch's cos. On an Intel Xeon VM, torch's fp32 cos of this very table came out
    # ~2^-14 off (cos 1 = 0.5403335) in ~3% of processes, on one thread, for the whole process,
    # while sin and cos of other inputs stayed right: the prompt's q and k, and so its tokens,
    # then differed between two runs of one command (docs/exact-paths.md). NumPy's float64 cos
    # keeps no such state; rounded once to the work dtype it is the correctly rounded value
    # (torch's fp32 cos, when right, is within 1 ulp of it: tests/test_variants.py)
    a = angles.double().numpy()                                       # (T, D) float64
    return (torch.from_numpy(np.cos(a)).to(work).to(dtype),
            torch.from_numpy(np.sin(a)).to(work).to(dtype))


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    # rotate each pair (x_i, x_{i+D/2}) by its angle: [x1, x2] -> [x1 cos - x2 sin, x2 cos + x1 sin]
    x1, x2 = x.chunk(2, dim=-1)                                       # (B, H, T, D/2) each
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin               # (B, H, T, D)


def causal_mask(cached: int, T: int, device=None) -> Tensor:
    """(T, cached + T) bool: query row t sees every cached key and new keys 0..t."""
    # subtle: row t is the token at slot cached + t, so key j is visible iff j <= cached + t
    keys = torch.arange(cached + T, device=device)
    return keys[None, :] <= (cached + torch.arange(T, device=device))[:, None]


# subtle: on CUDA, torch hands bf16 attention to cuDNN, which plans its kernel per shape; a
# decoder's key length grows every step, so every step paid for a new plan: ~1.3 ms per call,
# 11.6 bf16 tok/s against 56 without it on an H200 (docs/cuda.md). These plan nothing per shape.
CUDA_ATTENTION = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def attention_kernels(device: torch.device):
    """The SDPA kernels a forward on `device` may use: CUDA_ATTENTION on CUDA, else torch's own."""
    return sdpa_kernel(CUDA_ATTENTION) if device.type == "cuda" else nullcontext()


# --------------------------------------------------------------------------- layers

class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        # q, k and v projections stacked by rows (H*D, Hkv*D, Hkv*D): one matmul, not three
        qkv = (cfg.n_heads + 2 * cfg.n_kv_heads) * cfg.head_dim
        self.wqkv = nn.Linear(cfg.dim, qkv, bias=cfg.attention_bias or cfg.qkv_bias)
        self.wo = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=cfg.attention_bias)
        # the kernel: SDPA, or one whose rows round alike however many share a call (invariant.py)
        self.attend = F.scaled_dot_product_attention

    def forward(self, h: Tensor, rows: Tensor | None, cos: Tensor, sin: Tensor,
                cache: KVCache | None, layer: int, mask: Tensor | None) -> Tensor:
        """h (B, T, C) normed input of all rows; only `rows` (or all) get queries."""
        B, T, _ = h.shape
        H, Hkv, D = self.n_heads, self.n_kv_heads, self.head_dim
        qkv = self.wqkv(h).view(B, T, H + 2 * Hkv, D).transpose(1, 2)   # (B, H+2Hkv, T, D)
        qk = apply_rope(qkv[:, :H + Hkv], cos, sin)                      # (B, H+Hkv, T, D)
        q, k, v = qk[:, :H], qk[:, H:], qkv[:, H + Hkv:]                 # (B, H|Hkv|Hkv, T, D)
        work = attention_dtype(h.dtype, h.device)   # bf16 on a CPU without native bf16: fp32
        if work != h.dtype:
            q, k, v = q.to(work), k.to(work), v.to(work)
        if cache is not None:
            k, v = cache.append(layer, k, v)                               # (B, Hkv, S, D)
        if rows is not None:                                               # frozen rows: K/V only
            q, mask = q[:, :, rows], mask if mask is None else mask[rows]  # (B, H, Tq, D)
        Tq = q.shape[2]
        # softmax(q k^T / sqrt(D) + log mask) v, each kv head shared by H / Hkv query heads
        y = self.attend(q, k, v, attn_mask=mask, enable_gqa=True)                      # (B, H, Tq, D)
        return self.wo(y.transpose(1, 2).reshape(B, Tq, H * D).to(h.dtype))            # (B, Tq, C)


class FeedForward(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.w13 = nn.Linear(cfg.dim, 2 * cfg.hidden_dim, bias=cfg.mlp_bias)  # gate and up, stacked
        self.w2 = nn.Linear(cfg.hidden_dim, cfg.dim, bias=cfg.mlp_bias)       # down

    def forward(self, x: Tensor) -> Tensor:
        gate, up = self.w13(x).chunk(2, dim=-1)                        # (B, T, F) each
        return self.w2(F.silu(gate) * up)                              # SwiGLU: (B, T, C)


class Block(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.feed_forward = FeedForward(cfg)

    def forward(self, x: Tensor, rows: Tensor | None, cos: Tensor, sin: Tensor,
                cache: KVCache | None, layer: int, mask: Tensor | None) -> Tensor:
        a = self.attention(self.attention_norm(x), rows, cos, sin, cache, layer, mask)
        if rows is None:
            x = x + a
            return x + self.feed_forward(self.ffn_norm(x))
        xr = x[:, rows] + a                                        # (B, Tq, C) only kept rows move
        xr = xr + self.feed_forward(self.ffn_norm(xr))
        return x.index_copy(1, rows, xr)                           # frozen rows keep their x


# --------------------------------------------------------------------------- model

class Llama(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.config = cfg
        # subtle: nn.Embedding's own init (normal_) on the meta device, where weights.load_model
        # builds, imports torch._dynamo and sympy (~2.5 s a run); so the weight is given, drawn
        # as nn.Embedding draws it everywhere else
        w = torch.empty(cfg.vocab_size, cfg.dim)
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim, _weight=w if w.is_meta else w.normal_())
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        if not cfg.tie_embeddings:
            self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        self.packed_head: nn.Module | None = None  # the LM head, set by packed.prepack()

    # inference_mode, not no_grad: it also skips view and version tracking, which is ~7% of a
    # one-row step here (~1,400 small ops); its tensors only refuse in-place edits outside it
    @torch.inference_mode()
    def forward(self, tokens: Tensor, positions: Tensor, cache: KVCache | None = None,
                mask: Tensor | None = None, keep: Tensor | None = None,
                trim_layers: int = 0) -> Tensor:
        """Logits (B, len(keep) or T, V) for `tokens` (B, T) at RoPE `positions` (T,).

        The T new K/V go to cache slots [cache.length, cache.length + T) whatever their
        positions; `mask` (T, S) says which keys each query sees (None = causal). `keep`
        (1-D row indices) picks the rows whose logits are returned; in the last
        `trim_layers` layers every other row is frozen (K/V still projected, nothing else).
        """
        T = tokens.shape[1]
        x = self.tok_embeddings(tokens)                                    # (B, T, C)
        keep = None if keep is None else torch.as_tensor(keep, device=x.device).remainder(T)
        x = self.blocks(x, positions, cache, mask, keep=keep, trim_layers=trim_layers)
        if cache is not None:
            cache.length += T
        return self.head(x if keep is None else x[:, keep])               # (B, ., V)

    @torch.inference_mode()
    def blocks(self, x: Tensor, positions: Tensor, cache: KVCache | None = None,
               mask: Tensor | None = None, start: int = 0, stop: int | None = None,
               keep: Tensor | None = None, trim_layers: int = 0) -> Tensor:
        """Run layers [start, stop) on the residual stream x (B, T, C); returns x (B, T, C).

        Writes K/V of those layers at slots [cache.length, +T) but leaves cache.length alone,
        so a caller can run a model in pieces: an early exit (engine/draft.py's lower and
        upper: a self-draft's layers, resumed later by the target's).
        """
        T, c = x.shape[1], self.config
        cached = cache.length if cache is not None else 0
        if mask is None and T > 1:  # one new row sees every key: SDPA needs no mask then
            mask = causal_mask(cached, T, x.device)                        # (T, S)
        if mask is not None and mask.shape != (T, cached + T):
            raise ValueError(f"mask is {tuple(mask.shape)}, expected {(T, cached + T)}")
        if not 0 <= trim_layers <= c.n_layers:
            raise ValueError(f"trim_layers must be in [0, {c.n_layers}], got {trim_layers}")
        cos, sin = rope(positions, c.head_dim, c.rope_theta, x.dtype, c.rope_scaling)  # (T, D) each
        stop = c.n_layers if stop is None else stop
        first_trimmed = c.n_layers - trim_layers
        with attention_kernels(x.device):
            for i in range(start, stop):
                rows = keep if (keep is not None and i >= first_trimmed) else None
                x = self.layers[i](x, rows, cos, sin, cache, i, mask)      # (B, T, C)
        return x

    @torch.inference_mode()
    def head(self, x: Tensor) -> Tensor:
        """Final norm + LM head: (B, T, C) -> logits (B, T, V), at least fp32."""
        h = self.norm(x)
        if self.packed_head is not None:
            logits = self.packed_head(h)
        else:
            logits = F.linear(h, self.tok_embeddings.weight if self.config.tie_embeddings
                              else self.output.weight)
        return logits.to(torch.promote_types(logits.dtype, torch.float32))
