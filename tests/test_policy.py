"""The policy (engine/adapt/policy.py): what adapts, tested against its own contract. It chooses
what it says it chose, on every step and every size it can choose; it reads prices pinned to
measured values; it learns only from decided tokens; it never loses to plain decoding by more
than its exploration budget; and a decoder under any policy prints the textbook loop's tokens.
Each property is shown to catch a broken variant."""
import inspect
import json
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch
from hypothesis import example, given, settings, strategies as st

from conftest import prompt_for, run, tiny_llama
from engine import lookahead, lookup, speculative
from engine.adapt import policy
from conftest import int4_copy
from engine.adapt.policy import Prices, best_k
from engine.draft import EarlyExit, Ngram
from engine.generate import generate, plain
from engine.lookup import find
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


def test_lookahead_and_lookup_pay_each_row_past_the_first_doubt_times_its_price():
    # Why: their choices are the best of noisy estimates (the optimizer's curse) and a kept price
    # is one moment's, so the policies the registry builds charge DOUBT x each extra row; a copy
    # that would pay at the table's price but not at the doubted one is not sent. Caught broken
    # variant: for_lookahead and for_lookup built on the raw row_cost (1.2 here, not 1.25).
    model, table = tiny_llama(0), {1: 1.0, 2: 1.2, 4: 1.6}
    ahead, copier = policy.for_lookahead(model, Prices(table), {}), policy.for_lookup(model, Prices(table), {})
    assert policy.DOUBT == 1.25
    for cost in (ahead.copier.cost, ahead.arms.cost, copier.cost):
        assert [cost(k) for k in (1, 2, 3, 4)] == pytest.approx([1.0, 1.25, 1.5, 1.75])
    text = [5, 6, 7, 5, 6]                      # a two-token match: p = 1/2 at the prior
    assert policy.CopyLength(policy.row_cost(model, {1: 1.0, 2: 1.45})).length(text, [7], 2) == 1   # 1.5 / 1.45
    assert policy.for_lookup(model, Prices({1: 1.0, 2: 1.45}), {}).length(text, [7], 2) == 0          # 1.5 / 1.5625


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
    c_draft, c_verify, _ = policy.costs(model, EarlyExit(4))
    assert c_draft == pytest.approx(1.0) and c_verify(0) == pytest.approx(1.0)
    c_draft, c_verify, _ = policy.costs(model, EarlyExit(2))
    assert 0.5 < c_draft < 1 and c_verify(0) == pytest.approx(1.0)


def test_a_4bit_copy_is_priced_as_a_close_draft_and_drafts_from_the_first_step_after_the_prompt():
    # Why: the target's own weights in 4 bits agree with it on most tokens (docs/fidelity.md);
    # priced like a stranger (prior 1/2) it would wait 32 plain steps before its first draft.
    target = tiny_llama(1, hidden=64)
    c_draft, c_verify, prior = policy.costs(target, int4_copy(target), Prices({1: 1.0, 8: 1.2}))
    dispatch = torch.backends.cpu.get_cpu_capability()
    assert prior == policy.COPY_PRIOR and c_draft == policy.DRAFT_COST.get(("Int4Linear", dispatch), 0.6)
    assert c_verify(7) == pytest.approx(1.2)
    assert policy.costs(target, int4_copy(target), Prices(draft=0.3))[0] == 0.3   # measured wins
    assert policy.costs(int4_copy(target), int4_copy(target))[0] == 1.0   # a 4-bit target's own copy
    assert policy.costs(target, tiny_llama(2, hidden=64))[2] == policy.FAMILY_PRIOR   # another model
    draft = int4_copy(target)
    steps = speculative.decode(target, draft, [1, 2], sampler=GREEDY, rng=Random(0), max_new_tokens=8,
                               policy=policy.draft_length(target, draft, Prices({1: 1.0, 8: 1.2}, 0.5)))
    assert next(steps).drafted == 0 and next(steps).drafted >= 1   # the prompt's step is plain's


