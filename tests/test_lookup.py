"""Prompt lookup decoding, the worked "adding a decoder" example: its tokens are plain decoding's,
greedy or sampled with the same seed, whatever it copies; and the tests can tell a broken one.
(Its exact law is proven by enumeration in test_proofs.py.)"""
import pytest
import torch
from hypothesis import Phase, given, settings, strategies as st

from conftest import prompt_for, run, tiny_llama
from engine import lookup
from engine.generate import Stats, plain
from engine.kvcache import KVCache
from engine.sampling import Random, Sampler, verify_match

GREEDY = Sampler()


# --------------------------------------------------------------------------- exactness

GREEDY_CASES = dict(seed=st.integers(0, 2**16), V=st.integers(3, 8), P=st.integers(1, 10),
                    n=st.integers(1, 30), N=st.integers(1, 4), K=st.integers(0, 8),
                    eos=st.one_of(st.none(), st.integers(0, 7)))


@given(**GREEDY_CASES)
def test_lookup_greedy_equals_plain_greedy(seed, V, P, n, N, K, eos):
    # Why: a copied guess only saves forwards; the greedy text must be plain's, token for token,
    # including where an EOS or the budget cuts a multi-token step. A small vocab makes matches.
    model, prompt = tiny_llama(seed % 5, vocab=V), prompt_for(seed, P, V)
    eos = () if eos is None else (eos % V,)
    want = run(plain, model, prompt, n, eos=eos)
    assert run(lookup.decode, model, prompt, n, eos=eos, lookup_ngram=N, lookup_tokens=K) == want


@given(seed=st.integers(0, 2**16), V=st.integers(3, 8), P=st.integers(1, 8), n=st.integers(1, 24),
       temperature=st.sampled_from([0.3, 0.7, 1.0, 1.6]), top_k=st.integers(0, 8),
       top_p=st.sampled_from([1.0, 0.9, 0.6]), K=st.integers(1, 6))
def test_lookup_sampling_is_seed_identical_to_plain(seed, V, P, n, temperature, top_k, top_p, K):
    # Why: verify_match draws position t with plain's key ("token", t) and keeps a copied token
    # only if it is that draw, so the same seed must print the same text as plain sampling.
    model, prompt = tiny_llama(seed % 5, vocab=V), prompt_for(seed, P, V)
    sampler = Sampler(temperature, top_k, top_p)
    want = run(plain, model, prompt, n, sampler=sampler, seed=seed)
    assert run(lookup.decode, model, prompt, n, sampler=sampler, seed=seed, lookup_tokens=K) == want


@given(seed=st.integers(0, 2**16), V=st.integers(3, 8), P=st.integers(1, 10), n=st.integers(1, 30),
       slope=st.floats(0.0, 0.5), temperature=st.sampled_from([0.0, 0.7, 1.3]))
def test_adaptive_lookup_is_plain_decoding_whatever_it_prices(seed, V, P, n, slope, temperature):
    # Why: `adaptive` cuts each copy to the length its prices say pays, down to none (a plain
    # step); drawn price lists force many schedules, and every one must print plain's tokens,
    # greedy or sampled with the same seed.
    model, prompt = tiny_llama(seed % 5, vocab=V), prompt_for(seed, P, V)
    sampler = Sampler(temperature)
    want = run(plain, model, prompt, n, sampler=sampler, seed=seed)
    table = {1: 1.0, 64: 1.0 + 63 * slope}
    assert run(lookup.decode, model, prompt, n, sampler=sampler, seed=seed, adaptive=True, cost_table=table) == want


@pytest.mark.parametrize("sampler", [GREEDY, Sampler(0.7)])
def test_copied_tokens_really_get_accepted_on_the_tiny_model(sampler):
    # Why: the equality tests are vacuous if no copy is ever accepted: show multi-token steps
    # and fewer forwards than tokens on tiny models that fall into loops.
    stats = Stats()
    for seed in range(3):
        model, prompt = tiny_llama(seed, vocab=4), prompt_for(seed, 8, 4)
        run(lookup.decode, model, prompt, 40, sampler=sampler, seed=seed, stats=stats)
    assert stats.accepted > 0 and max(stats.step_lengths) > 2
    assert stats.tokens_per_forward > 1.3


