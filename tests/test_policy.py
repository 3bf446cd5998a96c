"""The policy (engine/policy.py): what adapts, tested against its own contract. It chooses
what it says it chose, on every step and every size it can choose; it reads prices pinned to
measured values; it learns only from decided tokens; it never loses to plain decoding by more
than its exploration budget; and a decoder under any policy prints the textbook loop's tokens.
Each property is shown to catch a broken variant."""
import pytest
import torch
from hypothesis import Phase, given, settings, strategies as st

from conftest import prompt_for, run, tiny_llama
from engine import lookahead, lookup, policy, speculative
from engine.draft import SelfDraft, int4_copy
from engine.generate import generate, plain
from engine.lookup import find
from engine.policy import Prices, best_k
from engine.sampling import Random, Sampler

GREEDY = Sampler()


def copy_guess(copier: policy.CopyLength, text: list[int], ngram: int = 4, most: int = 8) -> list[int]:
    """What lookahead's copy arm sends after `text`: find()'s proposal cut to its priced length."""
    full, n, _ = find(text, ngram, most)
    return full[:copier.length(text, full, n)]


# --------------------------------------------------------------------------- prices

def test_row_cost_follows_the_matmul_kind_and_a_measured_table():
    model = tiny_llama(0)                                  # float64 nn.Linear
    assert policy.row_cost(model)(1) == 1.0
    slope = policy.SLOPE.get(("Linear", torch.backends.cpu.get_cpu_capability()), policy.UNKNOWN_SLOPE)
    assert policy.row_cost(model)(9) == pytest.approx(1 + 8 * slope)
    table = {1: 1.0, 4: 1.3, 8: 2.1}
    rows = policy.row_cost(model, table)
    assert [rows(k) for k in (1, 2, 4, 6, 8, 12)] == pytest.approx([1.0, 1.1, 1.3, 1.7, 2.1, 2.9])


def test_layer_shares_add_up_to_a_forward_less_its_head():
    model = tiny_llama(0, n_layers=4)
    c = model.config
    head = c.vocab_size * c.dim / sum(p.numel() for n, p in model.named_parameters()
                                      if "norm" not in n and "tok_embeddings" not in n)
    assert policy.layer_share(model, 0) == 0
    assert policy.layer_share(model, 2) == pytest.approx(policy.layer_share(model, 4) / 2)
    assert policy.layer_share(model, 4) == pytest.approx(1 - head)



# --------------------------------------------------------------------------- speculative's K

@pytest.mark.parametrize("alpha, c, k", [(0.6, 0.05, 4), (0.8, 0.1, 6), (0.9, 0.05, 13), (0.1, 0.5, 0)])
def test_best_k_maximises_tokens_per_unit_cost(alpha, c, k):
    # Why: the optimum K of (1 - alpha^(K+1)) / ((1 - alpha)(K c + 1)) has no closed form; these
    # are brute-force optima of Leviathan et al.'s walltime factor. K = 0 is a plain step: a
    # draft accepted one time in ten at half a forward a token never pays.
    assert best_k(alpha, c, lambda k: 1.0, 32) == k


def test_tuner_follows_the_measured_acceptance():
    # Why: a step accepting 4 of 5 drafts is 4 successes and 1 failure: alpha = 4/5 per draft.
    tuner = policy.DraftLength(4, 32, 0.1, lambda k: 1.0)
    for _ in range(200):
        tuner.update(5, 4)
    assert tuner.k == best_k(0.8, 0.1, lambda k: 1.0, 32) == 6
    for _ in range(200):
        tuner.update(tuner.k, 0)
    assert tuner.k in (0, 1)