def test_a_family_draft_is_priced_by_the_weights_it_reads_until_measured():
    # Why: make pair's 0.5B beside the 1.5B reads about a third of the target's weights a step;
    # priced by its parameters, embeddings included (a lookup reads one row), it would look dearer.
    # A measured price wins; the prior is FAMILY_PRIOR, so it drafts from the first step
    target = tiny_llama(1, vocab=256, n_layers=3, hidden=64, qkv_bias=True)
    draft = tiny_llama(2, vocab=256, n_layers=1, hidden=64, qkv_bias=True)
    c_draft, c_verify, prior = policy.costs(target, draft, Prices({1: 1.0, 4: 1.4, 5: 2.3}))
    layer = policy.layer_reads(target.config)
    assert c_draft == pytest.approx((layer + 256 * 32) / (3 * layer + 256 * 32)) and prior == policy.FAMILY_PRIOR
    assert policy.costs(target, draft, Prices(draft=0.3))[0] == 0.3
    # the 1.5B's measured block-of-4 rows (cost(4) 1.40, cost(5) 2.35) and the 0.5B's price: K = 3 at alpha 0.9
    table = {1: 1.0, 2: 1.14, 3: 1.30, 4: 1.40, 5: 2.35, 8: 2.49}
    assert policy.best_k(0.9, 0.3, lambda k: policy.interpolate(table, k + 1), 16) == 3
    assert policy.draft_length(target, draft, Prices(table, 0.3)).k >= 1


@pytest.mark.parametrize("c,want", [(0.2, "int4"), (1.2, "self")])
def test_pays_ranks_drafts_by_tokens_per_unit_of_cost(c, want):
    # Why: --draft auto takes the draft `pays` prices higher. Pinned examples: at 0.2 of a
    # forward a token the 4-bit copy wins (its prior COPY_PRIOR); at 1.2 no K of it beats plain's
    # pace, and it does not rank above a 1-of-2-layer exit.
    target = tiny_llama(1, hidden=64)
    copy4, exit1 = policy.pays(target, int4_copy(target), Prices({1: 1.0, 8: 1.2}, c)), \
        policy.pays(target, EarlyExit(1), Prices({1: 1.0, 8: 1.2}))
    assert (copy4 > exit1) == (want == "int4") and min(copy4, exit1) >= 1.0


@pytest.mark.parametrize("table,c,want", [({1: 1.0, 8: 1.2}, 0.2, "int4"), ({1: 1.0, 8: 3.0}, 0.9, "ngram")])
def test_pays_weighs_the_texts_ngrams_by_the_steps_they_draft_on(table, c, want):
    # Why: --draft auto weighs the text's n-grams against a model draft. They cost no forward but
    # draft only where the text repeats (NGRAM_HITS of steps), so on cheap rows (fp32) a 4-bit
    # copy at 0.2 of a forward wins, and on dear rows (the 4-bit path) the n-grams win over both
    # that copy at 0.9 and any early exit; either way a choice of theirs never loses to plain
    target = tiny_llama(1, hidden=64)
    text = policy.pays(target, Ngram(3), Prices(table))
    copy4 = policy.pays(target, int4_copy(target), Prices(table, c))
    exit1 = policy.pays(target, EarlyExit(1), Prices(table))
    assert (copy4 > text) == (want == "int4") and text > exit1 and text >= 1.0
    h, alpha = policy.NGRAM_HITS, policy.NGRAM_PRIOR             # the mix, by hand, at K = 1
    one = (h * (1 + alpha) + 1 - h) / (h * policy.row_cost(target, table)(2) + 1 - h)
    assert text >= one


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
@example(text=[0, 1, 2] * 4, sizes=[1] * 12)   # proposals that agree with one-token steps so far
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
    # subtle: pinned, not searched: a 60-example search found it alone but missed it inside the
    # full suite once (hypothesis draws differently there), and a catch must not hang on luck
    with pytest.raises(AssertionError):
        inner(text=[0, 1, 2] * 4, sizes=[1] * 12)


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
    # 0.3 of a forward costs more than it buys. The prior (1 in 2 after a match of two tokens or
    # more) guesses at first; what the text teaches stops it. On a flat price list (a GPU) the same chances are worth a guess.
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


