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
from engine.draft import EarlyExit, Ngram, NgramPair
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
# a draft-target pair as the Qwen2.5-Coder pair is one (tools/pair.py): two Qwen2-shaped models
# of one vocabulary, the draft narrower and shallower, weights of its own
F_TARGET = tiny_llama(8, vocab=V, n_layers=3, scale=1.5, qkv_bias=True)
F_DRAFT = tiny_llama(9, vocab=V, n_layers=1, scale=1.5, qkv_bias=True, dim=16, heads=2, hidden=24)
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


class LoggedLookahead(policy.Lookahead):
    """Lookahead's policy, logging each choice into `log`: an arm (W, G), or ("copy", length)."""

    def __init__(self, cost, n, log: set):
        super().__init__(cost, n)
        self.log = log

    def choose(self, text, room):
        c = super().choose(text, room)
        self.log.add(("copy", len(c.copy)) if c.copy else (c.window, c.guesses))
        return c


class LoggedCopyLength(policy.CopyLength):
    """Lookup's policy, logging each length it cuts a copy to into `log` (0: a plain step)."""

    def __init__(self, cost, log: set):
        super().__init__(cost)
        self.log = log

    def length(self, *args, **kw):
        k = super().length(*args, **kw)
        self.log.add(("copy", k))
        return k


def la_adaptive(cost, N):
    """--decoder lookahead's default: policy.Lookahead(cost, N) chooses each step (W, G <= 5)."""
    def run(sampler, n, log=None):
        def make(rng):
            choice = policy.Lookahead(cost, N) if log is None else LoggedLookahead(cost, N, log)
            return lookahead.decode(TARGET, PROMPT, sampler=sampler, rng=rng, max_new_tokens=n, ngram=N,
                                    policy=choice)
        return make
    return run


def lu_adaptive(cost):
    """--decoder lookup's default: policy.CopyLength(cost) cuts each copy (lookup_tokens = 8)."""
    def run(sampler, n, log=None):
        def make(rng):
            cut = policy.CopyLength(cost) if log is None else LoggedCopyLength(cost, log)
            return lookup.decode(TARGET, PROMPT, sampler=sampler, rng=rng, max_new_tokens=n, policy=cut)
        return make
    return run


# Prices (rows -> cost of a forward, one row = 1) that steer the policies onto every choice within
# budgets the suite affords; the law must hold under any prices (tests/test_policy.py holds the
# real ones to their measurements). FREE: every copy pays, and the window arms are tried one a
# step, cheap to costly, from step 2 of the arms' clock (step 1 is plain: an untried arm is worth
# 0). STEERED is no machine's table: 2-5 rows dear, so no copy (2-3 rows) pays and W2 G2 (4 rows
# at N = 2) waits, while W3 G3 (6 rows) and W5 G5 (10) are free: tried at steps 2 and 3.
FREE = lambda rows: 1.0                                              # noqa: E731
STEERED = lambda rows: 1.0 if rows == 1 or rows >= 6 else 3.0        # noqa: E731


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
            if isinstance(amateur, EarlyExit):
                a = TARGET.head(TARGET.blocks(TARGET.tok_embeddings(tokens), pos, stop=amateur.layers))[0, -1]
            else:
                a = amateur(tokens, pos)[0, -1]
            return sampler.probs(contrastive.scores(e, a, 0.1, 0.5, form, 0.8))
        return reference_law(next_probs, n, eos)
    return law


def target_law(sampler, n, eos=()):
    return reference_law(llama_next_probs(TARGET, PROMPT, sampler), n, eos)


def q_target_law(sampler, n, eos=()):
    return reference_law(llama_next_probs(Q_TARGET, PROMPT, sampler), n, eos)


def f_target_law(sampler, n, eos=()):
    return reference_law(llama_next_probs(F_TARGET, PROMPT, sampler), n, eos)


