"""Every decoder's exact output law, on tiny float64 Llamas with a vocabulary of 4.

One parametrized entry per decoder configuration: `run(rng)` builds the decoder generator,
`law` names the law it must keep (the plain sampler's, or the contrastive one). The harness
(`exact_law.decoder_law`) walks every branch of the decoder's random draws, so the comparison
is exact to float64 rounding: a decoder that is off by 1e-6 anywhere fails.
"""

import pytest
import torch

from conftest import tiny_llama, unnamed_decoders
from engine import contrastive, lookahead, lookup, speculative
from engine.adapt import policy
from conftest import int4_copy
from engine.generate import plain
from engine.sampling import Sampler
from exact_law import decoder_law, llama_next_probs, max_gap, reference_law

V, TOL, PROMPT = 4, 1e-12, [1, 3, 0]
TARGET = tiny_llama(5, vocab=V, n_layers=3, scale=1.5)
DRAFT = tiny_llama(6, vocab=V, n_layers=1, scale=1.5)
# a target whose layers pack in 4 bits, and its own weights in 4 bits as the draft (bf16, so
# its law q is near p but not equal: every branch of the verification is walked)
Q_TARGET = tiny_llama(7, vocab=V, n_layers=2, scale=1.5, hidden=64)
Q_DRAFT = int4_copy(Q_TARGET)
SAMPLERS = {"t=1": Sampler(1.0), "t=0.7,top-k=3": Sampler(0.7, top_k=3), "t=1.2,top-p=0.9": Sampler(1.2, top_p=0.9)}


def plain_run(sampler, n):
    return lambda rng: plain(TARGET, PROMPT, sampler=sampler, rng=rng, max_new_tokens=n)


def spec_run(draft, K, verify="rejection", adaptive=False, target=TARGET):
    def run(sampler, n):
        return lambda rng: speculative.decode(
            target, draft, PROMPT, sampler=sampler, rng=rng, max_new_tokens=n, num_draft=K,
            verify=verify, policy=policy.draft_length(target, draft, start=K, most=3) if adaptive else None)
    return run


class ByAcceptance:
    """A policy whose K follows the random draws: 2 after a step that accepted all its drafts,
    1 after a rejection, so branches of the walk draft differently (in 4 tokens: K = 2, then
    K = 1 after a first-draft rejection). The law must not care how K was chosen."""
    k, most = 2, 2

    def update(self, k: int, accepted: int) -> None:
        self.k = 2 if accepted == k else 1


def spec_by_acceptance(sampler, n):
    return lambda rng: speculative.decode(TARGET, DRAFT, PROMPT, sampler=sampler, rng=rng, max_new_tokens=n,
                                          policy=ByAcceptance())


def la_run(W, N, G):
    def run(sampler, n):
        return lambda rng: lookahead.decode(TARGET, PROMPT, sampler=sampler, rng=rng, max_new_tokens=n,
                                            window=W, ngram=N, guesses=G)
    return run


def lu_run(N, K):
    def run(sampler, n):
        return lambda rng: lookup.decode(TARGET, PROMPT, sampler=sampler, rng=rng, max_new_tokens=n,
                                         lookup_ngram=N, lookup_tokens=K)
    return run


def cd_run(amateur, K=0, form="logit"):
    def run(sampler, n):
        return lambda rng: contrastive.decode(
            TARGET, amateur, PROMPT, sampler=sampler, rng=rng, max_new_tokens=n, alpha=0.1, beta=0.5,
            amateur_temperature=0.8, form=form, speculative=K > 0, num_draft=K)
    return run


def cd_law(amateur, form="logit"):
    """The contrastive law: p_CD(x | prefix) = probs(scores(expert, amateur)) at every prefix."""
    def law(sampler, n, eos=()):
        def next_probs(prefix):
            tokens = torch.tensor([PROMPT + list(prefix)])
            pos = torch.arange(tokens.shape[1])
            e = TARGET(tokens, pos)[0, -1]
            if isinstance(amateur, int):
                a = TARGET.head(TARGET.blocks(TARGET.tok_embeddings(tokens), pos, stop=amateur))[0, -1]
            else:
                a = amateur(tokens, pos)[0, -1]
            return sampler.probs(contrastive.scores(e, a, 0.1, 0.5, form, 0.8))
        return reference_law(next_probs, n, eos)
    return law


def target_law(sampler, n, eos=()):
    return reference_law(llama_next_probs(TARGET, PROMPT, sampler), n, eos)


def q_target_law(sampler, n, eos=()):
    return reference_law(llama_next_probs(Q_TARGET, PROMPT, sampler), n, eos)