# --------------------------------------------------------------------------- the contract: said = done

def broken(module, old: str, new: str):
    """`module` with one line of its source changed: a deliberately broken variant of a decoder,
    to show a call-site test fails on it (the module itself is left alone)."""
    src = inspect.getsource(module)
    assert src.count(old) == 1, old
    copy = sys.modules[module.__name__ + "_broken"] = ModuleType(module.__name__ + "_broken")
    exec(compile(src.replace(old, new), module.__file__, "exec"), copy.__dict__)   # dataclasses look it up
    return copy


class Said:
    """Wraps a policy; keeps what it said before each step (after the prefill, which is plain)."""

    def __init__(self, inner, alter=lambda choice: choice):
        self.inner, self.alter, self.said, self.told = inner, alter, [], []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def choose(self, text, room):                 # lookahead
        choice = self.inner.choose(text, room)
        self.said.append((choice, list(text), room))
        return self.alter(choice)

    @property
    def k(self):                                  # speculative
        self.said.append(self.inner.k)
        return self.alter(self.said[-1])

    def update(self, *args):
        self.told.append(args)
        self.inner.update(*args)


class Every(policy.Lookahead):
    """Lookahead's policy made to walk through every choice it can make: each arm of ARMS and a
    copy of every length 1..COPY_MOST (of made-up tokens: a guess need not be right)."""

    def __init__(self, n):
        super().__init__(lambda k: 1.0, n)
        self.script = [policy.Choice(w, g, []) for w, g in policy.ARMS] + \
            [policy.Choice(0, 0, [(i + 1) % 4] * L) for i, L in enumerate(range(1, policy.COPY_MOST + 1))]
        self.step = 0

    def choose(self, text, room):
        self.step += 1
        return self.script[(self.step - 1) % len(self.script)]


def collect(steps, n: int) -> list:
    """The steps generate() takes from a decoder for a budget of n tokens (the last one may be cut)."""
    log = []

    def record():
        for step in steps:
            log.append(step)
            yield step
    list(generate(record(), max_new_tokens=n))
    return log


def lookahead_steps(model, prompt, n, pol, sampler=GREEDY, decoder=lookahead):
    return collect(decoder.decode(model, prompt, sampler=sampler, rng=Random(1), max_new_tokens=n, ngram=4,
                                  policy=pol, trace=True), n)


def done_as_said(steps, said: Said, N: int = 4) -> list[str]:
    """Where a step did not do what the policy said: its columns, guesses, copy, label, and
    what the policy was told the step cost and emitted."""
    wrong = []
    for i, (step, (choice, _, _), told) in enumerate(zip(steps[1:], said.said, said.told)):
        t = step.trace
        w = len(t["levels"][0]) if t["levels"] else 0
        window_rows = 1 + (N - 1) * w - (w > 0)
        label = "copy" if choice.copy else f"W{choice.window} G{choice.guesses}" if sum(choice[:2]) else "plain"
        if w != choice.window or step.arm != label:
            wrong.append(f"step {i + 1}: said {label}, sent {w} columns ({step.arm})")
        if choice.copy and t["grams"] != [tuple(choice.copy)]:
            wrong.append(f"step {i + 1}: said copy {choice.copy}, verified {t['grams']}")
        if not choice.copy and (len(t["grams"]) > choice.guesses or any(len(g) != N - 1 for g in t["grams"])):
            wrong.append(f"step {i + 1}: said G={choice.guesses}, verified {t['grams']}")
        if told != (len(step.tokens), len(t["parent"])) or len(t["parent"]) < window_rows:
            wrong.append(f"step {i + 1}: told {told}, the forward had {len(t['parent'])} rows")
    return wrong


