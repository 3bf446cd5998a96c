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
