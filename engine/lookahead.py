"""Lookahead decoding: a Jacobi window mints n-grams, a pool recalls them, one forward checks them.

Fu, Bailis, Stoica, Zhang, "Break the Sequential Dependency of LLM Inference Using Lookahead
Decoding", ICML 2024, arXiv 2402.02057.

After the prompt's step (plain's), every step sends one tree of rows after the committed cache:
the last accepted token x (its K/V are not cached yet), a window of N-1 levels x W columns (the
last N-1 Jacobi iterates), and the pool's guesses for x, merged into a prefix tree. Each window
column is a chain whose newest row predicts one more token, which closes an n-gram for the pool
and becomes the next level. The guesses are checked with `verify_match`, so the output is plain
decoding's, greedy or sampled.

Choices where LADE and llama.cpp differ (the bench has the last word):
- The window starts full, copied diagonally from the prompt (column k reads prompt[k:k+N-1]):
  no warm-up steps and no random source.
- The window moves one column per step, whatever was accepted (LADE); llama.cpp's shift per
  accepted token needs filler tokens and did no better (SmolLM2-135M, 6 chat prompts x 64
  greedy tokens, W5 N4 G5: 1.43 vs 1.41 tokens a forward).
- A full match also emits the bonus token: up to N tokens per forward (LADE stops at N-1).
- Column 0's n-gram is keyed by x itself (llama.cpp keys it by a stale window token).
- The pool holds the prompt's, the emitted and the window's n-grams; the first guess is
  prompt lookup's (engine/lookup.py): its longest match of up to N-1 tokens.
- A policy (engine/adapt/policy.py) may send a copy of the text instead (up to 8 tokens), a plain
  step, or fewer columns; the columns it does not send keep their levels until sent again.

But: batch 1 only; window K/V are recomputed every step, never cached; no EOS handling (that
is `generate()`'s job), so an EOS may sit in the window like any other token.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Iterator, NamedTuple

import torch
from torch import Tensor

from engine.generate import Step
from engine.kvcache import KVCache
from engine.llama import Llama, LlamaConfig
from engine.lookup import find
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


class Rows(NamedTuple):
    """One step's rows, in the order they are sent (row 0 is x)."""
    tokens: list[int]          # x, the window's other cells, then the guesses' trie
    parent: list[int]          # each row's parent row, -1 for x: the tree the mask draws
    newest: list[int]          # the newest level's rows: their argmax mints the next level
    paths: list[list[int]]     # each guess's rows, one per token
    trie: int                  # the first trie row: x and the window's rows come before it


def layout(x: int, levels: list[list[int]], grams: list[tuple[int, ...]]) -> Rows:
    """The step's rows: x, the window (levels of W columns) and a prefix tree of the guesses.

    Row l*W + k is window level l, column k (row 0 is x, level 0's dead slot). Level 0 is a
    causal chain from x; level l >= 1, column k hangs under level l-1, column k. Guesses sharing
    a prefix share rows. An empty window (W = 0) leaves x and the trie: prompt-lookup decoding,
    or a plain step.
    """
    W = len(levels[0]) if levels else 0
    tokens, parent = [x], [-1]
    for l, level in enumerate(levels):
        for k, t in enumerate(level):
            if l or k:                                     # level 0, column 0 is x's own row
                tokens.append(t)
                parent.append(k - 1 if l == 0 else (l - 1) * W + k)
    newest, first_trie_row = list(range(len(tokens) - W, len(tokens))), len(tokens)   # (N-1) W, or 1
    trie, paths = {}, []                                   # (parent row, token) -> row
    for gram in grams:
        row, path = 0, []
        for t in gram:
            if (row, t) not in trie:
                trie[row, t] = len(tokens)
                tokens.append(t)
                parent.append(row)
            row = trie[row, t]
            path.append(row)
        paths.append(path)
    return Rows(tokens, parent, newest, paths, first_trie_row)


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


def tree_forward(model: Llama, cache: KVCache, tokens: list[int], parent: list[int], keep: list[int],
                 trim_layers: int) -> Tensor:
    """Logits (len(keep), V) of step rows `keep`, the rows sent after the cache as the tree
    `parent` draws: each row at position P + its number of ancestors, seeing the cache, its
    ancestors and itself. A tree that is one chain (a plain step, a copy) is sent causal."""
    c, T = cache.length, len(tokens)
    device = model.tok_embeddings.weight.device
    if parent == list(range(-1, T - 1)):   # one chain: the causal mask, as plain and lookup send it
        return model(torch.tensor([tokens], device=device), torch.arange(c, c + T, device=device),
                     cache, keep=keep, trim_layers=trim_layers)[0]                   # (len(keep), V)
    tree = tree_mask(parent)                                          # (T, T)
    mask = torch.ones(T, c + T, dtype=torch.bool)                     # (T, S): the cache, then the tree
    mask[:, c:] = tree
    positions = c + tree.sum(1) - 1                                   # (T,) P + ancestors per row
    logits = model(torch.tensor([tokens], device=device), positions.to(device), cache, mask.to(device),
                   keep=keep, trim_layers=trim_layers)                # (1, len(keep), V)
    return logits[0]