@given(seed=st.integers(0, 2**16), slope=st.floats(0.0, 0.3), temperature=st.sampled_from([0.0, 0.9]))
@settings(max_examples=25, deadline=None)
def test_lookahead_steps_do_what_its_policy_says_on_every_step(seed, slope, temperature):
    # Why: the policy states a choice (a copy, a plain step, W columns and G guesses) and is told
    # what the step emitted and how many rows it cost; the step must be that choice, and what it
    # was told must be the truth, or its prices learn from another step than the one taken.
    model, prompt = tiny_llama(seed % 3, vocab=5), prompt_for(seed, 8, 5)
    said = Said(policy.Lookahead(lambda k: 1 + slope * (k - 1), 4))
    steps = lookahead_steps(model, prompt, 30, said, Sampler(temperature))
    assert len(said.said) == len(said.told) == len(steps) - 1 and not done_as_said(steps, said)


def test_every_choice_lookahead_can_make_is_done_as_said_and_prints_plain_tokens():
    # Why: a tiny model's real policy reaches the small choices only; scripted, the decoder is
    # asked each arm of ARMS (up to W5 G5) and a copy of every length up to COPY_MOST, twice
    # round, and must send each as said, and print plain's tokens under all of them.
    model, prompt = tiny_llama(1, vocab=5), prompt_for(1, 8, 5)
    said = Said(Every(4))
    steps = lookahead_steps(model, prompt, 2 * len(said.inner.script) + 1, said)
    made = {(c.window, c.guesses, len(c.copy)) for c, _, _ in said.said}
    assert made == {(w, g, 0) for w, g in policy.ARMS} | {(0, 0, L) for L in range(1, policy.COPY_MOST + 1)}
    assert not done_as_said(steps, said)
    assert [t for s in steps for t in s.tokens][:len(steps)] == run(plain, model, prompt, len(steps))


def test_a_step_that_is_not_what_was_said_is_caught():
    # the broken variants: the decoder sends two columns even on copy and plain steps, or the
    # policy is told the step's rows without its guesses; the check above must see both
    model, prompt = tiny_llama(1, vocab=5), prompt_for(1, 8, 5)
    for old, new in [("sent = [level[:w] for level in levels]", "sent = [level[:max(w, 2)] for level in levels]"),
                     ("policy.update(len(out), len(rows.tokens))", "policy.update(len(out), len(rows.tokens) - len(grams))")]:
        said = Said(Every(4))
        steps = lookahead_steps(model, prompt, 14, said, decoder=broken(lookahead, old, new))
        assert done_as_said(steps, said), old


def test_lookahead_asks_its_policy_with_the_text_so_far_and_the_room_left():
    # Why: the call site. A copy is found in the text emitted so far and cut to the budget left;
    # a stale text or a room past the budget would price guesses no step can use.
    model, prompt, n = tiny_llama(2, vocab=4), prompt_for(2, 8, 4), 25
    said = Said(policy.Lookahead(lambda k: 1.0, 4))
    steps = lookahead_steps(model, prompt, n, said)
    emitted = [t for s in steps for t in s.tokens]
    for i, (_, text, room) in enumerate(said.said):
        sofar = len(steps[0].tokens) + sum(len(s.tokens) for s in steps[1:i + 1])
        assert text == prompt + emitted[:sofar] and room == max(n - sofar - 1, 0)
    # the broken variant: the room counted from the start, not what is left
    said = Said(policy.Lookahead(lambda k: 1.0, 4))
    bad = broken(lookahead, "room = max(len(prompt) + max_new_tokens - len(text) - 1, 0)", "room = max_new_tokens")
    lookahead_steps(model, prompt, n, said, decoder=bad)
    assert any(room != max(n - (len(text) - len(prompt)) - 1, 0) for _, text, room in said.said)


def pool_adds(monkeypatch, decoder, model, prompt, n):
    """Every n-gram the decoder's pool was given, and the tokens it emitted."""
    added = []

    class Recording(lookahead.Pool):
        def add(self, key, gram):
            added.append((key, *gram))
            super().add(key, gram)
    monkeypatch.setattr(decoder, "Pool", Recording)
    tokens = list(generate(decoder.decode(model, prompt, sampler=GREEDY, rng=Random(0), max_new_tokens=n,
                                          window=2, ngram=3, guesses=2), max_new_tokens=n))
    return set(added), tokens