def test_tuner_falls_back_to_plain_steps_and_probes_back_ever_more_rarely():
    # Why: "never lose": a draft that is never accepted must cost almost nothing. K drops to 0
    # (plain steps), and the probes that re-measure alpha come after 32, 64, 128, ... plain steps.
    tuner = policy.DraftLength(1, 8, c_draft=0.74, c_verify=lambda k: 0.5 + 0.5 * (1 + 0.03 * k))
    ks = []
    for _ in range(500):
        ks.append(tuner.k)
        tuner.update(tuner.k, 0)                         # every draft rejected
    probes = [i for i, k in enumerate(ks) if k]
    assert ks[0] == 1 and len(probes) <= 5               # 1 + 32 + 64 + 128 + 256 (the cap) < 500
    assert all(b - a >= 32 for a, b in zip(probes, probes[1:]))
    # and when the draft turns good, one probe is enough to lift K off 0
    for _ in range(1200):
        tuner.update(tuner.k, tuner.k)                   # every draft accepted
    assert tuner.k >= 2


def test_a_tuner_that_never_probes_is_caught():
    # the broken variant: without probes, K stays 0 for good once alpha looked bad, and a
    # draft that has become good is never used again; the test above must see that
    tuner = policy.DraftLength(1, 8, c_draft=0.74, c_verify=lambda k: 1.0, probe=10**9)
    for _ in range(50):
        tuner.update(tuner.k, 0)
    for _ in range(300):
        tuner.update(tuner.k, tuner.k)
    assert tuner.k == 0


def test_self_draft_costs_follow_the_model_shapes():
    # Why: the tuner's prices for an early exit: a draft token reads layers [0, L) and the head,
    # the check reads the other layers; with L = all layers a draft costs a whole forward.
    model = tiny_llama(0, n_layers=4)
    c_draft, c_verify, _ = policy.costs(model, SelfDraft(4))
    assert c_draft == pytest.approx(1.0) and c_verify(0) == pytest.approx(1.0)
    c_draft, c_verify, _ = policy.costs(model, SelfDraft(2))
    assert 0.5 < c_draft < 1 and c_verify(0) == pytest.approx(1.0)


def test_a_4bit_copy_is_priced_as_a_close_draft_and_drafts_from_the_first_step():
    # Why: the target's own weights in 4 bits agree with it on most tokens (docs/fidelity.md);
    # priced like a stranger (prior 1/2) it would wait 32 plain steps before its first draft.
    target = tiny_llama(1, hidden=64)
    c_draft, c_verify, prior = policy.costs(target, int4_copy(target), Prices({1: 1.0, 8: 1.2}))
    dispatch = torch.backends.cpu.get_cpu_capability()
    assert prior == 0.9 and c_draft == policy.DRAFT_COST.get(("Int4Linear", dispatch), 0.6)
    assert c_verify(7) == pytest.approx(1.2)
    assert policy.costs(target, int4_copy(target), Prices(draft=0.3))[0] == 0.3   # measured wins
    assert policy.costs(target, tiny_llama(2, hidden=64))[2] == 0.5     # same shapes, not a copy
    draft = int4_copy(target)
    steps = speculative.decode(target, draft, [1, 2], sampler=GREEDY, rng=Random(0), max_new_tokens=8,
                               policy=policy.draft_length(target, draft, Prices({1: 1.0, 8: 1.2}, 0.5)))
    assert next(steps).drafted >= 1


@pytest.mark.parametrize("c,want", [(0.2, "int4"), (0.9, "self")])
def test_pays_ranks_drafts_by_tokens_per_unit_of_cost(c, want):
    # Why: --draft auto takes the draft `pays` prices higher. Pinned examples: at 0.2 of a
    # forward a token the 4-bit copy wins (prior 0.9); at 0.9 it loses to a 1-of-2-layer exit.
    target = tiny_llama(1, hidden=64)
    copy4, exit1 = policy.pays(target, int4_copy(target), Prices({1: 1.0, 8: 1.2}, c)), \
        policy.pays(target, SelfDraft(1), Prices({1: 1.0, 8: 1.2}))
    assert (copy4 > exit1) == (want == "int4") and min(copy4, exit1) >= 1.0


# --------------------------------------------------------------------------- lookahead's arm

