"""Lookahead decoding's contract: whatever the window, pool and trimming do, the tokens are
plain decoding's, greedy or sampled with the same seed; and the tests can tell a broken one."""
import functools
import re

import pytest
import torch
from hypothesis import Phase, given, settings, strategies as st

from conftest import prompt_for, run, tiny_llama
from engine import lookahead
from engine.adapt import policy
from engine.generate import Stats, generate, plain
from engine.kvcache import KVCache
from engine.sampling import Random, Sampler, verify_match

GREEDY = Sampler()


# --------------------------------------------------------------------------- exactness

GREEDY_CASES = dict(seed=st.integers(0, 2**16), V=st.integers(4, 8), P=st.integers(1, 8),
                    n=st.integers(1, 30), W=st.integers(1, 6), N=st.integers(2, 5),
                    G=st.integers(0, 6), eos=st.one_of(st.none(), st.integers(0, 7)))


@given(**GREEDY_CASES)
def test_lookahead_greedy_equals_plain_greedy(seed, V, P, n, W, N, G, eos):
    # Why: lookahead only reorganises work; greedy output must be token-identical, including
    # where an EOS or the budget cuts a multi-token step. A small vocab makes n-grams repeat.
    model, prompt = tiny_llama(seed % 5, vocab=V), prompt_for(seed, P, V)
    eos = () if eos is None else (eos % V,)
    want = run(plain, model, prompt, n, eos=eos)
    got = run(lookahead.decode, model, prompt, n, eos=eos, window=W, ngram=N, guesses=G)
    assert got == want


CORNERS = [(1, 2, 0), (1, 2, 4), (4, 2, 0), (1, 5, 6), (6, 5, 0), (3, 3, 2)]


@pytest.mark.parametrize("W, N, G", CORNERS)
def test_corner_shapes_equal_plain_greedy(W, N, G):
    # Why: W=1, N=2 (pure Jacobi), G=0 (no guesses) and a one-token prompt are the edges of
    # every index computation in the layout.
    for seed in range(3):
        model = tiny_llama(seed, vocab=6)
        for prompt in ([seed], prompt_for(seed, 5, 6)):
            want = run(plain, model, prompt, 24)
            assert run(lookahead.decode, model, prompt, 24, window=W, ngram=N, guesses=G) == want


@given(seed=st.integers(0, 2**16), V=st.integers(4, 8), P=st.integers(1, 6), n=st.integers(1, 24),
       temperature=st.sampled_from([0.3, 0.7, 1.0, 1.6]), top_k=st.integers(0, 8),
       top_p=st.sampled_from([1.0, 0.9, 0.6]), N=st.integers(2, 5))
def test_lookahead_sampling_is_seed_identical_to_plain(seed, V, P, n, temperature, top_k, top_p, N):
    # Why: verify_match draws position t with the key plain sampling uses, so the same seed
    # must give the same text: the output law is plain sampling's, not just close to it.
    model, prompt = tiny_llama(seed % 5, vocab=V), prompt_for(seed, P, V)
    sampler = Sampler(temperature, top_k, top_p)
    want = run(plain, model, prompt, n, sampler=sampler, seed=seed)
    assert run(lookahead.decode, model, prompt, n, sampler=sampler, seed=seed, ngram=N) == want


@pytest.mark.parametrize("trim", [1, 2])
def test_trimmed_window_layers_keep_greedy_output(trim):
    # Why: trimming freezes the window's older levels in the last layers; guess rows never see
    # the window and prompt rows are trimmed at most one layer, so the text cannot change.
    for seed in range(4):
        model, prompt = tiny_llama(seed, vocab=6, n_layers=3), prompt_for(seed, 4, 6)
        want = run(plain, model, prompt, 30)
        assert run(lookahead.decode, model, prompt, 30, trim_layers=trim) == want


def fresh_token_mid_step(model, prompt, budget=40):
    """(eos, cut): the first token that a multi-token step emits new to the text, mid-step."""
    text = []
    for step in lookahead.decode(model, prompt, sampler=GREEDY, rng=Random(0), max_new_tokens=budget, window=3):
        fresh = [j for j, t in enumerate(step.tokens) if j > 0 and t not in text + step.tokens[:j]]
        if fresh:
            return step.tokens[fresh[0]], len(text) + fresh[0] + 1
        text += step.tokens
        if len(text) >= budget:
            return None