def test_lookahead_pools_every_ngram_of_the_text_it_emits(monkeypatch):
    # Why: the pool's call site. Multi-token steps emit several n-grams at once; each must reach
    # the pool, or the guesses a repeated phrase should bring back are never made.
    model, prompt = tiny_llama(0, vocab=12), prompt_for(0, 6, 12) * 3    # a phrase that repeats
    added, tokens = pool_adds(monkeypatch, lookahead, model, prompt, 40)
    text = prompt + tokens
    assert all(tuple(text[i:i + 3]) in added for i in range(len(text) - 2))
    # the broken variant: only the n-gram ending at a step's last token is pooled
    bad = broken(lookahead, "pool.add_text(text, len(text) - len(out))", "pool.add_text(text, len(text) - 1)")
    added, tokens = pool_adds(monkeypatch, bad, model, prompt, 40)
    text = prompt + tokens
    assert not all(tuple(text[i:i + 3]) in added for i in range(len(text) - 2))


class ScriptedK:
    """Speculative's policy made to ask every K from 0 to `most` in turn."""

    def __init__(self, most):
        self.most, self.step = most, -1

    @property
    def k(self):
        self.step += 1
        return self.step % (self.most + 1)

    def update(self, k, accepted):
        pass


def spec_steps(target, draft, pol, n=60, decoder=speculative):
    return collect(decoder.decode(target, draft, [1, 2, 3], sampler=GREEDY, rng=Random(0), max_new_tokens=n,
                                  policy=pol), n)


def k_done_as_said(steps, said: Said, n: int) -> list[str]:
    """Where a step did not draft the K said (the prompt's step, plain's, is not asked)."""
    wrong, emitted = [] if steps[0].drafted == 0 else ["the prompt's step drafted"], len(steps[0].tokens)
    for i, (step, k, told) in enumerate(zip(steps[1:], said.said, said.told), 1):
        room = max(n - emitted - 1, 0)
        if step.drafted != min(k, room) or told != (step.drafted, step.accepted) or step.arm != f"K={step.drafted}":
            wrong.append(f"step {i}: said K={k} (room {room}), drafted {step.drafted}, told {told}")
        emitted += len(step.tokens)
    return wrong


@pytest.mark.parametrize("kind", ["real", "every K to 16"])
def test_speculative_drafts_the_k_its_policy_says(kind):
    # Why: the K the policy states is the K drafted (cut only by the budget), and it is told the
    # step's true K and acceptance; scripted, every K up to 16 is asked, beyond a tiny test's reach.
    target, draft = tiny_llama(0, n_layers=3), EarlyExit(2)
    inner = policy.draft_length(target, draft, Prices({1: 1.0, 32: 1.1})) if kind == "real" else ScriptedK(16)
    said = Said(inner)
    steps = spec_steps(target, draft, said, n=120)
    assert len(said.said) == len(said.told) == len(steps) - 1
    assert not k_done_as_said(steps, said, 120)
    if kind != "real":
        assert {s.drafted for s in steps} == set(range(17))
    want = run(plain, target, [1, 2, 3], 120)
    assert [t for s in steps for t in s.tokens][:120] == want


def test_a_k_not_as_said_is_caught():
    # the broken variant: the decoder drafts one more than the policy said, where it can
    target, draft = tiny_llama(0, n_layers=3), EarlyExit(2)
    said = Said(ScriptedK(6))
    bad = broken(speculative, "min(policy.k if policy else num_draft, max(end - n - 1, 0))",
                 "min((policy.k + 1) if policy else num_draft, max(end - n - 1, 0), 7)")
    assert k_done_as_said(spec_steps(target, draft, said, decoder=bad), said, 60)


def test_lookup_sends_the_copy_length_its_policy_says(monkeypatch):
    # Why: lookup asks the pricer how much of find()'s proposal to send: the step drafts exactly
    # that much, for every length the pricer can say, 0 to K (proposals made 8 tokens long:
    # a tiny model's text rarely yields them, and a guess need not be right).
    monkeypatch.setattr(lookup, "find", lambda text, ngram, k: ([1] * k, 1, 0))
    model, prompt = tiny_llama(0, vocab=3), prompt_for(3, 10, 3)
    lengths, said = iter(list(range(9)) * 20), []

    class Scripted(policy.CopyLength):
        def length(self, text, proposal, n, beat=1.0, room=None):
            said.append(min(next(lengths), len(proposal), room))
            return said[-1]
    steps = collect(lookup.decode(model, prompt, sampler=GREEDY, rng=Random(0), max_new_tokens=80,
                                  lookup_tokens=8, policy=Scripted(lambda k: 1.0)), 80)
    assert [s.drafted for s in steps] == said[:len(steps)] and set(said) == set(range(9))