def test_steps_never_overshoot_the_budget():
    # Why: a guess is cut to the tokens the budget can still use, so the cache (prompt +
    # budget + K slots) never overflows and no forward checks tokens nobody reads.
    model, prompt = tiny_llama(1, vocab=4), prompt_for(1, 8, 4)
    for budget in range(1, 12):
        steps, emitted = lookup.decode(model, prompt, sampler=GREEDY, rng=Random(0), max_new_tokens=budget), 0
        while emitted < budget:
            emitted += len(next(steps).tokens)
        assert emitted == budget


# --------------------------------------------------------------------------- the match

@pytest.mark.parametrize("text,N,K,want", [
    ([5, 6, 7, 9, 5, 6], 2, 3, ([7, 9, 5], 2, 0)),          # the docstring's example
    ([1, 2, 3, 1, 2, 4, 1, 2], 2, 1, ([4], 2, 3)),          # the latest occurrence wins
    ([1, 2, 3, 9, 2, 3, 1, 2, 3], 3, 2, ([9, 2], 3, 0)),    # the longest n wins over a later n=2
    ([4, 5, 6], 3, 4, ([], 0, -1)),                          # nothing repeats
    ([7], 3, 4, ([], 0, -1)),                                # a one-token text
    ([7, 7], 3, 0, ([], 1, 0)),                              # K = 0 proposes nothing
])
def test_find_takes_the_latest_match_of_the_longest_suffix(text, N, K, want):
    assert lookup.find(text, N, K) == want


def test_bad_knobs_are_an_error_before_the_first_token():
    with pytest.raises(ValueError, match="lookup_ngram"):
        next(lookup.decode(tiny_llama(0), [1], sampler=GREEDY, rng=Random(0), max_new_tokens=4, lookup_ngram=0))
    with pytest.raises(ValueError, match="prompt"):
        next(lookup.decode(tiny_llama(0), [], sampler=GREEDY, rng=Random(0), max_new_tokens=4))


# --------------------------------------------------------------------------- teeth

def sabotaged_greedy_test():
    # the property test's body without shrinking or the example database: fails fast, no trace
    inner = test_lookup_greedy_equals_plain_greedy.hypothesis.inner_test
    quick = settings(max_examples=60, phases=[Phase.generate], database=None, deadline=None, derandomize=True)
    return quick(given(**GREEDY_CASES)(inner))


def test_property_test_catches_unchecked_copies(monkeypatch):
    # Why: a decoder that emits its copy without checking it must fail the equality test.
    def blind(first, rows, candidates, sampler, rng, position):
        if not candidates.numel():
            return verify_match(first, rows, candidates, sampler, rng, position)
        return candidates[0].tolist() + [int(rows[0, -1].argmax())], 0
    monkeypatch.setattr(lookup, "verify_match", blind)
    with pytest.raises(AssertionError):
        sabotaged_greedy_test()()


def test_property_test_catches_a_cache_that_keeps_rejected_rows(monkeypatch):
    # Why: truncating one slot too late leaves a rejected copy's K/V where the target's own
    # token belongs; every later token attends to it (or, with nothing left to feed, it crashes).
    truncate = KVCache.truncate
    monkeypatch.setattr(KVCache, "truncate", lambda self, n: truncate(self, min(n + 1, self.length)))
    with pytest.raises((AssertionError, RuntimeError)):
        sabotaged_greedy_test()()


# --------------------------------------------------------------------------- the priced copy

def recount(text: list[int], starts: list[int], ngram: int = 4, most: int = 8):
    """Brute force over the finished text: each step's proposal, scored by the tokens after it."""
    checked, agreed = {}, {}
    for at in starts:
        full, n, _ = lookup.find(text[:at], ngram, most)
        after = text[at:at + len(full)]
        j = 0
        while j < len(after) and full[j] == after[j]:
            j += 1
        if j < len(after) or j == len(full):            # a mismatch, or every token agreed
            for i in range(min(j + 1, len(full))):
                checked[n, i] = checked.get((n, i), 0) + 1
                agreed[n, i] = agreed.get((n, i), 0) + (i < j)
    return checked, agreed


