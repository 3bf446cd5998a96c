"""A cheap model beside its target: the draft that proposes tokens and the target that checks
them. Speculative decoding calls them draft and target, contrastive decoding amateur and expert.

The cheap model is another Llama with its own cache, or an early exit: the target's own layers
[0, L), read out through its final norm and LM head (a self-draft: Zhang et al. 2023, arXiv
2309.08168, skip layers; LayerSkip, Elhoushi et al. 2024, arXiv 2404.16710, exits early, as
here). Layer i's K/V depend only on layers < i, so an early exit's K/V *are* the target's:
both share one cache, and the target's check resumes from the draft's layer-L stream,
computing only layers [L, n). Speculative decoding's draft may also be the text itself
(`Ngram`): no model at all, the target alone on its cache.

    pair = pair_for(target, draft, capacity, scratch) # draft: any Llama (fast.paths.build(ckpt, int4=True):
                                                      # the target's weights in 4 bits), EarlyExit(L), Ngram(n)
    pair.prefill(prompt)                              # the draft reads the prompt (a list of ids)
    pair.propose(tokens, positions) -> (V,) | None    # the draft's logits after the last token
                                                      # (None: it has nothing to propose)
    pair.verify(tokens, positions, rows) -> (rows, V) # the target's logits at the last rows
    pair.rollback(n)                                  # forget every slot from n on
    draft_then_verify(pair, seq, k, sampler, rng, stream)   # both decoders' step, up to the verdict

An early exit's one cache, slots x layers (L = 2 of 4), after the committed a b: the draft
was fed the last token c and its first draft d1, and proposed d1 and d2 (# final K/V,
d written by the draft's layers, . not yet written):

    layer   a b c d1 d2
      3     # # . .  .      verify: `lower` feeds d2 (it has no layer-L stream yet), then
      2     # # . .  .      `upper` runs c d1 d2 through layers [L, 4) from the streams kept
      1     # # d d  .      in `hidden`, writing the dots; rollback(n) keeps slots < n, all
      0     # # d d  .      final (base = n)
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from engine.kvcache import KVCache
from engine.llama import Llama
from engine.lookup import find
from engine.sampling import Random, Sampler


@dataclass(frozen=True)
class EarlyExit:
    """The cheap model as the target's layers [0, layers), then its final norm and LM head:
    speculative's self-draft and contrastive's early-exit amateur (`--draft/--amateur layers:L`)."""
    layers: int


@dataclass(frozen=True)
class Ngram:
    """The draft as the text so far: after the latest earlier occurrence of the last m tokens
    (m = n down to `least`), the token that followed it (engine/lookup.py's `find`). Leviathan
    et al. (2023, sec. 4) found even trivial approximation models (a bigram) speed decoding up;
    this one is the context's own n-gram model: deterministic (q is one-hot at its token), with
    no forward to run, and silent where nothing matches, so a step drafts only as far as the
    text repeats (`--draft ngram`; lookup decoding is the same guess under its own policy).
    least = 2: on the bench's chat texts a guess after any match (one token or more) was the next
    token 9% of the time, after a match of two or more 40% (68% over all prompts:
    engine/adapt/policy.py, NGRAM_PRIOR).
    otherwise: a draft Llama that proposes where the text has no match (`--draft ngram+PATH`):
    the text's guess where it repeats (free), the small model's elsewhere; which one proposes
    is a function of the text alone, so the law holds as for either."""
    n: int = 3
    least: int = 2
    otherwise: Llama | None = None


class SeparatePair:
    """A draft Llama with its own cache; the target verifies with one ordinary forward."""

    def __init__(self, target: Llama, draft: Llama, capacity: int, scratch: int):
        self.target, self.draft = target, draft
        self.tcache = KVCache.for_model(target, capacity, scratch=scratch)
        self.dcache = KVCache.for_model(draft, capacity, scratch=scratch)
        self.forwards = 0                                 # the draft's forwards so far

    target_seen = property(lambda self: self.tcache.length)   # slots the target has in cache
    draft_seen = property(lambda self: self.dcache.length)

    def prefill(self, prompt: list[int]) -> None:
        self.forwards += 1
        feed(self.draft, self.dcache, prompt)

    def propose(self, tokens: Tensor, positions: Tensor) -> Tensor:
        self.forwards += 1
        return self.draft(tokens, positions, self.dcache, keep=[-1])[0, -1]           # (V,)

    def verify(self, tokens: Tensor, positions: Tensor, rows: int) -> Tensor:
        return self.target(tokens, positions, self.tcache, keep=torch.arange(-rows, 0))[0]  # (rows, V)

    def rollback(self, n: int) -> None:
        self.tcache.truncate(n)
        self.dcache.truncate(min(n, self.dcache.length))  # a last draft never fed to it is not there


class EarlyExitPair:
    """The target's layers [0, L) as the draft, on the target's cache. Exact up to rounding:
    layers < L run in the pieces the draft was fed in, not in one batch of the checked rows."""

    def __init__(self, target: Llama, L: int, capacity: int, scratch: int):
        self.target, self.L, self.cache = target, L, KVCache.for_model(target, capacity, scratch=scratch)
        self.base, self.hidden = 0, []    # slots whose every layer is valid; layer-L x since then
        self.forwards = 0                 # the draft's (layers < L) forwards so far

    target_seen = property(lambda self: self.base)
    draft_seen = property(lambda self: self.cache.length)

    def prefill(self, prompt: list[int]) -> None:
        """Nothing: the target's prompt forward writes the one cache's every layer."""

    def _lower(self, tokens: Tensor, positions: Tensor) -> Tensor:
        x = lower(self.target, tokens, positions, self.cache, self.L)              # (1, T, C)
        self.hidden.append(x)
        return x

    @torch.inference_mode()
    def propose(self, tokens: Tensor, positions: Tensor) -> Tensor:
        self.forwards += 1
        return self.target.head(self._lower(tokens, positions)[:, -1:])[0, -1]      # (V,)

    @torch.inference_mode()
    def verify(self, tokens: Tensor, positions: Tensor, rows: int) -> Tensor:
        if not self.hidden:                           # nothing drafted (K = 0): plain's own forward
            return self.target(tokens, positions, self.cache, keep=torch.arange(-rows, 0))[0]  # (rows, V)
        fed = sum(x.shape[1] for x in self.hidden)
        if fed < tokens.shape[1]:                     # the last draft has no layer-L state yet
            self._lower(tokens[:, fed:], positions[fed:])
        x, self.hidden = torch.cat(self.hidden, 1), []                             # (1, T, C)
        x = upper(self.target, x, positions, self.cache, self.base, self.L)        # (1, T, C)
        return self.target.head(x[:, -rows:])[0]                                   # (rows, V)

    def rollback(self, n: int) -> None:
        self.cache.truncate(n)
        self.base = n


class NgramPair:
    """The text as the draft (Ngram): the target's cache, and the tokens the draft was fed; with
    a model `otherwise`, its own cache: it reads the prompt, then the text it has not seen when
    it must propose."""

    def __init__(self, target: Llama, ngram: Ngram, capacity: int, scratch: int):
        self.target, self.n, self.least, self.text = target, ngram.n, min(ngram.least, ngram.n), []
        self.cache = KVCache.for_model(target, capacity, scratch=scratch)
        self.model = ngram.otherwise
        self.mcache = KVCache.for_model(self.model, capacity, scratch=scratch) if self.model else None
        self.forwards = 0                                 # the model's forwards so far

    target_seen = property(lambda self: self.cache.length)
    draft_seen = property(lambda self: len(self.text))

    def prefill(self, prompt: list[int]) -> None:
        """The text; and a model `otherwise` reads it now, as a draft model does (prompt time)."""
        self.text += prompt
        if self.model is not None:
            self.forwards += 1
            feed(self.model, self.mcache, prompt)

    def propose(self, tokens: Tensor, positions: Tensor) -> Tensor | None:
        self.text += tokens[0].tolist()
        guess, m, _ = find(self.text, self.n, 1)
        device = self.target.tok_embeddings.weight.device
        if m >= self.least:   # a one-hot law under every sampler: probs() of these logits is 1 at the guess
            return torch.full((self.target.config.vocab_size,), float("-inf"), device=device).index_fill_(
                0, torch.tensor(guess, device=device), 0.0)                       # (V,)
        if self.model is None:
            return None                                   # no match long enough: nothing to propose
        self.forwards += 1                                # the model proposes, fed what it lacks
        return feed(self.model, self.mcache, self.text[self.mcache.length:])                  # (V,)

    def verify(self, tokens: Tensor, positions: Tensor, rows: int) -> Tensor:
        return self.target(tokens, positions, self.cache, keep=torch.arange(-rows, 0))[0]   # (rows, V)

    def rollback(self, n: int) -> None:
        self.cache.truncate(n)
        del self.text[n:]                                 # a last draft never fed to it is not there
        if self.mcache is not None:
            self.mcache.truncate(min(n, self.mcache.length))


def feed(model: Llama, cache: KVCache, tokens: list[int]) -> Tensor:
    """`model`'s logits after `tokens` (V,), read in at the cache's end."""
    device, n = model.tok_embeddings.weight.device, cache.length
    return model(torch.tensor([tokens], device=device), torch.arange(n, n + len(tokens), device=device),
                 cache, keep=[-1])[0, -1]


def lower(model: Llama, tokens: Tensor, positions: Tensor, cache: KVCache, L: int) -> Tensor:
    """Layers [0, L) of tokens (B, T) -> their layer-L stream (B, T, C): an early exit.

    Advances cache.length past the T slots, so a next call sees their K/V of layers < L,
    which are final (they depend on the tokens alone). Layers >= L at those slots stay
    stale until `upper` writes them.
    """
    x = model.blocks(model.tok_embeddings(tokens), positions, cache, stop=L)
    cache.length += tokens.shape[1]
    return x


def upper(model: Llama, x: Tensor, positions: Tensor, cache: KVCache, start: int, L: int) -> Tensor:
    """Layers [L, n_layers) of the layer-L stream x (B, T, C) of slots [start, start + T),
    resuming `lower`; leaves cache.length at start + T. Returns x (B, T, C)."""
    cache.length = start
    x = model.blocks(x, positions, cache, start=L)
    cache.length = start + x.shape[1]
    return x


Draft = Llama | EarlyExit | Ngram


def model_of(draft) -> Llama | None:
    """The weights a draft runs apart from the target's: a draft model itself, the model beside
    the n-grams; None for the n-grams alone and an early exit (the target's own layers)."""
    if isinstance(draft, Ngram):
        return draft.otherwise
    return draft if isinstance(draft, torch.nn.Module) else None
Pair = SeparatePair | EarlyExitPair | NgramPair


def pair_for(target: Llama, draft: Draft, capacity: int, scratch: int) -> Pair:
    """The pair for a draft Llama (same vocab), an early exit or the text's n-grams (with a draft
    Llama or not); `scratch` of the `capacity` slots only ever hold one step's drafts (the rest
    must fit the context)."""
    if isinstance(draft, EarlyExit):
        return EarlyExitPair(target, draft.layers, capacity, scratch)
    if isinstance(draft, Ngram):
        if not all(type(v) is int and v >= 1 for v in (draft.n, draft.least)):
            raise ValueError(f"an n-gram draft needs integers n, least >= 1, got {draft}")
        if draft.otherwise is not None:
            speaks_as(target, draft.otherwise)
        return NgramPair(target, draft, capacity, scratch)
    return SeparatePair(target, speaks_as(target, draft), capacity, scratch)


def speaks_as(target: Llama, draft) -> Llama:
    """`draft` if it is a model with the target's vocabulary (a Llama, or any module that
    answers as one); else a ValueError."""
    if isinstance(draft, int):   # a bare layer count: which decoder's range of L would it be?
        raise ValueError(f"the cheap model is a Llama or EarlyExit(L), got {draft!r}")
    if draft.config.vocab_size != target.config.vocab_size:
        raise ValueError(f"vocab {draft.config.vocab_size} != the target's {target.config.vocab_size}: "
                         "the cheap model must speak in the target's token ids")
    return draft


def draft_then_verify(pair: Pair, seq: list[int], k: int, sampler: Sampler, rng: Random, stream: str,
                      bonus_row: bool = False, laws: bool = True) -> tuple[list[int], Tensor, list[Tensor], Tensor]:
    """The draft proposes up to k tokens after `seq`, one at a time; the target scores them in one forward.

        n = len(seq)
        for i < k:  a_i = draft(seq + d_<i)[-1];  q_i = sampler.probs(a_i);  d_i ~ q_i, key (stream, n + i)
                    (a_i None, a draft with nothing to propose: k = i, and stop)
        bonus_row:  a_k = draft(seq + d_<k)[-1], the draft at the position after the last draft
        e_0..e_k = target(seq + d_0..d_k-1)[-k-1:]                   # one forward, k + 1 rows
    Returns (drafts, q (k, V) float64, [a_0, ..], e (k + 1, V)); the caller judges the drafts.
    laws=False, when greedy: d_i is a_i's argmax (the one-hot law's only draw, Sampler.draw) and
    no q is built, q comes back (0, V): a vocabulary-wide float64 law per draft cost ~0.3 ms.
    subtle: stopping short keeps the law only because whether a_i exists is a function of the
    text seq + d_<i alone (an n-gram match), never of a draw still to come.
    """
    laws = laws or not sampler.greedy
    device = pair.target.tok_embeddings.weight.device
    as_tensor = lambda tokens: torch.tensor([tokens], dtype=torch.long, device=device)  # (1, T)
    n, feed, drafts, a, q = len(seq), seq[pair.draft_seen:], [], [], []
    for i in range(k + bonus_row):
        a.append(pair.propose(as_tensor(feed), torch.arange(n + i - len(feed), n + i, device=device)))  # (V,)
        if a[-1] is None:                                 # nothing to propose: the step drafts i
            a.pop()
            k = i
            break
        if i < k and laws:
            q.append(sampler.probs(a[-1]))                # subtle: q is the law d_i was drawn from
            drafts.append(rng.categorical(q[-1], stream, n + i))
        elif i < k:
            drafts.append(sampler.draw(a[-1], rng, stream, n + i))
        feed = drafts[-1:]
    start = pair.target_seen
    e = pair.verify(as_tensor(seq[start:] + drafts), torch.arange(start, n + k, device=device), k + 1)
    V = e.shape[-1]
    return drafts, torch.stack(q) if q else torch.zeros(0, V, dtype=torch.float64, device=device), a, e