def test_eos_inside_an_accepted_block_stops_like_plain():
    # Why: generate() must cut a multi-token step right after the EOS, not at the step's end.
    cases = ((tiny_llama(s, vocab=6), prompt_for(s, 4, 6)) for s in range(10))
    model, prompt, (eos, cut) = next((m, p, f) for m, p in cases if (f := fresh_token_mid_step(m, p)))
    want = run(plain, model, prompt, 40, eos=(eos,))
    assert len(want) == cut and want[-1] == eos
    assert run(functools.partial(lookahead.decode, window=3), model, prompt, 40, eos=(eos,)) == want


def test_budget_ending_inside_a_step_equals_plain():
    # Why: the last step usually overshoots max_new_tokens; the cut must fall mid-step cleanly.
    model, prompt = tiny_llama(2, vocab=6), prompt_for(2, 4, 6)
    bounds, total = set(), 0
    la = functools.partial(lookahead.decode, window=3)
    for step in la(model, prompt, sampler=GREEDY, rng=Random(0), max_new_tokens=20):
        total += len(step.tokens)
        bounds.add(total)
        if total >= 20:
            break
    assert set(range(1, 20)) - bounds, "every budget fell on a step boundary"
    for n in range(1, 20):
        assert run(la, model, prompt, n) == run(plain, model, prompt, n)


@pytest.mark.parametrize("sampler", [GREEDY, Sampler(0.7)])
def test_guesses_really_get_accepted_on_the_tiny_model(sampler):
    # Why: the equality tests are vacuous if no guess is ever accepted; show multi-token steps,
    # full matches (N tokens: N-1 guesses plus the bonus) and fewer forwards than tokens.
    stats = Stats()
    for seed in range(3):
        model, prompt = tiny_llama(seed, vocab=6), prompt_for(seed, 5, 6)
        run(lookahead.decode, model, prompt, 40, sampler=sampler, seed=seed, stats=stats,
            window=5, ngram=4, guesses=5)
    assert stats.accepted > 0 and max(stats.step_lengths) == 4
    assert stats.tokens_per_forward > 1.5


def test_copy_arm_is_taken_and_its_guesses_accepted_on_the_tiny_model():
    # Why: the automatic choice's equality tests are vacuous for the copy arm unless it runs
    # and its guesses pass: on a flat price list it copies, and some copies emit 3+ tokens.
    copied = []

    def log(steps):
        for step in steps:
            copied.extend([len(step.tokens)] if step.arm == "copy" else [])
            yield step
    for seed in range(3):
        model, prompt = tiny_llama(seed, vocab=4), prompt_for(seed, 8, 4)
        flat = policy.Lookahead(lambda k: 1.0, 4)
        list(generate(log(lookahead.decode(model, prompt, sampler=GREEDY, rng=Random(0), max_new_tokens=40,
                                           policy=flat)), max_new_tokens=40))
    assert copied and max(copied) >= 3


# --------------------------------------------------------------------------- teeth

def sabotaged_greedy_test():
    # the property test's body, under the same strategies, without shrinking or the example
    # database, so that a sabotaged run fails fast and leaves nothing behind
    inner = test_lookahead_greedy_equals_plain_greedy.hypothesis.inner_test
    # derandomize: the same examples every run, so the sabotage is caught every time, not by luck
    quick = settings(max_examples=60, phases=[Phase.generate], database=None, deadline=None, derandomize=True)
    return quick(given(**GREEDY_CASES)(inner))


def test_property_test_catches_unchecked_guesses(monkeypatch):
    # Why: a decoder that takes the first guess without checking it must fail the equality test.
    def blind(first, rows, candidates, sampler, rng, position):
        if not len(candidates):
            return verify_match(first, rows, candidates, sampler, rng, position)
        return candidates[0].tolist() + [int(rows[0, -1].argmax())], 0
    monkeypatch.setattr(lookahead, "verify_match", blind)
    with pytest.raises(AssertionError):
        sabotaged_greedy_test()()


