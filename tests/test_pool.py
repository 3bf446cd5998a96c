"""The lookahead n-gram pool files n-grams as its docstring says, by explicit examples.

Why it matters: lookahead's output is exact whatever the pool holds (verification decides), so
the exactness proofs cannot see a pool that files the wrong n-grams; only its speed suffers,
silently. The pool: key = an n-gram's first token, value = its next n-1 tokens; guesses come
most recent first; at most `size` per key, the oldest-seen evicted; a gram seen again becomes
the most recent. Each broken variant below fails the same checks.
"""
import pytest

from engine.lookahead import Pool, advance


def filing_failures(pool_cls) -> list[str]:
    """The documented behaviours this pool class gets wrong."""
    bad = []
    p = pool_cls(2, 3)
    p.add(5, (6, 7))
    p.add(5, (8, 9))
    if p.guesses(5) != [(8, 9), (6, 7)]:
        bad.append("most recent first")
    p.add(5, (1, 2))
    if p.guesses(5) != [(1, 2), (8, 9)]:
        bad.append("capped at size, oldest evicted")
    p.add(5, (8, 9))
    if p.guesses(5) != [(8, 9), (1, 2)]:
        bad.append("seen again becomes the most recent, without a duplicate")
    p.add(5, (3, 4))
    if p.guesses(5) != [(3, 4), (8, 9)]:
        bad.append("a refreshed gram outlives an older one")
    if p.guesses(6) != [] or p.guesses(4) != []:
        bad.append("keys are first tokens only")
    one = pool_cls(1, 3)                                 # the smallest pool that holds anything
    one.add(5, (6, 7))
    one.add(5, (8, 9))
    if one.guesses(5) != [(8, 9)]:
        bad.append("a pool of size 1 holds the latest gram")
    q = pool_cls(4, 3)
    q.add_text([5, 6, 7, 5, 6, 8])
    if (q.guesses(5), q.guesses(6), q.guesses(7)) != ([(6, 8), (6, 7)], [(7, 5)], [(5, 6)]):
        bad.append("add_text files every n-gram: key first token, value the next n-1")
    r = pool_cls(4, 3)
    r.add_text([5, 6, 7, 5], start=3)
    if (r.guesses(6), r.guesses(5)) != ([(7, 5)], []):
        bad.append("add_text from start: only n-grams ending at index >= start (docstring example)")
    z = pool_cls(0, 3)
    z.add_text([1, 2, 3, 1, 2])
    if z.guesses(1) != []:
        bad.append("size 0 keeps nothing")
    return bad


def test_the_pool_files_ngrams_as_documented():
    assert filing_failures(Pool) == []


def test_advance_files_each_window_column_chain_with_its_newest_prediction():
    # W = 3, N = 3: column k's n-gram is (level 0 token, level 1 token, new prediction); in
    # column 0 the step's input x stands in for the dead slot.
    pool = Pool(4, 3)
    grid = advance(pool, [[0, 11, 12], [20, 21, 22]], 9, [30, 31, 32])
    assert grid == [[20, 21, 22], [30, 31, 32]]
    assert (pool.guesses(9), pool.guesses(11), pool.guesses(12)) == ([(20, 30)], [(21, 31)], [(22, 32)])
    assert pool.guesses(0) == []


class EvictsNewest(Pool):
    def add(self, key, gram):
        seen = self.grams.setdefault(key, {})
        if len(seen) < self.size:
            seen[gram] = None


class NoRefresh(Pool):
    def add(self, key, gram):
        seen = self.grams.setdefault(key, {})
        seen.setdefault(gram, None)
        while len(seen) > self.size:
            del seen[next(iter(seen))]


class KeyIsLastToken(Pool):
    def add_text(self, tokens, start=0):
        n = self.n
        for end in range(max(start, n - 1), len(tokens)):
            self.add(tokens[end], tuple(tokens[end - n + 1:end]))


class OffByOneStart(Pool):
    def add_text(self, tokens, start=0):
        super().add_text(tokens, max(start - 1, 0))


@pytest.mark.parametrize("pool_cls", [EvictsNewest, NoRefresh, KeyIsLastToken, OffByOneStart], ids=lambda c: c.__name__)
def test_a_pool_that_files_differently_fails(pool_cls):
    assert filing_failures(pool_cls) != []


# --------------------------------------------------------------------------- what a decode step files

def filed_against_window(advance_fn=None, seed=0, n_tokens=24):
    """[(what a step filed from its window, what its trace says the window produced)] per
    lookahead step: each sent column's chain (x for column 0, then the column's levels) and the
    argmax of its newest row, keyed by the chain's first token."""
    import torch

    from conftest import tiny_llama
    from engine import lookahead
    from engine.sampling import Random, Sampler

    filed = []

    class Recording(lookahead.Pool):
        def add(self, key, gram):
            filed.append((key, gram))
            super().add(key, gram)

    model = tiny_llama(seed)
    prompt = torch.randint(0, 16, (6,), generator=torch.Generator().manual_seed(seed)).tolist()
    pairs, real_advance, real_pool = [], lookahead.advance, lookahead.Pool
    lookahead.Pool = Recording
    lookahead.advance = advance_fn or real_advance
    try:
        steps = lookahead.decode(model, prompt, sampler=Sampler(), rng=Random(seed), max_new_tokens=n_tokens,
                                 window=3, ngram=3, guesses=8, trace=True)
        emitted = 0
        for step in steps:
            emitted += len(step.tokens)
            if emitted > n_tokens - 1:   # the budget's last step may be cut: not asked of the decoder
                break
            t = step.trace
            got, filed[:] = list(filed), []
            if t["first"] or not t.get("minted"):
                continue
            levels, x = t["levels"], t["x"]
            want = []
            for k, new in enumerate(t["minted"]):
                chain = [x if k == 0 else levels[0][k]] + [level[k] for level in levels[1:]] + [new]
                want.append((chain[0], tuple(chain[1:])))
            pairs.append((got[:len(want)], want))
    finally:
        lookahead.Pool, lookahead.advance = real_pool, real_advance
    return pairs


def test_a_step_files_each_window_column_under_its_first_token():
    # Why: verification is exact whatever the pool holds, so a window n-gram filed under the
    # wrong first token changes no token and no law; only the guesses it feeds go wrong. After
    # each step the pool must hold what the window produced: each column's chain and newest
    # prediction, keyed by the chain's first token (x for column 0)
    for seed in range(3):
        pairs = filed_against_window(seed=seed)
        assert len(pairs) >= 5 and all(got == want for got, want in pairs), pairs


def test_the_filing_contract_catches_a_window_gram_under_the_wrong_key():
    # broken variants: column 0 keyed by the window's dead slot, not x; every gram keyed by its
    # second token
    from engine.lookahead import Pool

    def dead_slot(pool: Pool, levels, x, new):
        for k in range(len(new)):
            chain = [levels[0][k]] + [level[k] for level in levels[1:]] + [new[k]]
            pool.add(chain[0], tuple(chain[1:]))
        return levels[1:] + [new]

    def second_token(pool: Pool, levels, x, new):
        for k in range(len(new)):
            chain = [x if k == 0 else levels[0][k]] + [level[k] for level in levels[1:]] + [new[k]]
            pool.add(chain[1], tuple(chain[1:]))
        return levels[1:] + [new]

    for broken in (dead_slot, second_token):
        assert any(got != want for got, want in filed_against_window(broken)), broken.__name__