def test_auto_tries_an_arm_after_its_wait_then_prefers_the_most_tokens_per_unit_cost():
    # Why: an arm costing c units is first tried after patience * (c - 1) plain steps, as a
    # retry would be, so a dear window is never paid for in a short answer; once tried, the
    # arm with the most tokens per unit of cost wins.
    auto = policy.Arms(((0, 0), (1, 1), (2, 2)), cost=lambda k: 1 + 0.1 * (k - 1), n=3)
    assert auto.wait[1:] == [30, 70]                     # c = 1.3 (4 rows) and 1.7 (8 rows)
    assert [auto.choose() for _ in range(30)] == [0] * 30   # plain's value is known: 1 a unit
    assert auto.choose() == 1                            # step 31: its wait is over
    auto.update(1, tokens=3, rows=4)                     # 3 tokens for 1.3 units
    for _ in range(39):                                  # steps 32-70: 2.3 a unit beats plain's 1
        assert auto.choose() == 1
        auto.update(1, tokens=3, rows=4)
    assert auto.choose() == 2                            # step 71: the dearer arm's wait is over
    auto.update(2, tokens=2, rows=8)                     # 2 tokens for 1.7 units
    assert auto.choose() == 1                            # 2.3 beats 1.0 and 1.2 tokens per unit


def cost_per_token(auto, cost, tokens_per_step, steps=1000):
    """Run Arms against arms that emit fixed tokens per step; the real cost of a token."""
    spent = emitted = 0.0
    for _ in range(steps):
        a = auto.choose()
        rows = 1 + 3 * sum(policy.ARMS[a])
        auto.update(a, tokens=tokens_per_step[a], rows=rows)
        spent, emitted = spent + cost(rows), emitted + tokens_per_step[a]
    return spent / emitted


def test_auto_settles_on_plain_steps_when_guesses_do_not_pay():
    # Why: "never lose": when no arm's extra tokens pay for its rows, the plain arm (one row)
    # wins, and the costly arms come back only rarely: exploration costs at most 1/patience of
    # a plain step per step and arm. Here every guessing arm emits 1.1 tokens a step, yet costs
    # 1.15-2.5 units, so plain's 1 token a unit is best.
    cost = lambda k: 1 + 0.05 * (k - 1)
    hits = [1] + [1.1] * (len(policy.ARMS) - 1)
    bound = 1 + (len(policy.ARMS) - 1) / 100
    assert cost_per_token(policy.Arms(policy.ARMS, cost, n=4, patience=100), cost, hits) <= bound
    # the broken variant, Arms blind to costs, settles on a window arm and loses
    blind = policy.Arms(policy.ARMS, lambda k: 1.0, n=4, patience=100)
    assert cost_per_token(blind, cost, hits) > bound + 0.1


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
    priced, starts, at = policy.CopyLength(lambda k: 1.0), [], 2
    for size in sizes:
        if at >= len(text):
            break
        copy_guess(priced, text[:at])
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
    monkeypatch.setattr(policy.CopyLength, "learn", hasty)
    inner = test_priced_copy_scores_every_proposal_by_the_text_that_followed.hypothesis.inner_test
    quick = settings(max_examples=60, phases=[Phase.generate], database=None, deadline=None, derandomize=True)
    with pytest.raises(AssertionError):
        quick(given(text=st.lists(st.integers(0, 3), min_size=3, max_size=80),
                    sizes=st.lists(st.integers(1, 9), min_size=1, max_size=80))(inner))()


def priced_guesses(text: list[int], cost, step: int = 1) -> list[list[int]]:
    priced = policy.CopyLength(cost)
    return [copy_guess(priced, text[:at]) for at in range(4, len(text), step)]


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
    monkeypatch.setattr(policy.CopyLength, "learn", lambda self, text: None)
    with pytest.raises(AssertionError):
        test_priced_copy_guesses_long_where_the_text_repeats()
    with pytest.raises(AssertionError):
        test_priced_copy_declines_where_copies_fail()
