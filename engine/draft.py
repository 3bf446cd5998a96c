"""A cheap model beside its target: the draft that proposes tokens and the target that checks
them. Speculative decoding calls them draft and target, contrastive decoding amateur and expert.

The cheap model is another Llama with its own cache, or an early exit: the target's own layers
[0, L), read out through its final norm and LM head (a self-draft: Zhang et al. 2023, arXiv
2309.08168, skip layers; LayerSkip, Elhoushi et al. 2024, arXiv 2404.16710, exits early, as
here). Layer i's K/V
depend only on layers < i, so an early exit's K/V *are* the target's: both share one cache,
and the target's check resumes from the draft's layer-L stream, computing only layers [L, n).

    pair = pair_for(target, draft, capacity)          # draft: a Llama, or an int L
    pair.propose(tokens, positions) -> (V,)           # the draft's logits after the last token
    pair.verify(tokens, positions, rows) -> (rows, V) # the target's logits at the last rows
    pair.rollback(n)                                  # forget every slot from n on
"""
from __future__ import annotations

import torch
from torch import Tensor

from engine.kvcache import KVCache
from engine.llama import Llama


class Separate:
    """A draft Llama with its own cache; the target verifies with one ordinary forward."""

    def __init__(self, target: Llama, draft: Llama, capacity: int, scratch: int):
        self.target, self.draft = target, draft
        self.tcache = KVCache.for_model(target, capacity, scratch=scratch)
        self.dcache = KVCache.for_model(draft, capacity, scratch=scratch)

    target_seen = property(lambda self: self.tcache.length)   # slots the target has in cache
    draft_seen = property(lambda self: self.dcache.length)

    def propose(self, tokens: Tensor, positions: Tensor) -> Tensor:
        return self.draft(tokens, positions, self.dcache, keep=[-1])[0, -1]           # (V,)

    def verify(self, tokens: Tensor, positions: Tensor, rows: int) -> Tensor:
        return self.target(tokens, positions, self.tcache, keep=torch.arange(-rows, 0))[0]  # (rows, V)

    def rollback(self, n: int) -> None:
        self.tcache.truncate(n)
        self.dcache.truncate(min(n, self.dcache.length))  # a last draft never fed to it is not there


class EarlyExit:
    """The target's layers [0, L) as the draft, on the target's cache. Exact up to rounding:
    layers < L run in the pieces the draft was fed in, not in one batch of the checked rows."""

    def __init__(self, target: Llama, L: int, capacity: int, scratch: int):
        self.target, self.L, self.cache = target, L, KVCache.for_model(target, capacity, scratch=scratch)
        self.base, self.hidden = 0, []    # slots whose every layer is valid; layer-L x since then

    target_seen = property(lambda self: self.base)
    draft_seen = property(lambda self: self.cache.length)

    def _lower(self, tokens: Tensor, positions: Tensor) -> Tensor:
        x = self.target.lower(tokens, positions, self.cache, self.L)               # (1, T, C)
        self.hidden.append(x)
        return x

    @torch.inference_mode()
    def propose(self, tokens: Tensor, positions: Tensor) -> Tensor:
        return self.target.head(self._lower(tokens, positions)[:, -1:])[0, -1]      # (V,)

    @torch.inference_mode()
    def verify(self, tokens: Tensor, positions: Tensor, rows: int) -> Tensor:
        fed = sum(x.shape[1] for x in self.hidden)
        if fed < tokens.shape[1]:                     # the last draft has no layer-L state yet
            self._lower(tokens[:, fed:], positions[fed:])
        x, self.hidden = torch.cat(self.hidden, 1), []                             # (1, T, C)
        x = self.target.upper(x, positions, self.cache, self.base, self.L)         # (1, T, C)
        return self.target.head(x[:, -rows:])[0]                                   # (rows, V)

    def rollback(self, n: int) -> None:
        self.cache.truncate(n)
        self.base = n


def pair_for(target: Llama, draft: Llama | int, capacity: int, scratch: int) -> Separate | EarlyExit:
    """The pair for a draft Llama (same vocab) or an early exit after `draft` layers; `scratch`
    of the `capacity` slots only ever hold one step's drafts (the rest must fit the context)."""
    if isinstance(draft, int):
        return EarlyExit(target, draft, capacity, scratch)
    if draft.config.vocab_size != target.config.vocab_size:
        raise ValueError(f"vocab {draft.config.vocab_size} != the target's {target.config.vocab_size}: "
                         "the cheap model must speak in the target's token ids")
    return Separate(target, draft, capacity, scratch)