def test_property_test_catches_wrong_cache_slots(monkeypatch):
    # Why: keeping the K/V of the row next to each accepted one (an off-by-one in the slot
    # arithmetic) corrupts every later token. (Their order alone would not: attention is
    # invariant to the order of the keys, RoPE carries the positions.)
    compact = KVCache.compact
    shifted = lambda self, n, slots: compact(self, n, [min(s + 1, self.length - 1) for s in slots])
    monkeypatch.setattr(KVCache, "compact", shifted)
    with pytest.raises(AssertionError):
        sabotaged_greedy_test()()


# --------------------------------------------------------------------------- pieces

def test_tree_mask_is_the_documented_picture():
    # Why: the docstring's picture is the spec of the mask; it must be what the code builds.
    names = "the a1 a2 b0 b1 b2 cat sat dog ran".split()
    ids = {name: i for i, name in enumerate(names)}
    window = [[-1, ids["a1"], ids["a2"]], [ids["b0"], ids["b1"], ids["b2"]]]
    guesses = [(ids["cat"], ids["sat"]), (ids["dog"], ids["ran"])]
    tokens, parent, newest, paths, _ = lookahead.layout(ids["the"], window, guesses)
    lines = [l.split("|") for l in lookahead.tree_mask.__doc__.splitlines() if "|" in l][1:]
    picture = torch.tensor([[c == "x" for c in right.split()] for _, right in lines])
    offset = lambda pos: int(re.fullmatch(r"P\+?(\d*)", pos).group(1) or 0)  # "P+2" -> 2
    positions = [offset(left.split()[1]) for left, _ in lines]
    mask = lookahead.tree_mask(parent)
    assert tokens == list(range(10)) and [left.split()[0] for left, _ in lines] == names
    assert torch.equal(mask, picture)
    assert (mask.sum(1) - 1).tolist() == positions
    assert newest == [3, 4, 5] and paths == [[6, 7], [8, 9]]


def test_guesses_sharing_a_prefix_share_rows():
    # Why: a prefix tree verifies each distinct prefix once; both guesses read the same row.
    tokens, parent, newest, paths, trie = lookahead.layout(9, [[-1, 1], [2, 3]], [(5, 6), (5, 7)])
    assert trie == 4 and paths == [[4, 5], [4, 6]] and parent[4:] == [0, 4, 4] and tokens[4:] == [5, 6, 7]


def test_pool_keeps_the_g_most_recently_seen_grams_per_first_token():
    pool = lookahead.Pool(2, 3)
    pool.add_text([1, 2, 3, 1, 2, 4, 1, 2, 3, 1, 5, 6])
    # key 1 saw (2,3), (2,4), (2,3) again, then (5,6): (2,4) is the least recently seen
    assert pool.guesses(1) == [(5, 6), (2, 3)]
    assert pool.guesses(7) == [] and lookahead.Pool(0, 3).guesses(1) == []


def test_the_window_starts_as_the_prompt_read_diagonally():
    # Why: the first n-grams the window mints start with real text only if column k's chain
    # reads prompt[k:k+N-1] (init_window's docstring); the exactness proofs cannot see a shifted
    # window, only the speed can. Caught broken variant: level l, column k = prompt[l + k + 1]
    assert lookahead.init_window([1, 2, 3, 4, 5], 3, 4) == [[1, 2, 3], [2, 3, 4], [3, 4, 5]]
    assert lookahead.init_window([1, 2], 3, 3) == [[1, 2, 1], [2, 1, 2]]    # a short prompt wraps


def test_the_window_mints_the_argmax_of_each_columns_newest_row():
    # Why: the n-grams the window mints are its whole point, yet tokens stay exact whatever it
    # mints, so only a check of what it minted can see a slip. Each step's "minted" (its trace)
    # must be the argmax of its newest level's rows, recomputed here from a fresh cache of the
    # committed text and the step's tree. Caught broken variant: minting from the next kept row
    model, prompt = tiny_llama(1, vocab=6), prompt_for(1, 6, 6)
    text, checked = list(prompt), 0
    for step in lookahead.decode(model, prompt, sampler=Sampler(), rng=Random(0), max_new_tokens=16,
                                 window=3, ngram=3, guesses=2, trace=True):
        t = step.trace
        if "minted" in t:
            tokens, parent, newest, *_ = lookahead.layout(t["x"], t["levels"], t["grams"])
            cache = KVCache.for_model(model, len(text) + len(tokens))
            model(torch.tensor([text[:-1]]), torch.arange(len(text) - 1), cache)   # all but x
            logits = lookahead.tree_forward(model, cache, tokens, parent, newest, 0)  # (W, V)
            assert logits.argmax(-1).tolist() == t["minted"]
            checked += 1
        text += step.tokens
        if len(text) >= len(prompt) + 16:   # the decoder never ends by itself: generate() does
            break
    assert checked >= 5