# name -> (run(sampler, budget) -> (rng -> decoder), law(sampler, budget, eos) -> law, budget)
ENTRIES = {
    "plain": (plain_run, target_law, 3),
    "speculative K=1": (spec_run(DRAFT, 1), target_law, 3),
    "speculative K=2": (spec_run(DRAFT, 2), target_law, 4),
    "speculative self-draft L=1 K=2": (spec_run(speculative.SelfDraft(1), 2), target_law, 4),
    "speculative adaptive K": (spec_run(DRAFT, 1, adaptive=True), target_law, 3),
    "speculative K by the last step's acceptance": (spec_by_acceptance, target_law, 4),
    "speculative coupled K=2": (spec_run(DRAFT, 2, verify="coupled"), target_law, 4),
    "speculative int4 draft K=2": (spec_run(Q_DRAFT, 2, target=Q_TARGET), q_target_law, 4),
    "speculative int4 draft coupled K=2": (spec_run(Q_DRAFT, 2, verify="coupled", target=Q_TARGET),
                                           q_target_law, 4),
    "speculative int4 draft adaptive K": (spec_run(Q_DRAFT, 1, adaptive=True, target=Q_TARGET), q_target_law, 3),
    "lookahead W=2 N=3 G=2": (la_run(2, 3, 2), target_law, 3),
    "lookahead W=3 N=2 G=3": (la_run(3, 2, 3), target_law, 3),
    "lookup N=2 K=2": (lu_run(2, 2), target_law, 4),
    "contrastive, separate amateur": (cd_run(DRAFT), cd_law(DRAFT), 3),
    "contrastive ratio form, early exit L=1": (cd_run(1, form="ratio"), cd_law(1, "ratio"), 3),
    "speculative contrastive K=2": (cd_run(DRAFT, K=2), cd_law(DRAFT), 4),
    "speculative contrastive early exit L=2 K=1": (cd_run(2, K=1), cd_law(2), 3),
}


def test_each_entrys_budget_lets_its_K_draft_in_full():
    # Why: a step drafts at most the tokens left but one, and the prompt's step drafts none; at
    # budget 3, "K=2" entries drafted one token a step and proved K = 1 again. Budget K + 2 lets
    # the second step draft all K.
    import re
    for name, (_, _, n) in ENTRIES.items():
        K = re.search(r"K=(\d+)", name)
        assert K is None or n >= int(K[1]) + 2, name


def test_speculative_with_three_drafts_keeps_its_law():
    # K = 3 needs 5 tokens, whose enumeration is the dearest here: one sampler (top-p prunes the
    # branches; t=1 takes ~80 s), no EOS case (the K = 2 entries have it)
    sampler = SAMPLERS["t=1.2,top-p=0.9"]
    assert max_gap(decoder_law(spec_run(DRAFT, 3)(sampler, 5), 5), target_law(sampler, 5)) < TOL


def test_every_registered_decoder_has_its_law_enumerated_here():
    # Why: a decoder added to the registry (docs/adding-a-decoder.md) must have its law proven
    # by the tests below: one label of ENTRIES at least names it
    assert unnamed_decoders(ENTRIES) == []


@pytest.mark.parametrize("sampler", SAMPLERS.values(), ids=SAMPLERS.keys())
@pytest.mark.parametrize("name", ENTRIES)
def test_decoder_keeps_its_law_exactly(name, sampler):
    run, law, n = ENTRIES[name]
    assert max_gap(decoder_law(run(sampler, n), n), law(sampler, n)) < TOL


@pytest.mark.parametrize("name", ENTRIES)
def test_decoder_keeps_its_law_with_eos(name):
    run, law, n = ENTRIES[name]
    sampler, eos = Sampler(1.0), {2}
    assert max_gap(decoder_law(run(sampler, n), n, eos), law(sampler, n, eos)) < TOL


class Peeking:
    """The broken variant of a policy: K chosen by the next step's second accept uniform, a draw
    still to come (K = 2 where that draft will likely pass)."""
    most = 2

    def __init__(self, rng):
        self.rng, self.n = rng, len(PROMPT) + 1      # the first step after the prompt's

    @property
    def k(self) -> int:
        return 2 if self.rng.bernoulli(0.5, "accept", self.n + 1) else 1

    def update(self, k: int, accepted: int) -> None:
        self.n += accepted + 1


def test_a_policy_that_peeks_at_a_draw_to_come_breaks_the_law():
    # Why: the acceptance entry above proves that K may follow past draws; the proof must
    # also be able to fail, and it does for a K that follows a draw not yet made
    def run(sampler, n):
        return lambda rng: speculative.decode(TARGET, DRAFT, PROMPT, sampler=sampler, rng=rng, max_new_tokens=n,
                                              policy=Peeking(rng))
    sampler = SAMPLERS["t=1.2,top-p=0.9"]                  # the fewest branches: ~3 s (gap 0.019)
    assert max_gap(decoder_law(run(sampler, 4), 4), target_law(sampler, 4)) > 1e-4


@pytest.mark.parametrize("mutant", ["always accept", "residual = p", "residual not normalised",
                                    "draft noise reused for the residual",
                                    "bonus from p_K-1 (the last draft's row) instead of p_K"])
def test_the_speculative_decoder_with_a_classic_bug_fails_its_proof(mutant, monkeypatch):
    # Why: the same harness must catch each bug inside the real decoder, not only in a toy loop.
    from test_sampling import MUTANTS
    monkeypatch.setattr(speculative, "verify_rejection", MUTANTS[mutant][0])
    run, law, n = ENTRIES["speculative K=2"]
    sampler = Sampler(0.7)
    assert max_gap(decoder_law(run(sampler, n), n), law(sampler, n)) > 1e-4


@pytest.mark.parametrize("mutant", ["always accept", "residual = p"])
def test_the_int4_draft_pair_with_a_classic_bug_fails_its_proof(mutant, monkeypatch):
    # Why: a 4-bit copy's law q is close to the target's p, so a bug moves the output law only a
    # little; the harness must still see it (exact to float64, not a sampled estimate).
    from test_sampling import MUTANTS
    monkeypatch.setattr(speculative, "verify_rejection", MUTANTS[mutant][0])
    run, law, n = ENTRIES["speculative int4 draft K=2"]
    sampler = Sampler(1.0)
    assert max_gap(decoder_law(run(sampler, n), n), law(sampler, n)) > 1e-4
