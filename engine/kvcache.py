"""KV cache: preallocated key/value buffers for every layer, owned by the caller.

The model appends the T new K/V of a forward at slots [length, length + T) in every layer,
then advances `length` once. Slots are not positions: lookahead writes several rows that
share a position, then keeps only the accepted ones with `compact`. Speculative decoding rolls
rejected drafts back with `truncate`.
"""
from __future__ import annotations

import os

import torch
from torch import Tensor


# subtle: read once, at import, as torch reads ATEN_CPU_CAPABILITY once
ATEN_CAPABILITY = torch.backends.cpu.get_cpu_capability()
# bf16 attention only where ATen's bf16 kernels are AVX-512's and the CPU has AMX tiles
BF16_ATTENTION = ATEN_CAPABILITY == "AVX512" and getattr(torch.cpu, "_is_amx_tile_supported", bool)()


def attention_dtype(dtype: torch.dtype, device) -> torch.dtype:
    """The dtype a model's K/V are kept and attended in: its own, but fp32 for bf16 on a CPU
    without AMX or not under the AVX512 dispatch. There SDPA's bf16 one-row kernel is slow:
    3.7x fp32's time at 150 keys and 6.7x at 1,000 under AVX2 (docs/archive/speed-log.md), 4.5x
    at 100 and 8.6x at 1,000 on an AVX-512 EPYC with avx512_bf16 but no AMX; on an
    AMX Xeon bf16 is the faster. fp32 K/V cost twice the memory and three small casts a layer."""
    if dtype != torch.bfloat16 or BF16_ATTENTION:                # the hot path: one test a layer
        return dtype
    return torch.float32 if torch.device(device if device is not None else "cpu").type == "cpu" else dtype


def available_bytes(device) -> int | None:
    """Memory a new allocation on `device` can still get; None when the platform cannot say.

    CPU: MemAvailable from /proc/meminfo (what Linux can hand out without swapping), else
    free pages from sysconf. CUDA: the driver's free bytes. Used to refuse a request before
    allocating it, never as a promise that smaller ones fit.
    """
    device = torch.device(device if device is not None else "cpu")
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    if device.type != "cpu":
        return None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def check_memory(nbytes: int, what: str, device) -> None:
    """ValueError naming `what` when `nbytes` exceed the memory `device` has free."""
    free = available_bytes(device)
    if free is not None and nbytes > free:
        raise ValueError(f"{what} needs {nbytes / 2**30:.3g} GiB, more than the "
                         f"{free / 2**30:.3g} GiB free on {torch.device(device or 'cpu')}")


class KVCache:
    def __init__(self, n_layers: int, n_kv_heads: int, head_dim: int, capacity: int,
                 batch: int = 1, dtype: torch.dtype = torch.float32, device=None):
        for name, n in [("n_layers", n_layers), ("n_kv_heads", n_kv_heads), ("head_dim", head_dim),
                        ("capacity", capacity), ("batch", batch)]:
            if isinstance(n, bool) or not isinstance(n, int) or n < 1:
                raise ValueError(f"KVCache: {name} must be an integer >= 1, got {n!r}")
        # checked before allocating: a capacity of 10^9 slots must be an error, not a hang
        check_memory(2 * n_layers * batch * n_kv_heads * capacity * head_dim * dtype.itemsize,
                   f"a KV cache of {capacity} slots", device)
        shape = (n_layers, batch, n_kv_heads, capacity, head_dim)      # (L, B, Hkv, capacity, D)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.layers = list(zip(self.k.unbind(0), self.v.unbind(0)))  # per layer (B, Hkv, capacity, D) views
        self.capacity = capacity
        self.length = 0                                                # committed slots

    @classmethod
    def for_model(cls, model, capacity: int, batch: int = 1, scratch: int | None = None) -> KVCache:
        """A cache shaped for `model` (a Llama), on its device, in its attention's dtype.

        scratch: the slots of `capacity` that only ever hold one step's candidate rows (which
        share positions); the rest are tokens at positions 0.., which must fit in the model's
        context. None: the caller did not say, so only memory is checked.
        """
        cfg, w = model.config, model.tok_embeddings.weight
        if scratch is not None and capacity - scratch > cfg.max_seq_len:
            raise ValueError(f"prompt + new tokens = {capacity - scratch} positions exceed the "
                             f"model's context ({cfg.max_seq_len})")
        return cls(cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, capacity, batch,
                   attention_dtype(w.dtype, w.device), w.device)

    def append(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Write k, v (B, Hkv, T, D) after the committed slots; return views of all S = length + T."""
        n, T = self.length, k.shape[2]
        if n + T > self.capacity:
            raise ValueError(f"KV cache full: {n} + {T} slots > capacity {self.capacity}")
        ck, cv = self.layers[layer]                                    # (B, Hkv, capacity, D)
        ck.narrow(2, n, T).copy_(k)
        cv.narrow(2, n, T).copy_(v)
        return ck.narrow(2, 0, n + T), cv.narrow(2, 0, n + T)          # (B, Hkv, S, D)

    def truncate(self, n: int) -> None:
        """Forget every slot from n on (rejected drafts). Stale data past n is never read."""
        if not 0 <= n <= self.length:
            raise ValueError(f"truncate({n}) outside [0, {self.length}]")
        self.length = n

    def compact(self, n: int, slots: Tensor | list[int]) -> None:
        """Copy `slots` (all >= n, in order) down to [n, n + len(slots)) and truncate there.

        Example: length=10, compact(6, [7, 9]) -> slot 7 moves to 6, slot 9 to 7, length=8.
        """
        slots, m = [int(s) for s in slots], len(slots)
        if m and (min(slots) < n or max(slots) >= self.length):
            raise ValueError(f"compact({n}, ...): slots must lie in [{n}, {self.length})")
        if slots != list(range(n, n + m)):   # none, or a chain's first rows: in place already
            at = torch.tensor(slots, dtype=torch.long, device=self.k.device)
            # subtle: advanced indexing copies first, so overlapping source/target ranges are safe
            self.k[:, :, :, n:n + m] = self.k[:, :, :, at]
            self.v[:, :, :, n:n + m] = self.v[:, :, :, at]
        self.length = n + m