# name -> (run(sampler, budget) -> (rng -> decoder), law(sampler, budget, eos) -> law, budget)
ENTRIES = {
    "plain": (plain_run, target_law, 3),
    "speculative K=1": (spec_run(DRAFT, 1), target_law, 3),
    "speculative K=2": (spec_run(DRAFT, 2), target_law, 4),
    "speculative self-draft L=1 K=2": (spec_run(EarlyExit(1), 2), target_law, 4),
    "speculative adaptive K": (spec_run(DRAFT, 1, adaptive=True), target_law, 3),
    "speculative K by the last step's acceptance": (spec_by_acceptance, target_law, 4),
    "speculative coupled K=2": (spec_run(DRAFT, 2, verify="coupled"), target_law, 4),
    "speculative n-gram draft K=2": (spec_run(Ngram(2, least=1), 2), target_law, 4),
    "speculative n-gram draft coupled K=2": (spec_run(Ngram(2, least=1), 2, verify="coupled"), target_law, 4),
    "speculative n-gram draft adaptive K": (spec_run(Ngram(1, least=1), 1, adaptive=True), target_law, 3),
    "speculative n-grams else a model K=2": (spec_run(Ngram(2, least=1, otherwise=DRAFT), 2), target_law, 4),
    "speculative n-grams else a model coupled K=2": (spec_run(Ngram(2, least=1, otherwise=DRAFT), 2, verify="coupled"),
                                                     target_law, 4),
    "speculative int4 draft K=2": (spec_run(Q_DRAFT, 2, target=Q_TARGET), q_target_law, 4),
    "speculative int4 draft coupled K=2": (spec_run(Q_DRAFT, 2, verify="coupled", target=Q_TARGET),
                                           q_target_law, 4),
    "speculative int4 draft adaptive K": (spec_run(Q_DRAFT, 1, adaptive=True, target=Q_TARGET), q_target_law, 3),
    "speculative family draft K=2": (spec_run(F_DRAFT, 2, target=F_TARGET), f_target_law, 4),
    "speculative family draft coupled K=2": (spec_run(F_DRAFT, 2, verify="coupled", target=F_TARGET),
                                             f_target_law, 4),
    "speculative family draft adaptive K": (spec_run(F_DRAFT, 1, adaptive=True, target=F_TARGET), f_target_law, 3),
    "lookahead W=2 N=3 G=2": (la_run(2, 3, 2), target_law, 3),
    "lookahead W=3 N=2 G=3": (la_run(3, 2, 3), target_law, 3),
    "lookup N=2 K=2": (lu_run(2, 2), target_law, 4),
    # the adaptive policies the CLI runs by default (COVERS says what each one's walk chooses)
    "lookahead adaptive N=3, rows free": (la_adaptive(FREE, 3), target_law, 4),
    "lookahead adaptive N=2, rows free from 6": (la_adaptive(STEERED, 2), target_law, 4),
    "lookup adaptive copy length, rows free": (lu_adaptive(FREE), target_law, 4),
    "contrastive, separate amateur": (cd_run(DRAFT), cd_law(DRAFT), 3),
    "contrastive ratio form, early exit L=1": (cd_run(EarlyExit(1), form="ratio"), cd_law(EarlyExit(1), "ratio"), 3),
    "speculative contrastive K=2": (cd_run(DRAFT, K=2), cd_law(DRAFT), 4),
    "speculative contrastive early exit L=2 K=1": (cd_run(EarlyExit(2), K=1), cd_law(EarlyExit(2)), 3),
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


class PeekingNgram(NgramPair):
    """The broken variant of the n-gram draft: silent where the accept draw to come is high (where
    its guess would likely fail), so whether it proposes follows a draw not yet made."""
    rng = None

    def propose(self, tokens, positions):
        a = super().propose(tokens, positions)
        at = int(positions[-1]) + 1                              # the position it would draft
        return a if a is not None and self.rng.bernoulli(0.5, "accept", at) else None


def test_an_ngram_draft_silent_by_a_draw_to_come_breaks_the_law(monkeypatch):
    # Why: an n-gram draft may stop short of K (engine/draft.py's subtle: the law holds because
    # whether it proposes is a function of the text alone); the proof must fail for a draft
    # whose silence follows the verification's own draw at that position
    def run(sampler, n):
        def go(rng):
            PeekingNgram.rng = rng
            monkeypatch.setattr(speculative, "pair_for", lambda t, d, cap, scratch: PeekingNgram(t, d, cap, scratch))
            return speculative.decode(TARGET, Ngram(1, least=1), PROMPT, sampler=sampler, rng=rng, max_new_tokens=n, num_draft=2)
        return go
    sampler = SAMPLERS["t=1.2,top-p=0.9"]
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


@pytest.mark.parametrize("pair", ["int4", "family"])
@pytest.mark.parametrize("mutant", ["always accept", "residual = p"])
def test_the_int4_and_family_draft_pairs_with_a_classic_bug_fail_their_proofs(mutant, pair, monkeypatch):
    # Why: a 4-bit copy's law q is close to the target's p, so a bug moves the output law only a
    # little; the harness must still see it (exact to float64, not a sampled estimate). The same
    # for a draft of the target's family, with biases and shapes of its own
    from test_sampling import MUTANTS
    monkeypatch.setattr(speculative, "verify_rejection", MUTANTS[mutant][0])
    run, law, n = ENTRIES[f"speculative {pair} draft K=2"]
    sampler = Sampler(1.0)
    assert max_gap(decoder_law(run(sampler, n), n), law(sampler, n)) > 1e-4


# what each adaptive entry's walk chooses (t = 1, every branch); the choices follow the draws:
# in the first, a copy wherever the token just drawn occurred before (else an arm, by the arms'
# clock: plain, then W2 G2); in the second, W5 G5 only on branches whose W3 G3 step accepted
# no guess. Across the lookahead entries: every arm of policy.ARMS, and copies of 1 and 2 tokens.
COVERS = {
    "lookahead adaptive N=3, rows free": {(0, 0), (2, 2), ("copy", 1), ("copy", 2)},
    "lookahead adaptive N=2, rows free from 6": {(0, 0), (3, 3), (5, 5)},
    "lookup adaptive copy length, rows free": {("copy", 0), ("copy", 1), ("copy", 2)},
}


@pytest.mark.parametrize("name", COVERS)
def test_each_adaptive_entrys_walk_takes_the_choices_it_names(name):
    # Why: a law proven under a policy covers the choices its walk made, no more; prices under
    # which no window is ever tried, or every copy is one token, would prove the textbook loop
    # again under a new name. The log comes from the policy itself, wrapped.
    run, _, n = ENTRIES[name]
    log = set()
    decoder_law(run(SAMPLERS["t=1"], n, log), n)
    assert log == COVERS[name]


def test_the_adaptive_entries_take_every_arm_and_copies_of_more_than_one_length():
    # Why: the claim "lookahead's and lookup's adaptive choices keep the law" is only as wide as
    # the choices proven; this holds the entries above to all of policy.ARMS and copy lengths.
    ahead = set().union(*(c for name, c in COVERS.items() if name.startswith("lookahead")))
    assert set(policy.ARMS) <= ahead
    assert len({c for c in ahead if c[0] == "copy"}) >= 2
    assert {("copy", 1), ("copy", 2)} <= COVERS["lookup adaptive copy length, rows free"]


class PeekingLookahead(policy.Lookahead):
    """A broken variant of lookahead's policy: the copy where the uniform of the step's second
    token, a draw still to come, is below 1/2; else W5 G5."""

    def __init__(self, rng, log):
        super().__init__(FREE, 3)
        self.rng, self.log = rng, log

    def choose(self, text, room):
        c = super().choose(text, room)
        peek = self.rng.bernoulli(0.5, "token", len(text) + 1)      # a draw still to come
        self.log.add(peek and bool(c.copy))
        return c if peek and c.copy else policy.Choice(5, 5, [])


class PeekingCopyLength(policy.CopyLength):
    """The same for lookup: the whole copy where that uniform is below 1/2, else one token."""

    def __init__(self, rng, log):
        super().__init__(FREE)
        self.rng, self.log = rng, log

    def length(self, text, proposal, n, beat=1.0, room=None):
        k = super().length(text, proposal, n, beat, room)
        peek = self.rng.bernoulli(0.5, "token", len(text) + 1)
        self.log.add(peek and k > 1)
        return k if peek else min(k, 1)


def peeking_run(decoder):
    def run(sampler, n, log):
        if decoder == "lookahead":
            return lambda rng: lookahead.decode(TARGET, PROMPT, sampler=sampler, rng=rng, max_new_tokens=n, ngram=3,
                                                policy=PeekingLookahead(rng, log))
        return lambda rng: lookup.decode(TARGET, PROMPT, sampler=sampler, rng=rng, max_new_tokens=n,
                                         policy=PeekingCopyLength(rng, log))
    return run


@pytest.mark.parametrize("decoder", ["lookahead", "lookup"])
def test_a_match_verified_policy_that_peeks_at_a_draw_to_come_cannot_move_the_law(decoder):
    # Why: speculative's peeking K breaks its law (above), because rejection sampling's tokens
    # depend on K. Lookahead and lookup check guesses with verify_match, whose tokens are plain's
    # own draws (key ("token", position)) whatever was guessed: their policies choose only how
    # much work a forward does, so even one that reads a draw to come keeps the law. Were these
    # decoders verified by rejection instead, a choice could move their tokens, and their
    # policies would need speculative's discipline (choices from past draws only).
    log, sampler, n = set(), SAMPLERS["t=1.2,top-p=0.9"], 4
    assert max_gap(decoder_law(peeking_run(decoder)(sampler, n, log), n), target_law(sampler, n)) < TOL
    assert log == {True, False}      # the peek did steer: some branches copied on it, some not


def cut_after_the_draw(verify_match):
    """A mutant of verify_match: draw first, then send only the guess prefix the draws accept."""
    def cut(first, rows, candidates, sampler, rng, position):
        out, _ = verify_match(first, rows, candidates, sampler, rng, position)   # sees the draws
        m = len(out) - 1
        return verify_match(first, rows[:, :m], candidates[:, :m], sampler, rng, position)
    return cut


@pytest.mark.parametrize("name", ["lookahead adaptive N=3, rows free", "lookup adaptive copy length, rows free"])
def test_a_copy_cut_after_its_draw_cannot_move_the_law(name, monkeypatch):
    # Why: the same reason, in its starkest form: a copy cut to exactly what the draws accept
    # (no machine can know that before the forward) emits the same tokens, for a match-verified
    # copy is accepted exactly as far as plain's draws agree with it.
    module = lookahead if name.startswith("lookahead") else lookup
    monkeypatch.setattr(module, "verify_match", cut_after_the_draw(module.verify_match))
    run, law, n = ENTRIES[name]
    sampler = SAMPLERS["t=1.2,top-p=0.9"]
    assert max_gap(decoder_law(run(sampler, n), n), law(sampler, n)) < TOL


def bonus_from_the_guess_row(verify_match):
    """The classic bug in a new place: the token after an accepted guess token drawn from that
    token's own row (the law at its position), not from the row after it."""
    def shifted(first, rows, candidates, sampler, rng, position):
        if rows.shape[1]:          # (G, n, V): row j := row j - 1, row 0 := first
            rows = torch.cat([first.expand(rows.shape[0], 1, -1), rows[:, :-1]], 1)
        return verify_match(first, rows, candidates, sampler, rng, position)
    return shifted


def trusted_copy(verify_match):
    """A copy accepted whole once its first token is drawn (a shortcut that saves draws)."""
    def trusting(first, rows, candidates, sampler, rng, position):
        out, best = verify_match(first, rows[:, :1], candidates[:, :1], sampler, rng, position)
        n = candidates.shape[1]
        if len(out) == 1 or n == 1:
            return out, best
        y = sampler.draw(rows[best, -1], rng, "token", position + n)
        return candidates[best].tolist() + [y], best
    return trusting


@pytest.mark.parametrize("name,mutant", [(name, "bonus from the guess row") for name in COVERS] +
                         [("lookahead adaptive N=3, rows free", "copy trusted past its first token"),
                          ("lookup adaptive copy length, rows free", "copy trusted past its first token")])
def test_the_adaptive_entries_with_a_broken_verification_fail_their_proof(name, mutant, monkeypatch):
    # Why: a proof that cannot fail proves nothing; each adaptive entry must catch a bug on the
    # paths its policy takes (the copies, the wider windows' guesses) within its budget.
    module = lookahead if name.startswith("lookahead") else lookup
    wrap = bonus_from_the_guess_row if mutant.startswith("bonus") else trusted_copy
    monkeypatch.setattr(module, "verify_match", wrap(module.verify_match))
    run, law, n = ENTRIES[name]
    sampler = SAMPLERS["t=1.2,top-p=0.9"]
    assert max_gap(decoder_law(run(sampler, n), n), law(sampler, n)) > 1e-4