# --------------------------------------------------------------------------- decoder

def check(config: LlamaConfig, second=None, window: int | None = None, ngram: int = 4,
          guesses: int | None = None, trim_layers: int = 0, policy=None, **_) -> tuple[int, int, int]:
    """decode()'s knobs for a model of `config`, or a ValueError: (W, N, G) as decode reads them.
    The front doors call it before any weight is loaded."""
    N, W = ngram, next((k for k in (window, guesses) if k is not None), 5)
    G = W if guesses is None else guesses
    if policy:                                    # room for the largest choice it can make
        W, G = policy.most_window, policy.most_guesses
    if not all(type(k) is int for k in (W, N, G)) or W < 0 or N < 2 or G < 0 or W + G == 0:
        raise ValueError(f"need integers window >= 0, ngram >= 2, guesses >= 0, not both 0 (that is plain "
                         f"decoding); got {W!r}, {N!r}, {G!r}")
    if step_rows(W, N, G) > config.max_seq_len:   # before allocating a cache for them
        raise ValueError(f"window {W}, ngram {N}, guesses {G}: a step of up to {step_rows(W, N, G)} rows exceeds "
                         f"the model's context ({config.max_seq_len}); make them smaller")
    if type(trim_layers) is not int or not 0 <= trim_layers <= config.n_layers:
        raise ValueError(f"trim_layers must be in [0, {config.n_layers}], got {trim_layers}")
    return W, N, G


def decode(model: Llama, prompt: list[int], *, sampler: Sampler, rng: Random, max_new_tokens: int,
           window: int | None = None, ngram: int = 4, guesses: int | None = None, trim_layers: int = 0,
           policy=None, trace: bool = False) -> Iterator[Step]:
    """Lookahead decoding (Fu et al. 2024), one yield per forward; greedy or sampled, exact.

        pool <- n-grams of prompt; levels <- N-1 levels x W copied from prompt
        x <- plain's first token, from the prompt alone (its prefill, engine/generate.py); yield x
        loop:                                          # P: x's position; its K/V not cached yet
            grams  <- G guesses for x: prompt lookup's, then the pool's (or the policy's copy, alone)
            rows   <- x + levels (x is level 0's first cell) + trie(grams), one tree mask
            logits <- model(rows), kept only at x, the newest level and the trie
            y      <- verify_match(logits[x], logits[trie], grams)      # 1..N tokens
            cache  <- cache + x + rows of the guess that y follows     # y[-1] is not cached
            pool   += (window column + argmax of its newest row) for each column, y's n-grams
            levels <- levels[1:] + [argmax of newest level];  x <- y[-1];  yield y

    W = `window` columns, N = `ngram`, G = `guesses` (one given, the other is the same; neither,
    W = G = 5; W = 0: prompt lookup from the pool). `trim_layers` freezes the window's older
    levels in the last layers. `policy` (engine/adapt/policy.py, Lookahead) chooses each step instead,
    up to its own largest W and G: the first W' columns and G' guesses (W' = G' = 0: a plain
    step), or a copy of the text as the one guess; columns not sent pause.
    """
    W, N, G = check(model.config, window=window, ngram=ngram, guesses=guesses, trim_layers=trim_layers,
                    policy=policy)
    if not prompt:
        raise ValueError("lookahead needs a prompt of at least one token")
    # the committed tokens, plus one step's scratch rows: x, the rest of the window, the trie
    scratch = max((N - 1) * (W + G), policy.copy_most if policy else 0)
    cache = KVCache.for_model(model, len(prompt) + max_new_tokens + scratch, scratch=scratch)
    device = model.tok_embeddings.weight.device
    pool = Pool(G, N)                                  # per key token, its latest G n-grams: a step verifies G
    pool.add_text(prompt)
    levels = init_window(prompt, W, N)                 # N-1 levels x W columns

    # the prompt's step is plain's, the same one causal call (engine/generate.py)
    logits = model(torch.tensor([prompt], device=device), torch.arange(len(prompt), device=device),
                   cache, keep=[-1])[0]                                          # (1, V)
    x = sampler.draw(logits[-1], rng, "token", len(prompt))
    text = [*prompt, x]
    pool.add_text(text, len(prompt))
    arm = "plain" if policy else ""
    yield Step([x], trace={"kind": "lookahead", "position": len(prompt), "first": True, "prefill": len(prompt) - 1,
                           "x": prompt[-1], "N": N, "arm": arm, "levels": [], "parent": [-1], "grams": [],
                           "best": 0, "accepted": 0, "next": x, "why": ""} if trace else None, arm=arm)
    while True:
        P = len(text) - 1                              # x's slot and position: the cache holds text[:P]
        room = max(len(prompt) + max_new_tokens - len(text) - 1, 0)   # tokens a guess can use
        w, g, copy = policy.choose(text, room) if policy else (W, G, [])
        grams = [tuple(copy)] if copy else candidates(pool, text, g, N) if g else []
        sent = [level[:w] for level in levels]         # columns >= w pause this step
        rows = layout(x, sent, grams)
        # the rows read: x (the target's own token), the newest level (it mints), the trie (it verifies)
        keep = sorted({0, *rows.newest, *range(rows.trie, len(rows.tokens))})
        logits = tree_forward(model, cache, rows.tokens, rows.parent, keep, trim_layers)  # (len(keep), V)
        at = {r: i for i, r in enumerate(keep)}                       # step row -> its row of logits
        if grams:
            cand_rows, cand = guessed(logits, at, rows.paths, grams)  # (G', n, V), (G', n)
            out, best = verify_match(logits[at[0]], cand_rows, cand, sampler, rng, P + 1)
        else:   # nothing guessed: plain's own draw (what verify_match would do, with fewer ops)
            out, best = [sampler.draw(logits[at[0]], rng, "token", P + 1)], 0
        m = len(out) - 1                                              # guess tokens accepted
        # row r was written to slot P + r: keep x's, then move the accepted guess's rows after it
        cache.compact(P + 1, [P + r for r in rows.paths[best][:m]] if m else [])
        arm = "" if not policy else "copy" if copy else f"W{w} G{g}" if w + g else "plain"
        info = None
        if trace:   # before the window moves: the rows this forward saw
            info = {"kind": "lookahead", "position": P + 1, "first": False, "prefill": 0, "x": x, "N": N,
                    "arm": arm, "levels": sent, "parent": rows.parent, "grams": grams, "best": best,
                    "accepted": m, "next": out[-1], "why": getattr(policy, "why", "")}  # the numbers behind the arm
        if w:                                                         # the sent columns move on
            # argmax even when sampling: the window only guesses, verify_match alone decides tokens
            new = logits[[at[r] for r in rows.newest]].argmax(-1).tolist()   # (w,)
            # the sent columns shift one level (their oldest level's n-grams go to the pool), the
            # paused columns (>= w) keep theirs
            levels = [moved + level[w:] for moved, level in zip(advance(pool, sent, x, new), levels)]
            if trace:
                info["minted"] = new
        text += out
        pool.add_text(text, len(text) - len(out))
        if policy:
            policy.update(len(out), len(rows.tokens))
        x = out[-1]
        yield Step(out, drafted=len(rows.tokens) - rows.trie, accepted=m, trace=info, arm=arm)