# --------------------------------------------------------------------------- pinned boundaries

def test_a_copy_is_sent_only_when_it_beats_the_best_strictly():
    # Why: a fixed example at the boundary the drawn price lists only cross by luck: one guessed
    # token at the prior (1/2, after a two-token match) on a flat price list makes 1.5 tokens for 1 unit.
    copier = policy.CopyLength(lambda k: 1.0)
    assert copier.length([5, 6, 7, 5, 6], [7], 2, beat=1.5) == 0
    assert copier.length([5, 6, 7, 5, 6], [7], 2, beat=1.49) == 1
    assert copier.length([5, 6, 7, 5, 6], [7], 2, beat=1.0, room=0) == 0    # no budget left, no guess


def test_a_one_token_match_is_doubted_from_its_first_failure():
    # Why: the token after a one-token match agrees about 1 time in 5 (0.17 and 0.19 over two
    # prompt sets), so at a two-row price of 1.15 one failure must stop such copies, where a
    # two-token match's copy (prior 1/2) is still worth its row after one failure. Caught
    # broken variant: the prior 1/2 for every (n, j) (the one-token copy is sent again).
    cost = lambda k: 1 + 0.15 * (k - 1)
    one, two = policy.CopyLength(cost), policy.CopyLength(cost)
    assert one.length([5, 6, 5], [6], 1) == 1                             # p = 0.2: 1.2 / 1.15 > 1
    assert one.length([5, 6, 5, 9], [6], 1) == 0                          # 0.2 / 2 = 0.1: 1.1 / 1.15 < 1
    assert two.length([5, 6, 7, 5, 6], [7], 2) == 1
    assert two.length([5, 6, 7, 5, 6, 9, 5, 6], [7], 2) == 1              # 0.5 / 2: 1.25 / 1.15 > 1


def test_k_zero_probes_after_exactly_probe_plain_steps_then_twice_as_many():
    tuner = policy.DraftLength(0, 4, c_draft=0.9, c_verify=lambda k: 1.0, prior=0.1, probe=3)
    ks = []
    for _ in range(10):
        tuner.update(tuner.k, 0)                       # every draft rejected
        ks.append(tuner.k)
    assert ks == [0, 0, 1, 0, 0, 0, 0, 0, 0, 1]


def test_arms_choose_plain_until_exactly_their_wait_is_over():
    arms = policy.Arms(((0, 0), (1, 1)), cost=lambda k: 1 + 0.1 * (k - 1), n=3)   # W1 G1: 4 rows, c = 1.3
    assert arms.wait == [10**9, 30]
    assert [arms.choose() for _ in range(31)] == [0] * 30 + [1]


# --------------------------------------------------------------------------- prices = measurements

MEASURED = sorted(Path(__file__).parent.parent.glob("docs/forward-cost*.json"))


def fitted_slope(table: dict[int, float], most: int = 32) -> float:
    """Least squares through (1, 1) of cost(k) = 1 + slope (k - 1), for k <= most (a step's rows)."""
    ks = [k for k in table if 1 < k <= most]
    return sum((k - 1) * (table[k] - 1) for k in ks) / sum((k - 1) ** 2 for k in ks)


