"""Proofs that the sampling core keeps the law it claims.

Exact, not statistical: `exact_law.decoder_law` walks every branch of a decoder's random
choices and sums their probabilities, and we compare that law with the product of the
plain sampler's conditionals, to 1e-12. The verification primitives are proven on toy
table LMs (any next-token law, cheap); the real decoders join in test_proofs.py.
"""
import functools
import math

import pytest
import torch
from hypothesis import given, strategies as st

from engine.generate import Step
from engine.sampling import Random, Sampler, icdf, verify_match, verify_rejection
from exact_law import Enumerator, decoder_law, max_gap, reference_law

TOL = 1e-12


# --------------------------------------------------------------------------- Sampler.probs

def logits_for(seed, V=8, scale=2.0):
    return torch.randn(V, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * scale


@given(seed=st.integers(0, 2**16), t=st.floats(0.05, 5.0))
def test_temperature_is_softmax_of_scaled_logits(seed, t):
    x = logits_for(seed)
    want = torch.exp(x / t) / torch.exp(x / t).sum()
    torch.testing.assert_close(Sampler(temperature=t).probs(x), want, atol=1e-14, rtol=0)


@given(seed=st.integers(0, 2**16), k=st.integers(1, 8))
def test_top_k_keeps_the_k_largest_renormalised(seed, k):
    x = logits_for(seed)
    p = Sampler(temperature=1.0, top_k=k).probs(x)
    top = set(x.topk(k).indices.tolist())
    assert set(p.nonzero().flatten().tolist()) == top
    full = torch.softmax(x, -1)
    for i in top:
        assert math.isclose(p[i], full[i] / full[list(top)].sum(), rel_tol=1e-12)


@given(seed=st.integers(0, 2**16), top_p=st.floats(0.01, 1.0))
def test_top_p_keeps_the_smallest_prefix_reaching_p(seed, top_p):
    # Why: nucleus sampling (Holtzman et al. 2019) keeps the most likely tokens until their
    # mass first reaches top_p; written here the slow, obvious way.
    x = logits_for(seed)
    full = torch.softmax(x, -1)
    kept, mass = [], 0.0
    for i in full.argsort(descending=True).tolist():
        kept.append(i)
        mass += float(full[i])
        if mass >= top_p:
            break
    p = Sampler(temperature=1.0, top_p=top_p).probs(x)
    assert set(p.nonzero().flatten().tolist()) == set(kept)
    assert math.isclose(float(p.sum()), 1.0, rel_tol=1e-12)


def test_greedy_is_one_hot_argmax_lowest_id_on_ties():
    p = Sampler().probs(torch.tensor([1.0, 3.0, 3.0, 0.0]))
    assert p.tolist() == [0.0, 1.0, 0.0, 0.0]


@pytest.mark.parametrize("bad", [[float("nan"), 1.0], [float("-inf"), float("-inf")]])
def test_nan_or_all_minus_inf_logits_raise_instead_of_an_out_of_vocab_id(bad):
    with pytest.raises(ValueError, match="NaN or all -inf"):
        Sampler(temperature=1.0).probs(torch.tensor(bad))


@given(st.integers(0, 2**31), st.integers(2, 40), st.sampled_from([0.0, 0.7]), st.integers(0, 3))
def test_draw_is_the_categorical_draw_of_probs(seed, V, t, ties):
    # greedy's shortcut (argmax, no law built) must name the token the inverse CDF names
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(V, generator=g).round(decimals=ties)     # rounding makes ties
    s, rng = Sampler(temperature=t), Random(seed)
    for pos in range(3):
        assert s.draw(logits, rng, "token", pos) == rng.categorical(s.probs(logits), "token", pos)


@pytest.mark.parametrize("bad", [[1.0, float("nan")], [float("nan"), 1.0], [float("-inf"), float("-inf")]])
@pytest.mark.parametrize("t", [0.0, 1.0])
def test_draw_refuses_nan_or_all_minus_inf_logits(bad, t):
    with pytest.raises(ValueError, match="NaN or all -inf"):
        Sampler(temperature=t).draw(torch.tensor(bad), Random(0), "token", 0)


@pytest.mark.parametrize("kw", [{"temperature": -0.1}, {"top_p": 0.0}, {"top_p": 1.5}, {"top_k": -1},
                                {"temperature": float("nan")}])
def test_invalid_settings_raise(kw):
    with pytest.raises(ValueError):
        Sampler(**kw)


# --------------------------------------------------------------------------- Random

@given(seed=st.integers(0, 2**32), pos=st.integers(0, 10**6))
def test_draws_are_fixed_by_seed_stream_and_position(seed, pos):
    # Why: a decoder that samples position t must get the very noise plain sampling gets there.
    a, b = Random(seed), Random(seed)
    assert a.uniform("token", pos) == b.uniform("token", pos)
    assert a.uniform("token", pos) != a.uniform("draft", pos)
    assert a.uniform("token", pos) != a.uniform("token", pos + 1)


@given(seed=st.integers(0, 2**16), zeros=st.lists(st.integers(0, 7), max_size=6), u=st.floats(0, 1, exclude_max=True))
def test_icdf_never_returns_a_token_of_probability_zero(seed, zeros, u):
    p = torch.softmax(logits_for(seed), -1)
    p[zeros] = 0.0
    if p.sum() == 0:
        return
    p = p / p.sum()
    assert p[icdf(p, u)] > 0
    assert p[icdf(p * (1 - 1e-9), u)] > 0      # cdf[-1] < 1 from rounding: still a real token


def test_icdf_past_a_cdf_short_of_one_takes_the_last_token_with_mass():
    # Why: rounding can leave cdf[-1] <= u < 1, and the fallback must then be a token of the law,
    # not the last id. A fixed example, so the catch does not rest on a random u landing past
    # cdf[-1]. Caught broken variant: the fallback returning the last id (here of mass 0)
    p = torch.tensor([0.5, 0.5 * (1 - 1e-9), 0.0], dtype=torch.float64)
    assert icdf(p, 1 - 1e-12) == 1


def test_a_draft_of_target_probability_zero_is_never_accepted_even_at_u_0():
    # Why: u is uniform on [0, 1), so u = 0 can come (2^-53 a draw): accept iff u < p/q must then
    # still reject a draft the target gives probability 0. A fixed u, since no random draw reaches it.
    # Caught broken variant: accept iff u <= p/q
    class Zero(Random):
        def uniform(self, stream, position):
            return 0.0
    p = torch.tensor([[1.0, 0.0], [1.0, 0.0]], dtype=torch.float64)
    q = torch.tensor([[0.5, 0.5]], dtype=torch.float64)
    assert verify_rejection(p, q, [1], Zero(), 0) == [0]


def test_categorical_sampler_passes_a_chi_square_test():
    # Why: the exact-law proofs assume u is uniform; this checks the real source is.
    # N = 40,000 draws from a fixed p over 8 tokens, one fresh key each. Critical value for
    # df = 7 at alpha = 1e-4 is 29.9. Power: a shift of 0.02 of mass between two tokens of
    # p = 0.125 gives noncentrality N * sum(d^2 / p) = 40000 * 2 * 0.02^2 / 0.125 = 256, which
    # this test detects with probability ~1; the smallest shift detected with probability 0.9
    # is about 0.0065 (noncentrality ~27 above df).
    p = torch.full((8,), 1 / 8, dtype=torch.float64)
    rng, N = Random(1234), 40_000
    counts = torch.zeros(8)
    for i in range(N):
        counts[rng.categorical(p, "token", i)] += 1
    chi2 = float(((counts - N / 8) ** 2 / (N / 8)).sum())
    assert chi2 < 29.9, chi2


def test_enumerator_law_of_a_single_draw_is_the_probs():
    p = torch.tensor([0.5, 0.0, 0.2, 0.3], dtype=torch.float64)

    def one(rng):
        while True:
            yield Step([rng.categorical(p, "token", 0)])
    law = decoder_law(one, 1)
    assert max_gap(law, {(0,): 0.5, (2,): 0.2, (3,): 0.3}) < TOL


def test_enumerator_sees_a_reused_key_as_the_same_noise():
    # Why: the harness must be able to catch noise reuse, so a repeated key must not be
    # treated as a fresh draw: both draws below see the same u, so they always agree.
    p = torch.tensor([0.25, 0.25, 0.5], dtype=torch.float64)

    def twice(rng):
        yield Step([rng.categorical(p, "token", 0), rng.categorical(p, "token", 0)])
    law = decoder_law(twice, 2)
    assert max_gap(law, {(0, 0): 0.25, (1, 1): 0.25, (2, 2): 0.5}) < TOL


# --------------------------------------------------------------------------- toy LMs

V, TARGET, DRAFT = 3, 11, 22


@functools.lru_cache(maxsize=None)
def table_logits(lm: int, prefix: tuple) -> torch.Tensor:
    """A toy LM: seeded random logits for every prefix (deterministic, any law)."""
    g = torch.Generator().manual_seed(hash((lm,) + prefix) % 2**31)
    return torch.randn(V, generator=g, dtype=torch.float64) * 1.5


def toy_speculative(prompt, sampler, rng, K, verify=verify_rejection, q_sampler=None):
    """Chain speculative sampling over toy LMs; `verify` and `q_sampler` let tests break it."""
    seq, q_sampler = list(prompt), q_sampler or sampler
    while True:
        n, drafts, qs = len(seq), [], []
        for i in range(K):
            q = sampler.probs(table_logits(DRAFT, tuple(seq + drafts)))
            drafts.append(rng.categorical(q, "draft", n + i))
            qs.append(q_sampler.probs(table_logits(DRAFT, tuple(seq + drafts[:-1]))))
        ps = [sampler.probs(table_logits(TARGET, tuple(seq + drafts[:i]))) for i in range(K + 1)]
        out = verify(torch.stack(ps), torch.stack(qs), drafts, rng, n)
        seq += out
        yield Step(out, drafted=K, accepted=len(out) - 1)


def toy_match(prompt, sampler, rng, G, n):
    """Several deterministic candidates of n tokens per step (lookahead's verification)."""
    seq = list(prompt)
    while True:
        cands = torch.tensor([[(len(seq) * 7 + g * 3 + j) % V for j in range(n)] for g in range(G)])
        cands = cands.reshape(G, n)
        first = table_logits(TARGET, tuple(seq))
        rows = torch.stack([torch.stack([table_logits(TARGET, tuple(seq) + tuple(c[:j + 1].tolist()))
                                         for j in range(n)]) for c in cands]) if G else torch.zeros(0, n, V)
        out, _ = verify_match(first, rows, cands, sampler, rng, len(seq))
        seq += out
        yield Step(out)


def target_law(prompt, sampler, n, eos_ids=()):
    return reference_law(lambda pre: sampler.probs(table_logits(TARGET, tuple(prompt) + pre)), n, eos_ids)


SAMPLERS = [Sampler(temperature=1.0), Sampler(temperature=0.6), Sampler(temperature=1.3, top_k=2),
            Sampler(temperature=0.8, top_p=0.7), Sampler(temperature=0.0)]


# (K, budget, sampler): the path count grows like V^K per step, so large K uses top-k/top-p
SPEC_CASES = ([(1, 4, s) for s in SAMPLERS] + [(2, 3, s) for s in SAMPLERS]
              + [(K, 3, s) for K in (3, 4) for s in (Sampler(1.0, top_k=2), Sampler(0.6, top_p=0.8),
                                                     Sampler(0.0))])


@pytest.mark.parametrize("K,n,sampler", SPEC_CASES, ids=repr)
def test_rejection_sampling_keeps_the_target_law(K, n, sampler):
    # Why: chain speculative sampling must emit exactly p, jointly over several positions, with
    # the bonus token (K + 1 < budget) and the budget ending inside a step (K + 1 > budget).
    prompt = [1, 2]
    law = decoder_law(lambda rng: toy_speculative(prompt, sampler, rng, K), n)
    assert max_gap(law, target_law(prompt, sampler, n)) < TOL


@pytest.mark.parametrize("K,n,sampler", [(2, 4, Sampler(1.0)), (3, 3, Sampler(1.0, top_k=2))], ids=repr)
def test_rejection_sampling_keeps_the_target_law_with_eos_inside_drafts(K, n, sampler):
    prompt, eos = [0], {2}
    law = decoder_law(lambda rng: toy_speculative(prompt, sampler, rng, K), n, eos)
    assert max_gap(law, target_law(prompt, sampler, n, eos)) < TOL


@pytest.mark.parametrize("sampler", SAMPLERS, ids=repr)
@pytest.mark.parametrize("G,n", [(0, 2), (1, 2), (3, 2), (4, 3)])
def test_match_verification_keeps_the_target_law(sampler, G, n):
    prompt, budget = [1], 4
    law = decoder_law(lambda rng: toy_match(prompt, sampler, rng, G, n), budget)
    assert max_gap(law, target_law(prompt, sampler, budget)) < TOL


# --------------------------------------------------------------------------- mutations

def always_accept(p, q, drafts, rng, position):
    return list(drafts) + [rng.categorical(p[len(drafts)], "token", position + len(drafts))]


def mutant(residual=None, stream="residual", bonus_row=None):
    """verify_rejection with one piece swapped for a classic bug."""
    def verify(p, q, drafts, rng, position):
        out = []
        for i, x in enumerate(drafts):
            if rng.bernoulli(min(1.0, float(p[i, x] / q[i, x])), "accept", position + i):
                out.append(x)
                continue
            r = residual(p[i], q[i]) if residual else (p[i] - q[i]).clamp(min=0) / (p[i] - q[i]).clamp(min=0).sum()
            out.append(rng.categorical(r, stream, position + i))
            return out
        row = len(drafts) if bonus_row is None else bonus_row(len(drafts))
        out.append(rng.categorical(p[row], "token", position + len(drafts)))
        return out
    return verify


MUTANTS = {
    "always accept": (always_accept, None),
    "residual = p": (mutant(residual=lambda p, q: p), None),
    "residual not normalised": (mutant(residual=lambda p, q: (p - q).clamp(min=0)), None),
    "draft noise reused for the residual": (mutant(stream="draft"), None),
    "bonus from p_K-1 (the last draft's row) instead of p_K": (mutant(bonus_row=lambda K: K - 1), None),
    "q without the temperature applied to p": (verify_rejection, Sampler(temperature=1.0)),
    "top-k applied to p only (q is not the draft's law)": (verify_rejection, Sampler(temperature=0.7)),
}


@pytest.mark.parametrize("name", MUTANTS)
def test_every_classic_bug_breaks_the_law(name):
    # Why: a proof harness that cannot fail proves nothing. Each variant is a bug seen in the
    # wild (anchors, section 5); the same comparison that passes above must fail here.
    verify, q_sampler = MUTANTS[name]
    sampler = Sampler(temperature=0.7, top_k=2) if "top-k" in name else Sampler(temperature=0.7)
    prompt, n, K = [1, 2], 3, 2
    law = decoder_law(lambda rng: toy_speculative(prompt, sampler, rng, K, verify, q_sampler), n)
    assert max_gap(law, target_law(prompt, sampler, n)) > 1e-4


def test_the_unmutated_verifier_passes_the_mutation_setting():
    sampler, prompt, n, K = Sampler(temperature=0.7, top_k=2), [1, 2], 3, 2
    law = decoder_law(lambda rng: toy_speculative(prompt, sampler, rng, K), n)
    assert max_gap(law, target_law(prompt, sampler, n)) < TOL


def test_rejection_refuses_a_draft_with_q_zero():
    p, q = torch.tensor([[0.5, 0.5], [0.5, 0.5]], dtype=torch.float64), torch.tensor([[1.0, 0.0]], dtype=torch.float64)
    with pytest.raises(ValueError, match="q = 0"):
        verify_rejection(p, q, [1], Random(0), 0)


# --------------------------------------------------------------------------- input checks

P2 = torch.tensor([[.1, .1, .1, .7], [.25] * 4], dtype=torch.float64)
Q1 = torch.tensor([[.25] * 4], dtype=torch.float64)


@pytest.mark.parametrize("draft", [-1, 4, 10**9, 1.0, True])
def test_rejection_refuses_draft_ids_outside_the_vocabulary(draft):
    # Why: -1 (vLLM's padding id) used to index token V-1, be accepted and come back as an
    # output token, in 1000 of 1000 seeds; an id >= V was an IndexError, not our own error.
    with pytest.raises(ValueError, match=r"token ids in \[0, 4\)"):
        verify_rejection(P2, Q1, [draft], Random(0), 0)


@pytest.mark.parametrize("p,q,drafts", [(P2, Q1, []), (P2, Q1, [0, 1]), (P2[:1], Q1, [0]),
                                        (P2, Q1[:, :3], [0]), (P2[0], Q1, [0])], ids=range(5))
def test_rejection_refuses_shapes_that_disagree(p, q, drafts):
    with pytest.raises(ValueError, match="must be"):
        verify_rejection(p, q, drafts, Random(0), 0)


BAD_ROWS = {"nan": [float("nan"), .5, .25, .25], "inf": [float("inf"), 0, 0, 0],
            "negative": [-.1, .6, .25, .25], "sums to 1.1": [.35, .25, .25, .25],
            "sums to 1 - 2e-6": [.25 - 2e-6, .25, .25, .25]}


@pytest.mark.parametrize("which", ["p", "q"])
@pytest.mark.parametrize("bad", BAD_ROWS, ids=BAD_ROWS.keys())
def test_rejection_refuses_rows_that_are_not_laws(bad, which):
    row = torch.tensor([BAD_ROWS[bad]], dtype=torch.float64)
    p, q = (torch.cat([row, P2[1:]]), Q1) if which == "p" else (P2, row)
    with pytest.raises(ValueError, match="sum to 1"):
        verify_rejection(p, q, [1], Random(0), 0)


def test_rejection_accepts_rows_within_the_stated_tolerance():
    # Why: the check must not refuse what Sampler.probs produces (renormalised top-p rows
    # sum to 1 only to rounding); PROB_TOL = 1e-6 is far above float64 rounding.
    q = torch.tensor([[.25 + 4e-7, .25, .25, .25]], dtype=torch.float64)
    assert len(verify_rejection(P2, q, [1], Random(0), 0)) in (1, 2)


@pytest.mark.parametrize("cands,rows", [
    (torch.tensor([[-1, 0]]), torch.zeros(1, 2, 4)), (torch.tensor([[0, 4]]), torch.zeros(1, 2, 4)),
    (torch.tensor([[0.0, 1.0]]), torch.zeros(1, 2, 4)), (torch.tensor([[0, 1]]), torch.zeros(1, 3, 4)),
    (torch.tensor([0, 1]), torch.zeros(2, 4)), (torch.tensor([[0, 1]]), torch.zeros(1, 2, 5))], ids=range(6))
def test_match_refuses_bad_candidates_or_shapes(cands, rows):
    with pytest.raises(ValueError, match="verify_match needs|token ids"):
        verify_match(torch.zeros(4), rows, cands, Sampler(1.0), Random(0), 0)


def test_match_accepts_no_candidates():
    out, best = verify_match(torch.zeros(4), torch.zeros(0, 2, 4), torch.zeros(0, 2, dtype=torch.long),
                             Sampler(1.0), Random(0), 0)
    assert len(out) == 1 and best == 0


@pytest.mark.parametrize("probs,u", [(torch.tensor([.5, .6], dtype=torch.float64), .3),
                                     (torch.tensor([1.5, -.5], dtype=torch.float64), .3),
                                     (torch.tensor([.5, .5], dtype=torch.float64), 1.0),
                                     (torch.tensor([.5, .5], dtype=torch.float64), -.1),
                                     (torch.tensor([[.5, .5]], dtype=torch.float64), .3)], ids=range(5))
def test_icdf_and_categorical_refuse_rows_that_are_not_laws_and_u_outside_0_1(probs, u):
    with pytest.raises(ValueError):
        icdf(probs, u)
    if 0 <= u < 1:
        with pytest.raises(ValueError):
            Random(0).categorical(probs, "token", 0)


# --------------------------------------------------------------------------- coupled vs rejection

class FixedU(Random):
    """Every draw reads the same uniform u: one point of the shared-uniform coupling."""

    def __init__(self, u):
        super().__init__(0)
        self.u = u

    def uniform(self, stream, position):
        return self.u


def coupled_acceptance(p, q):
    """P(accept) of a draft x = icdf(q, u) checked by verify_match, exactly: walk every
    interval of u between the two CDFs' steps, where both draws are constant."""
    cuts = sorted({0.0, 1.0, *p.cumsum(0).tolist(), *q.cumsum(0).tolist()})
    total = 0.0
    for a, b in zip(cuts, cuts[1:]):
        rng = FixedU((a + b) / 2)
        x = rng.categorical(q, "token", 0)                       # the draft, with plain's noise
        out, _ = verify_match(p.log(), torch.zeros(1, 1, len(p)), torch.tensor([[x]]), Sampler(1.0), rng, 0)
        total += (b - a) * (len(out) == 2)                       # the target's draw was x
    return total


def rejection_acceptance(p, q):
    """P(accept) of x ~ q under verify_rejection, exactly: for each x, the u below its cutoff."""
    total = 0.0
    for x in q.nonzero().flatten().tolist():
        cut = min(1.0, float(p[x] / q[x]))
        for a, b in zip([0.0, cut], [cut, 1.0]):
            if b > a:
                out = verify_rejection(p[None].expand(2, -1), q[None], [x], FixedU((a + b) / 2), 0)
                total += float(q[x]) * (b - a) * (out[0] == x and len(out) == 2)
    return total


def test_coupled_accepts_less_than_rejection_and_depends_on_token_order():
    # Why: coupled verification buys seed-identity with plain sampling; sampling.verify_match
    # states its price, and these are its numbers: 0.4 against rejection's sum min(p, q) = 0.7,
    # and 0.7 once the same three tokens are listed in the order (1, 2, 0).
    p = torch.tensor([.3, .3, .4], dtype=torch.float64)
    q = torch.tensor([0, .3, .7], dtype=torch.float64)
    assert rejection_acceptance(p, q) == pytest.approx(0.7)
    assert coupled_acceptance(p, q) == pytest.approx(0.4)
    order = [1, 2, 0]
    assert coupled_acceptance(p[order], q[order]) == pytest.approx(0.7)
    assert rejection_acceptance(p[order], q[order]) == pytest.approx(0.7)   # order-free