def step_rows(W: int, N: int, G: int) -> int:
    """The most rows a step sends: the window's (N-1) W, x its first cell (x alone if W = 0),
    and a trie of at most G (N-1)-grams."""
    return (N - 1) * (W + G) + (W == 0)


def candidates(pool: Pool, text: list[int], G: int, N: int) -> list[tuple[int, ...]]:
    """Up to G (N-1)-grams to follow x = text[-1]: first what followed the latest earlier match
    of text's longest suffix of up to N-1 tokens (prompt lookup, whose match may be x alone),
    then the pool's n-grams for x, most recent first."""
    copy = tuple(find(text, N - 1, N - 1)[0])
    lead = [copy] if len(copy) == N - 1 else []
    return (lead + [g for g in pool.guesses(text[-1]) if g != copy])[:G]


def guessed(logits: Tensor, at: dict[int, int], paths: list[list[int]],
            grams: list[tuple[int, ...]]) -> tuple[Tensor, Tensor]:
    """verify_match's rows (G', n, V) and candidates (G', n): each guess's logits, its tokens;
    n = N-1, or the copy's length. `at` maps a step row to its row of `logits`."""
    at_rows = [at[r] for path in paths for r in path]
    # subtle: right after a forward each tensor op costs ~10 us (cold caches); a copy's rows
    # are one run of logits' rows, so a view of them copies nothing
    run = at_rows == list(range(at_rows[0], at_rows[0] + len(at_rows)))
    rows = logits[at_rows[0]:at_rows[0] + len(at_rows)] if run else logits[at_rows]   # (G' n, V)
    return rows.view(len(grams), len(grams[0]), -1), torch.tensor(grams, dtype=torch.long)


def advance(pool: Pool, levels: list[list[int]], x: int, new: list[int]) -> list[list[int]]:
    """Pool each column's n-gram (chain + its newest prediction); drop the oldest level."""
    for k in range(len(new)):
        chain = [x if k == 0 else levels[0][k]] + [level[k] for level in levels[1:]] + [new[k]]
        pool.add(chain[0], tuple(chain[1:]))
    # subtle: level 1 becomes level 0, whose column 0 is the dead slot under the next x. The
    # window is placed relative to x, so after e > 1 emitted tokens it lags e - 1 columns
    return levels[1:] + [new]