@pytest.mark.parametrize("path", MEASURED, ids=lambda p: p.name)
def test_the_fixed_slopes_are_the_measured_ones(path):
    # Why: without this machine's table the policy prices rows by SLOPE; each entry must be a
    # slope measured on such a CPU (docs/forward-cost*.json: tools.bench --forward-cost), not a
    # number derived from the constants under test. Margin: 0.03 a row (a table's own k = 8
    # and k = 32 points disagree by up to 0.02).
    d = json.loads(path.read_text())
    table = {int(k): r["ratio"] for k, r in d["forward_cost"]["engine"].items()}
    assert abs(policy.SLOPE[d["linear"], d["machine"]["dispatch"]] - fitted_slope(table)) <= 0.03
    if "naive" in d["forward_cost"]:   # --naive: the same model on nn.Linear, beside it
        table = {int(k): r["ratio"] for k, r in d["forward_cost"]["naive"].items()}
        assert abs(policy.SLOPE["Linear", d["machine"]["dispatch"]] - fitted_slope(table)) <= 0.03


def measured_kinds() -> set[tuple[str, str]]:
    kinds = set()
    for path in MEASURED:
        d = json.loads(path.read_text())
        kinds |= {(d["linear"], d["machine"]["dispatch"])} | \
            ({("Linear", d["machine"]["dispatch"])} if "naive" in d["forward_cost"] else set())
    return kinds


def test_every_fixed_slope_has_a_measurement(monkeypatch):
    # Why: a constant no table pins is a guess the test above never reads (the int4 AVX512 slope
    # was 0.08 so, against a measured 0.17). CUDA's is said to be unmeasured. Broken variant: a
    # slope added without its table
    assert set(policy.SLOPE) - {("cuda", "")} <= measured_kinds()
    monkeypatch.setitem(policy.SLOPE, ("Int4Linear", "AVX512_BF16"), 0.1)
    assert not set(policy.SLOPE) - {("cuda", "")} <= measured_kinds()


def test_the_fixed_draft_prices_are_the_measured_ones():
    # Why: a 4-bit draft's price by dispatch is a measured one-row time ratio (docs/draft-price.json)
    d = json.loads((Path(__file__).parent.parent / "docs/draft-price.json").read_text())
    for m in d["measured"]:
        assert policy.DRAFT_COST["Int4Linear", m["dispatch"]] == pytest.approx(m["draft_cost"], abs=0.03)


def test_a_slope_not_measured_is_caught(monkeypatch):
    # the broken variant: an AVX2 oneDNN slope guessed from one noisy run (8 rows 1.74x, the
    # value this table once held) disagrees with the kept measurement
    monkeypatch.setitem(policy.SLOPE, ("PackedLinear", "AVX2"), 0.10)
    with pytest.raises(AssertionError):
        test_the_fixed_slopes_are_the_measured_ones(Path(__file__).parent.parent / "docs/forward-cost.json")


def copier_calls(module, text: list[int], rooms) -> list[tuple]:
    """(beat, room, best arm value) of each call lookahead's policy makes to its copy pricer."""
    pol = module.Lookahead(lambda k: 1 + 0.02 * (k - 1), 4)
    calls, length = [], pol.copier.length
    pol.copier.length = lambda t, full, n, beat=1.0, room=None: (
        calls.append((beat, room, pol.arms.best())), length(t, full, n, beat, room))[1]
    for i, room in enumerate(rooms):
        pol.choose(text[:8 + i], room)
        pol.update(2, 7)
    return calls


def test_lookaheads_policy_prices_a_copy_against_its_best_arm_and_the_room_left():
    # Why: the pricer's call site inside the policy: a copy must beat the best arm tried so far
    # (not plain's 1 alone), and never run past the budget the decoder says is left
    text, rooms = [1, 2, 3, 1, 2, 3, 1, 2] * 6, [9, 5, 0, 3] * 5
    calls = copier_calls(policy, text, rooms)
    assert [(b, r) for b, r, _ in calls] == [(best, r) for (_, _, best), r in zip(calls, rooms)]
    # the broken variant: priced against plain's 1 and an unbounded room
    bad = broken(policy, "copy = full[:self.copier.length(text, full, m, self.arms.best(), room)]",
                 "copy = full[:self.copier.length(text, full, m, 1.0, None)]")
    calls = copier_calls(bad, text, rooms)
    assert [(b, r) for b, r, _ in calls] != [(best, r) for (_, _, best), r in zip(calls, rooms)]