def test_window_column_zero_is_keyed_by_the_last_token():
    # Why: column 0's chain starts at x, not at the dead slot of level 0 (llama.cpp's slip).
    pool = lookahead.Pool(4, 3)
    grid = lookahead.advance(pool, [[99, 1], [2, 3]], x=7, new=[4, 5])
    assert pool.guesses(7) == [(2, 4)] and pool.guesses(1) == [(3, 5)] and 99 not in pool.grams
    assert grid == [[2, 3], [4, 5]]


@given(seed=st.integers(0, 2**16), n=st.integers(5, 40), slope=st.floats(0.0, 0.5))
def test_auto_configuration_switches_arms_without_changing_tokens(seed, n, slope):
    # Why: the automatic (W, G) choice moves between plain, lookup and window arms as its
    # prices say; any schedule it picks must leave the greedy output alone. Drawn price lists
    # force many different schedules.
    model, prompt = tiny_llama(seed % 3, vocab=6), prompt_for(seed, 6, 6)
    prices = policy.Lookahead(lambda k: 1.0 + slope * (k - 1), 4)
    got = list(generate(lookahead.decode(model, prompt, sampler=GREEDY, rng=Random(0), max_new_tokens=n,
                                         policy=prices), max_new_tokens=n))
    assert got == run(plain, model, prompt, n)


def test_the_first_candidate_is_what_followed_the_longest_earlier_match():
    # Why: x alone is a weak key ("the" is followed by anything); the last N-1 tokens matched
    # earlier in the text predict better, so prompt lookup's guess goes first, then the pool's.
    text = [5, 6, 7, 9, 1, 2, 8, 7, 3, 4, 5, 6, 7]
    pool = lookahead.Pool(4, 4)
    pool.add_text(text)
    assert pool.guesses(7)[0] == (3, 4, 5)                       # x = 7 alone: its latest n-gram
    got = lookahead.candidates(pool, text, G=3, N=4)
    assert got[0] == (9, 1, 2)                                   # after the earlier 5 6 7
    assert got == [(9, 1, 2), (3, 4, 5)]                         # then the pool, no repeats
    assert lookahead.candidates(pool, text, G=1, N=4) == [(9, 1, 2)]


@given(W=st.integers(0, 6), N=st.integers(2, 5), G=st.integers(0, 6))
def test_step_rows_is_the_most_rows_a_step_lays_out(W, N, G):
    # Why: the refusal of a step wider than the context counts rows with step_rows(); it must be
    # the layout's own count at its widest (every guess its own trie branch), x a window cell
    levels = [[100 + l * W + k for k in range(W)] for l in range(N - 1)] if W else []
    grams = [tuple(200 + g * N + j for j in range(N - 1)) for g in range(G)]
    assert len(lookahead.layout(1, levels, grams)[0]) == lookahead.step_rows(W, N, G)


def test_a_step_as_wide_as_the_context_runs_and_a_wider_one_is_refused():
    # fixed examples at the boundary (context 2048): W=2048 N=2 lays out 2048 rows; one more is refused
    model = tiny_llama(0)
    assert model.config.max_seq_len == 2048
    for W, G, fits in [(2048, 0, True), (2049, 0, False), (0, 2047, True), (0, 2048, False)]:
        steps = lookahead.decode(model, [1, 2], sampler=GREEDY, rng=None, max_new_tokens=1, window=W,
                                 ngram=2, guesses=G)
        if fits:
            next(steps)
        else:
            with pytest.raises(ValueError, match="rows exceeds the model's context"):
                next(steps)
