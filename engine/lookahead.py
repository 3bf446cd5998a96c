"""Lookahead decoding: a Jacobi window mints n-grams, a pool recalls them, one forward checks them.

Fu, Bailis, Stoica, Zhang, "Break the Sequential Dependency of LLM Inference Using Lookahead
Decoding", ICML 2024, arXiv 2402.02057.

Every step sends one tree of rows after the committed cache: the last accepted token x (its K/V
are not cached yet), a window of N-1 levels x W columns (the last N-1 Jacobi iterates), and the
pool's guesses for x, merged into a prefix tree. Each window column is a chain whose newest row
predicts one more token, which closes an n-gram for the pool and becomes the next level. The
guesses are checked with `verify_match`, so the output is plain decoding's, greedy or sampled.

Choices where LADE and llama.cpp differ (small samples below; the benchmark has the last word):
- The window starts full, copied diagonally from the prompt (column k reads prompt[k:k+N-1]):
  no warm-up steps, every step has one shape, and no random source is needed.
- The window moves one column per step, whatever was accepted (LADE). Shifting one column per
  accepted token (llama.cpp) keeps positions aligned but needs filler tokens, and did no better:
  SmolLM2-135M, 6 chat prompts x 64 greedy tokens, 1.43 vs 1.41 tokens/forward (W5 N4 G5),
  1.43 vs 1.38 (W7 N5 G7); tiny random models: within 0.05 either way.
- A full match also emits the bonus token: up to N tokens per forward (LADE stops at N-1).
- Column 0's n-gram is keyed by x itself (llama.cpp keys it by a stale window token).
- The pool holds the prompt's n-grams, every emitted n-gram and the window's n-grams.

But: batch 1 only; window K/V are recomputed every step, never cached; no EOS handling (that
is `generate()`'s job), so an EOS may sit in the window like any other token.
"""
from __future__ import annotations

import time
from collections import OrderedDict
from typing import Iterator

import torch
from torch import Tensor

from engine.generate import Step
from engine.kvcache import KVCache
from engine.llama import Llama
from engine.sampling import Random, Sampler, verify_match


# --------------------------------------------------------------------------- n-gram pool

class Pool:
    """First token -> up to `size` distinct (n-1)-tuples that followed it, oldest-seen out first."""

    def __init__(self, size: int, n: int):
        self.size, self.n = size, n
        self.grams: dict[int, OrderedDict[tuple[int, ...], None]] = {}

    def add(self, key: int, gram: tuple[int, ...]) -> None:
        if self.size == 0:
            return
        seen = self.grams.setdefault(key, OrderedDict())
        seen[gram] = None
        seen.move_to_end(gram)                       # seen again: now the most recent
        if len(seen) > self.size:
            seen.popitem(last=False)

    def add_text(self, tokens: list[int], start: int = 0) -> None:
        """Add every n-gram of `tokens` that ends at an index >= start.

        Example: n=3, tokens=[5, 6, 7, 5], start=3 -> adds key 6, gram (7, 5).
        """
        n = self.n
        for end in range(max(start, n - 1), len(tokens)):
            self.add(tokens[end - n + 1], tuple(tokens[end - n + 2:end + 1]))

    def guesses(self, key: int) -> list[tuple[int, ...]]:
        return list(reversed(self.grams.get(key, ())))  # most recent first


# --------------------------------------------------------------------------- window and mask

def init_window(prompt: list[int], W: int, N: int) -> list[list[int]]:
    """N-1 levels of W tokens; level l, column k = prompt[(l + k) mod len(prompt)].

    Column k's chain (level 0 .. N-2) then reads a stretch of the prompt, so the first n-grams
    the window mints start with real text. Level 0, column 0 is a dead slot: x sits there.
    """
    return [[prompt[(l + k) % len(prompt)] for k in range(W)] for l in range(N - 1)]


def layout(x: int, window: list[list[int]], guesses: list[tuple[int, ...]]):
    """The step's rows: tokens, parent row (-1 for x), newest-level rows, each guess's trie rows.

    Row l*W + k is window level l, column k (row 0 is x). Level 0 is a causal chain from x;
    level l >= 1, column k hangs under level l-1, column k. Guesses sharing a prefix share rows.
    """
    W = len(window[0])
    tokens, parent = [], []
    for l, level in enumerate(window):
        for k, t in enumerate(level):
            tokens.append(x if l == k == 0 else t)
            parent.append(k - 1 if l == 0 else (l - 1) * W + k)
    newest = list(range(len(tokens) - W, len(tokens)))
    trie, paths = {}, []                                   # (parent row, token) -> row
    for gram in guesses:
        row, path = 0, []
        for t in gram:
            if (row, t) not in trie:
                trie[row, t] = len(tokens)
                tokens.append(t)
                parent.append(row)
            row = trie[row, t]
            path.append(row)
        paths.append(path)
    return tokens, parent, newest, paths


