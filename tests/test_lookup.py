"""Prompt lookup decoding, the worked "adding a decoder" example: its tokens are plain decoding's,
greedy or sampled with the same seed, whatever it copies; and the tests can tell a broken one.
(Its exact law is proven by enumeration in test_proofs.py.)"""
import pytest
import torch
from hypothesis import Phase, given, settings, strategies as st

from conftest import prompt_for, run, tiny_llama
from engine import lookup
from engine.adapt import policy
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
    # Why: a policy cuts each copy to the length its prices say pays, down to none (a plain
    # step); drawn price lists force many schedules, and every one must print plain's tokens,
    # greedy or sampled with the same seed.
    model, prompt = tiny_llama(seed % 5, vocab=V), prompt_for(seed, P, V)
    sampler = Sampler(temperature)
    want = run(plain, model, prompt, n, sampler=sampler, seed=seed)
    priced = policy.CopyLength(lambda k: 1.0 + slope * (k - 1))
    assert run(lookup.decode, model, prompt, n, sampler=sampler, seed=seed, policy=priced) == want


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


def scan(text, ngram, k):
    """find()'s definition, read literally: n from ngram down, the latest i whose n tokens are
    text's last n and end before them."""
    for n in range(min(ngram, len(text) - 1), 0, -1):
        for i in range(len(text) - n - 1, -1, -1):
            if text[i:i + n] == text[-n:]:
                return text[i + n:i + n + k], n, i
    return [], 0, -1


@settings(max_examples=400, deadline=None)
@given(st.lists(st.integers(0, 3), max_size=40), st.integers(0, 5), st.integers(0, 9))
def test_find_is_its_definition_on_any_text(text, N, K):
    # Why: find() runs one pass over the earlier copies of the last token, not the definition's
    # scan per n; a small alphabet makes long, repeated and overlapping matches common.
    # Caught broken variant: growing the match from the earliest copy first (ties go to the
    # earliest occurrence) fails here; so does stopping at the first copy found.
    assert lookup.find(text, N, K) == scan(text, N, K)


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


