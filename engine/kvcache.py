"""KV cache: preallocated key/value buffers for every layer, owned by the caller.

The model appends the T new K/V of a forward at slots [length, length + T) in every layer,
then advances `length` once. Slots are not positions: lookahead writes several rows that
share a position, then keeps only the accepted ones with `compact`. Speculative decoding rolls
rejected drafts back with `truncate`.
"""
from __future__ import annotations

import torch
from torch import Tensor

from engine.fast.machine import attention_dtype, check_memory


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