def tree_mask(parent: list[int]) -> Tensor:
    """(T, T) bool: row i sees row j iff j is i or an ancestor of i. Every row also sees the cache.

    W=3, N=3, G=2 with x="the", window [[-, a1, a2], [b0, b1, b2]], guesses (cat, sat), (dog, ran):

        row  pos |  the a1  a2  b0  b1  b2  cat sat dog ran
        the  P   |  x   .   .   .   .   .   .   .   .   .
        a1   P+1 |  x   x   .   .   .   .   .   .   .   .
        a2   P+2 |  x   x   x   .   .   .   .   .   .   .
        b0   P+1 |  x   .   .   x   .   .   .   .   .   .
        b1   P+2 |  x   x   .   .   x   .   .   .   .   .
        b2   P+3 |  x   x   x   .   .   x   .   .   .   .
        cat  P+1 |  x   .   .   .   .   .   x   .   .   .
        sat  P+2 |  x   .   .   .   .   .   x   x   .   .
        dog  P+1 |  x   .   .   .   .   .   .   .   x   .
        ran  P+2 |  x   .   .   .   .   .   .   .   x   x

    A row's position is P + its number of ancestors. Guess rows see only x and their own prefix,
    never the window, which is why trimming the window's rows cannot change the output.
    """
    up = torch.tensor(parent, dtype=torch.long)                       # (T,)
    seen = torch.eye(len(parent), dtype=torch.bool)                   # (T, T)
    rows, anc = torch.arange(len(parent)), up.clone()
    while (anc >= 0).any():                                           # one pass per tree level
        live = anc >= 0
        seen[rows[live], anc[live]] = True
        anc = torch.where(live, up[anc.clamp(min=0)], anc)
    return seen


def forward(model: Llama, cache: KVCache, prefix: list[int], tokens: list[int], parent: list[int],
            keep: list[int], trim_layers: int) -> Tensor:
    """Logits (len(keep), V) of step rows `keep`; `prefix` rows (prefill only) go first, causal."""
    c, p, T = cache.length, len(prefix), len(tokens)
    device = model.tok_embeddings.weight.device
    tree = tree_mask(parent)                                          # (T, T)
    mask = torch.ones(p + T, c + p + T, dtype=torch.bool)             # (p+T, S)
    mask[:p, c:] = torch.ones(p, p + T, dtype=torch.bool).tril()      # prefix: causal, no step rows
    mask[p:, c + p:] = tree
    depth = tree.sum(1) - 1                                           # (T,) ancestors per row
    positions = torch.cat([torch.arange(c, c + p), c + p + depth])    # (p+T,)
    ids = torch.tensor([prefix + tokens], device=device)              # (1, p+T)
    logits = model(ids, positions.to(device), cache, mask.to(device),
                   keep=[p + r for r in keep], trim_layers=trim_layers)  # (1, len(keep), V)
    return logits[0]


# --------------------------------------------------------------------------- decoder

DEFAULT_N = 4                          # n-gram size when --ngram is not given (make bench: N4 beat N5 here)
AUTO = ((2, 2), (3, 3), (5, 5))        # (W, G) arms of the automatic choice, cheap to costly


class Auto:
    """Pick (W, G) per step to maximise measured tokens per second, among AUTO's arms.

    Every arm is exact, so switching never changes the output, only the speed. Each arm keeps
    decayed sums of the tokens it emitted and the seconds its steps took (forward + verify):
    the measured cost of its (N-1)(W+G)-row forward on this device and the acceptance seen so
    far, in one ratio. Untried arms go first; an arm left alone for `retry` steps is retried.
    """

    def __init__(self, arms, decay: float = 0.8, retry: int = 24):
        self.arms, self.decay, self.retry = arms, decay, retry
        self.tokens = [0.0] * len(arms)
        self.seconds = [0.0] * len(arms)
        self.last = [-1] * len(arms)
        self.step = 0

    def choose(self) -> int:
        self.step += 1
        stale = [a for a in range(len(self.arms))
                 if self.last[a] < 0 or self.step - self.last[a] > self.retry]
        if stale:                                    # untried (last = -1) or not seen for long
            return stale[0]
        return max(range(len(self.arms)), key=lambda a: self.tokens[a] / max(self.seconds[a], 1e-9))

    def update(self, arm: int, tokens: int, seconds: float) -> None:
        self.tokens[arm] = self.decay * self.tokens[arm] + tokens
        self.seconds[arm] = self.decay * self.seconds[arm] + seconds
        self.last[arm] = self.step