@given(text=st.lists(st.integers(0, 3), min_size=3, max_size=80),
       sizes=st.lists(st.integers(1, 9), min_size=1, max_size=80))
def test_priced_copy_scores_every_proposal_by_the_text_that_followed(text, sizes):
    # Why: the copy arm's prices are learned from shadow checks: every proposal, sent or not,
    # counts as far as the text after it agreed, once that is decided. Fed in steps of any
    # size, the counts must be a recount over the finished text, never a guess about the rest.
    priced, starts, at = lookup.Priced(lambda k: 1.0), [], 2
    for size in sizes:
        if at >= len(text):
            break
        priced.guess(text[:at])
        starts.append(at)
        at += size
    priced.learn(text)
    assert (priced.checked, priced.agreed) == recount(text, starts)


def test_priced_copy_test_catches_scoring_a_proposal_before_it_is_decided(monkeypatch):
    # Why: a proposal that agrees with a short step so far is not yet a miss; scoring it then
    # (as if the step's end were a mismatch) biases every price down.
    def hasty(self, text):
        for at, n, full in self.pending:
            after = text[at:at + len(full)]
            j = next((i for i, (a, b) in enumerate(zip(full, after)) if a != b), len(after))
            for i in range(min(j + 1, len(full))):
                self.checked[n, i] = self.checked.get((n, i), 0) + 1
                self.agreed[n, i] = self.agreed.get((n, i), 0) + (i < j)
        self.pending = []
    monkeypatch.setattr(lookup.Priced, "learn", hasty)
    inner = test_priced_copy_scores_every_proposal_by_the_text_that_followed.hypothesis.inner_test
    quick = settings(max_examples=60, phases=[Phase.generate], database=None, deadline=None, derandomize=True)
    with pytest.raises(AssertionError):
        quick(given(text=st.lists(st.integers(0, 3), min_size=3, max_size=80),
                    sizes=st.lists(st.integers(1, 9), min_size=1, max_size=80))(inner))()


def priced_guesses(text: list[int], cost, step: int = 1) -> list[list[int]]:
    priced = lookup.Priced(cost)
    return [priced.guess(text[:at])[0] for at in range(4, len(text), step)]


def test_priced_copy_guesses_long_where_the_text_repeats():
    # Why: where copies keep agreeing, a long guess's extra rows buy tokens: even at a steep
    # price per row (0.5 of a forward) the copy arm learns to send all 8 tokens.
    phrase = [0, 1, 2, 3, 4, 5, 6, 7, 8, 9]
    got = priced_guesses(phrase * 6, lambda k: 1 + 0.5 * (k - 1))
    assert all(len(g) == 8 for g in got[-20:])


def test_priced_copy_declines_where_copies_fail():
    # Why: "never lose": where copies rarely agree (random tokens: 1 in 8), a guessed row at
    # 0.3 of a forward costs more than it buys. The prior (1 in 2) guesses at first; what the
    # text teaches stops it. On a flat price list (a GPU) the same chances are worth a guess.
    text = torch.randint(0, 8, (300,), generator=torch.Generator().manual_seed(0)).tolist()
    steep = priced_guesses(text, lambda k: 1 + 0.3 * (k - 1))
    assert any(steep[:20]) and sum(map(bool, steep[-150:])) <= 3
    flat = priced_guesses(text, lambda k: 1.0)
    assert all(flat[-150:])


def test_priced_copy_tests_catch_a_copy_arm_that_never_learns(monkeypatch):
    # Why: priced on its prior alone (1 in 2 at every position) the copy arm would guess where
    # copies fail and stay short where they agree; both tests above must say so.
    monkeypatch.setattr(lookup.Priced, "learn", lambda self, text: None)
    with pytest.raises(AssertionError):
        test_priced_copy_guesses_long_where_the_text_repeats()
    with pytest.raises(AssertionError):
        test_priced_copy_declines_where_copies_fail()