def decode(model: Llama, prompt: list[int], *, sampler: Sampler, rng: Random, max_new_tokens: int,
           window: int | None = None, ngram: int | None = None, guesses: int | None = None,
           trim_layers: int = 0, clock=time.perf_counter) -> Iterator[Step]:
    """Lookahead decoding (Fu et al. 2024), one yield per forward; greedy or sampled, exact.

        pool <- n-grams of prompt; window <- N-1 levels x W copied from prompt; x <- prompt[-1]
        loop:
            rows   <- [x] + window + trie(pool[x])          under one tree mask, P = pos(x)
            logits <- model(rows), kept only at x, the newest level and the trie
            y      <- verify_match(logits[x], logits[trie], pool[x])   # 1..N tokens
            cache  <- cache + x + rows of the guess that y follows     # y[-1] is not cached
            pool   += (window column + argmax of its newest row) for each column, y's n-grams
            window <- window[1:] + [argmax of newest level];  x <- y[-1];  yield y

    `Step.drafted` counts the guess rows verified, `Step.accepted` the guess tokens accepted
    (> 0 iff the pool hit). `trim_layers` freezes the window's older levels in the last layers.
    With window and guesses both None, (W, G) is chosen per step by `Auto` (N = DEFAULT_N
    unless given); with either given, the other defaults to it.
    """
    N = DEFAULT_N if ngram is None else ngram
    auto = Auto(AUTO) if window is None and guesses is None else None
    W = window if window is not None else guesses
    G = guesses if guesses is not None else window
    if auto:
        W, G = max(w for w, _ in AUTO), max(g for _, g in AUTO)   # capacity for the largest arm
    if not prompt:
        raise ValueError("lookahead needs a prompt of at least one token")
    if W < 1 or N < 2 or G < 0:
        raise ValueError(f"need window >= 1, ngram >= 2, guesses >= 0; got {W}, {N}, {G}")
    if not 0 <= trim_layers <= model.config.n_layers:  # here, before any token is yielded
        raise ValueError(f"trim_layers must be in [0, {model.config.n_layers}], got {trim_layers}")
    # the committed tokens, plus one step's scratch rows: x, the rest of the window, the trie
    cache = KVCache.for_model(model, len(prompt) + max_new_tokens + (N - 1) * (W + G))
    pool = Pool(G, N)
    pool.add_text(prompt)
    grid = init_window(prompt, W, N)
    text, prefix, x = list(prompt), prompt[:-1], prompt[-1]
    while True:
        arm = auto.choose() if auto and not prefix else None
        if arm is not None:
            W, G = AUTO[arm]
            fill = (text[-W:] * W)[:W]                 # new columns start from recent text
            grid = [(level + fill)[:W] for level in grid]
        t0 = clock()
        cands = pool.guesses(x)[:G]
        tokens, parent, newest, paths = layout(x, grid, cands)
        keep = sorted({0, *newest, *range((N - 1) * W, len(tokens))})
        # subtle: for m > 1 trimmed layers, frozen prompt rows would cache K/V computed from a
        # stale residual; one trimmed layer is exact (its K/V come from an up-to-date input)
        trim = min(trim_layers, 1) if prefix else trim_layers
        base = cache.length + len(prefix)                             # slot and position of x
        logits = forward(model, cache, prefix, tokens, parent, keep, trim)  # (len(keep), V)
        at = {r: i for i, r in enumerate(keep)}
        idx = torch.tensor([[at[r] for r in path] for path in paths], dtype=torch.long)
        rows = logits[idx.view(-1, N - 1).to(logits.device)]          # (G', N-1, V)
        cand = torch.tensor(cands, dtype=torch.long).view(-1, N - 1)  # (G', N-1)
        out, best = verify_match(logits[at[0]], rows, cand, sampler, rng, base + 1)
        m = len(out) - 1                                              # guess tokens accepted
        cache.keep(base + 1, [base + r for r in paths[best][:m]] if m else [])
        new = logits[[at[r] for r in newest]].argmax(-1).tolist()     # (W,) argmax, even sampling
        grid = advance(pool, grid, x, new)
        text += out
        pool.add_text(text, len(text) - len(out))
        if arm is not None:
            auto.update(arm, len(out), clock() - t0)
        prefix, x = [], out[-1]
        yield Step(out, drafted=len(tokens) - (N - 1) * W, accepted=m)


def advance(pool: Pool, grid: list[list[int]], x: int, new: list[int]) -> list[list[int]]:
    """Pool each column's n-gram (chain + its newest prediction); drop the oldest level."""
    for k in range(len(new)):
        chain = [x if k == 0 else grid[0][k]] + [level[k] for level in grid[1:]] + [new[k]]
        pool.add(chain[0], tuple(chain[1:]))
    # subtle: level 1 becomes level 0, whose column 0 is the dead slot under the next x. The
    # window is placed relative to x, so after e > 1 emitted tokens it lags e - 1 columns
    return grid[1:] + [new]
