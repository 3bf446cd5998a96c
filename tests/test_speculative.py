"""Speculative decoding changes the speed, never the text: greedy output is plain greedy's,
coupled output is plain sampling's with the same seed, whatever the draft and K.
(The exact law of "rejection" is proven by enumeration in test_proofs.py.)"""
import copy

import pytest
import torch
from hypothesis import given, strategies as st

from conftest import DEVICE, tiny_llama
from engine import speculative
from conftest import int4_copy
from engine.adapt.policy import DraftLength
from engine.draft import SeparatePair
from engine.draft import EarlyExit, Ngram, NgramPair
from engine.generate import Stats, generate, plain
from engine.llama import LlamaConfig
from engine.sampling import Random, Sampler
from engine.speculative import decode

GREEDY = Sampler()


def near_copy(target, seed, eps=0.05):
    """The target with every weight jittered: a draft that agrees often but not always."""
    draft, g = copy.deepcopy(target), torch.Generator().manual_seed(seed)
    for p in draft.parameters():
        p.add_(eps * p.std() * torch.randn(p.shape, generator=g, dtype=p.dtype).to(p.device))
    return draft


def make_pair(kind, seed):
    """(target, draft) of one of six kinds: a stranger, a near copy, an early exit, the
    target's own weights in 4 bits (bf16 activations: a draft that rounds apart from it), the
    text's n-grams (n = 1..3: a draft that proposes only where the text repeats), and the
    n-grams with a near copy proposing where the text does not repeat."""
    if kind == "int4":
        target = tiny_llama(seed % 5, n_layers=2 + seed % 2, hidden=64)
        return target, int4_copy(target)
    target = tiny_llama(seed % 5, n_layers=3 + seed % 2)
    if kind == "other":
        return target, tiny_llama(seed % 5 + 7)
    if kind == "near":
        return target, near_copy(target, seed)
    if kind == "ngram":
        return target, Ngram(1 + seed % 3, least=1 + seed % 2)
    if kind == "ngram+model":
        return target, Ngram(1 + seed % 3, least=1 + seed % 2, otherwise=near_copy(target, seed))
    return target, EarlyExit(1 + seed % target.config.n_layers)    # layers:L, L < n_layers or all


def run(steps, budget, eos=(), stats=None):
    return list(generate(steps, max_new_tokens=budget, eos_ids=eos, stats=stats))


def same_as_plain(kind, seed, K, P, budget, sampler=GREEDY, verify="rejection", **knobs):
    target, draft = make_pair(kind, seed)
    prompt = torch.randint(0, 16, (P,), generator=torch.Generator().manual_seed(seed)).tolist()
    want = run(plain(target, prompt, sampler=sampler, rng=Random(seed), max_new_tokens=budget), budget)
    got = run(decode(target, draft, prompt, sampler=sampler, rng=Random(seed), max_new_tokens=budget,
                     num_draft=K, verify=verify, **knobs), budget)
    return got == want


KINDS = st.sampled_from(["other", "near", "self", "ngram", "ngram+model"] + (["int4"] if DEVICE.type == "cpu" else []))  # int4: CPU only


# --------------------------------------------------------------------------- greedy

@given(kind=KINDS, seed=st.integers(0, 2**16), K=st.integers(1, 5), P=st.integers(1, 6),
       budget=st.integers(1, 12), verify=st.sampled_from(["rejection", "coupled"]))
def test_speculative_greedy_equals_target_greedy(kind, seed, K, P, budget, verify):
    # Why: at temperature 0, p and q are one-hot; a draft may only change how fast we get there.
    assert same_as_plain(kind, seed, K, P, budget, verify=verify)


@given(kind=KINDS, seed=st.integers(0, 2**16), K=st.integers(1, 5), P=st.integers(1, 6))
def test_adaptive_k_gives_the_greedy_tokens(kind, seed, K, P):
    # Why: a policy picks K per step from the acceptance seen; whatever it picks, the tokens
    # are fixed. Its costs here make every K from 0 to 6 worth a try.
    assert same_as_plain(kind, seed, K, P, 12, policy=DraftLength(K, 6, 0.3, lambda k: 1.0 + 0.05 * k))


def test_eos_inside_a_step_cuts_the_step_there():
    # Why: a step emits up to K+1 tokens; an EOS among them must end the text right after it.
    target, draft = make_pair("near", 0)
    budget = 24
    want = run(plain(target, [1, 2], sampler=GREEDY, rng=Random(0), max_new_tokens=budget), budget)
    steps = decode(target, draft, [1, 2], sampler=GREEDY, rng=Random(0), max_new_tokens=budget, num_draft=5)
    flat, eos = [], None
    for step in steps:                 # EOS := a token first seen inside a step, not at its end
        firsts = [x for j, x in enumerate(step.tokens[:-1]) if x not in flat + step.tokens[:j]]
        eos = firsts[0] if eos is None and firsts else eos
        flat += step.tokens
        if len(flat) >= budget:
            break
    assert flat[:budget] == want and eos is not None
    cut = want[:want.index(eos) + 1]
    assert run(decode(target, draft, [1, 2], sampler=GREEDY, rng=Random(0), max_new_tokens=budget,
                      num_draft=5), budget, eos=[eos]) == cut
    assert len(cut) < budget


@given(kind=KINDS, seed=st.integers(0, 2**16), K=st.integers(1, 5), budget=st.integers(1, 10))
def test_steps_never_overshoot_the_budget(kind, seed, K, budget):
    # Why: K shrinks near the end of the budget, so no forward computes tokens nobody reads,
    # and the caches (sized prompt + budget + K + 1) never overflow.
    target, draft = make_pair(kind, seed)
    steps = decode(target, draft, [3], sampler=GREEDY, rng=Random(0), max_new_tokens=budget, num_draft=K)
    emitted = 0
    while emitted < budget:
        emitted += len(next(steps).tokens)
    assert emitted == budget


@given(kind=KINDS, seed=st.integers(0, 2**16), P=st.integers(1, 4), verify=st.sampled_from(["rejection", "coupled"]),
       temperature=st.sampled_from([0.5, 1.0, 1.5]))
def test_k_zero_steps_are_plain_sampling_with_the_same_seed(kind, seed, P, verify, temperature):
    # Why: adaptive K spends most steps at K = 0 when the draft does not pay; such a step must
    # be a plain step, token for token with plain's seed, under either verification.
    assert same_as_plain(kind, seed, 0, P, 10, sampler=Sampler(temperature), verify=verify)


def test_a_self_drafts_k_zero_step_is_the_targets_own_forward(monkeypatch):
    # Why: a K = 0 step of a self-draft drafts nothing, so it is plain's step: one forward of the
    # whole stack (under --compile, plain's own graph rather than the two halves'), with plain's
    # tokens. Caught broken variant: sending it through the early exit's halves (lower ran)
    monkeypatch.setattr("engine.draft.lower", lambda *a: pytest.fail("a K = 0 step ran the early exit"))
    assert same_as_plain("self", 3, 0, 5, 12)                   # EarlyExit(2) of 2 layers, then 1
    assert same_as_plain("self", 4, 0, 5, 12)


def test_k_zero_test_catches_a_plain_step_drawn_with_another_key(monkeypatch):
    # Why: a K = 0 step drawing with the draft's key would still sample the target's law, but
    # not plain's tokens for the seed; the test above must see it (plain keeps the right key).
    class Skewed(Sampler):
        def draw(self, logits, rng, stream, position):
            return super().draw(logits, rng, "draft", position)
    real = speculative.decode
    monkeypatch.setattr(speculative, "decode", lambda *a, sampler, **k: real(*a, sampler=Skewed(sampler.temperature), **k))
    monkeypatch.setitem(globals(), "decode", speculative.decode)
    inner = test_k_zero_steps_are_plain_sampling_with_the_same_seed.hypothesis.inner_test
    with pytest.raises(AssertionError):
        for seed in range(5):
            inner(kind="self", seed=seed, P=2, verify="rejection", temperature=1.0)


# --------------------------------------------------------------------------- coupled sampling

@given(kind=KINDS, seed=st.integers(0, 2**16), K=st.integers(1, 5), P=st.integers(1, 4),
       temperature=st.sampled_from([0.5, 1.0, 1.5]), top_k=st.sampled_from([0, 3, 8]),
       top_p=st.sampled_from([1.0, 0.9, 0.6]))
def test_coupled_sampling_is_plain_sampling_with_the_same_seed(kind, seed, K, P, temperature, top_k, top_p):
    # Why: the draft draws x_t with plain's key ("token", t) and the target keeps it only if its
    # own draw with that key agrees, so every emitted token is the one plain sampling draws.
    sampler = Sampler(temperature=temperature, top_k=top_k, top_p=top_p)
    assert same_as_plain(kind, seed, K, P, 12, sampler=sampler, verify="coupled")


def test_coupled_accepts_drafts_from_a_good_draft():
    # Why: seed identity alone would also hold for a verifier that rejects every draft.
    target, draft = make_pair("near", 1)
    stats = Stats()
    run(decode(target, draft, [5], sampler=Sampler(temperature=1.0), rng=Random(1), max_new_tokens=30,
               verify="coupled"), 30, stats=stats)
    assert stats.accepted > stats.drafted / 2 and stats.n_forwards < 20


# --------------------------------------------------------------------------- rejection branches

class Bigram(torch.nn.Module):
    """litgpt-style fake LM: the logits after token x are table[x], whatever came before."""

    def __init__(self, table):
        super().__init__()
        V = table.shape[-1]
        self.config = LlamaConfig(dim=4, n_layers=1, n_heads=1, n_kv_heads=1, hidden_dim=4, vocab_size=V)
        self.tok_embeddings = torch.nn.Embedding(V, 4)
        self.table = table                                                    # (V, V)

    def forward(self, tokens, positions, cache, keep):
        cache.length += tokens.shape[1]
        return self.table[tokens][:, torch.as_tensor(keep).remainder(tokens.shape[1])]  # (1, ., V)


def bigram(seed, support, V=6):
    table = torch.randn(V, V, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    off = torch.ones(V, dtype=torch.bool)
    off[support] = False
    return Bigram(table.masked_fill(off, float("-inf")))


@pytest.mark.parametrize("seed", range(5))
def test_rejection_accepts_every_draft_when_p_equals_q(seed):
    # Why: accept w.p. min(1, p/q) = 1; the residual (p - q)+ = 0 must never be reached, and the
    # bonus is drawn from p_K with plain's key ("token", n + K).
    lm, sampler, rng, K = bigram(seed, [0, 1, 2, 3, 4, 5]), Sampler(temperature=1.0), Random(seed), 3
    steps = decode(lm, lm, [0], sampler=sampler, rng=rng, max_new_tokens=20, num_draft=K)
    first = next(steps)                                  # the prompt's step: plain's draw
    assert first.drafted == 0 and first.tokens == [rng.categorical(sampler.probs(lm.table[0]), "token", 1)]
    seq = [0] + first.tokens
    for _ in range(4):
        step = next(steps)
        assert step.accepted == step.drafted == K and len(step.tokens) == K + 1
        for i, x in enumerate(step.tokens[:-1]):     # drafts: ("draft", t) draws from q
            assert x == rng.categorical(sampler.probs(lm.table[seq[-1]]), "draft", len(seq))
            seq.append(x)
        assert step.tokens[-1] == rng.categorical(sampler.probs(lm.table[seq[-1]]), "token", len(seq))
        seq.append(step.tokens[-1])


@pytest.mark.parametrize("seed", range(5))
def test_rejection_resamples_the_residual_when_supports_are_disjoint(seed):
    # Why: p(x) = 0 on every draft, so each is rejected and the token comes from
    # norm((p - q)+) = p, drawn with the key ("residual", n).
    target, draft, sampler, rng = bigram(seed, [3, 4, 5]), bigram(seed + 9, [0, 1, 2]), Sampler(1.0), Random(seed)
    seq = [0]
    steps = decode(target, draft, [0], sampler=sampler, rng=rng, max_new_tokens=20, num_draft=4)
    for step in generate(steps, max_new_tokens=8):      # K is never cut short by the budget here
        p = sampler.probs(target.table[seq[-1]])        # the prompt's step is plain's draw
        assert step in (3, 4, 5) and step == rng.categorical(p, "token" if len(seq) == 1 else "residual", len(seq))
        seq.append(step)


# --------------------------------------------------------------------------- errors, the tuner

def test_a_draft_with_another_vocab_is_a_clear_error():
    # Why: a draft token id must mean the same string to the target; a mismatch fails up front,
    # when decode() is called, not at the first next().
    with pytest.raises(ValueError, match="vocab"):
        decode(tiny_llama(0), tiny_llama(1, vocab=32), [1], sampler=GREEDY, rng=Random(0), max_new_tokens=4)
    with pytest.raises(ValueError, match="layers"):
        decode(tiny_llama(0), EarlyExit(3), [1], sampler=GREEDY, rng=Random(0), max_new_tokens=4)
    with pytest.raises(ValueError, match="verify"):
        decode(tiny_llama(0), EarlyExit(1), [1], sampler=GREEDY, rng=Random(0), max_new_tokens=4, verify="x")


# --------------------------------------------------------------------------- the tests have teeth

def accept_blindly(first, rows, candidates, sampler, rng, position):
    # greedy verification is the match (one-hot p and q: rejection's own answer); this one keeps
    # every draft and adds the bonus after the last
    drafts = candidates[0].tolist()
    return drafts + [int((rows[0, -1] if drafts else first).argmax())], 0


def forget_draft_rollback(self, n):
    self.tcache.truncate(n)                              # the draft keeps its rejected drafts


def keep_one_stale_slot(self, n):                        # the first rejected draft's K/V stay
    self.tcache.truncate(min(n + 1, self.tcache.length))  # where the corrected token's belong
    self.dcache.truncate(min(n, self.dcache.length))


MUTANTS = {
    "accept without comparing": ("verify_match", accept_blindly),
    "draft cache not truncated": ("SeparatePair.rollback", forget_draft_rollback),
    "truncate one slot too late": ("SeparatePair.rollback", keep_one_stale_slot),
    "verify rows off by one": ("SeparatePair.verify", lambda self, tokens, positions, rows: self.target(
        tokens, positions, self.tcache, keep=torch.arange(-rows - 1, -1))[0]),
}


def caught(*case):
    try:
        return not same_as_plain(*case)
    except (RuntimeError, ValueError, IndexError):       # a crash is a failing test too
        return True


@pytest.mark.parametrize("mutant", MUTANTS)
def test_greedy_equality_catches_broken_variants(mutant, monkeypatch):
    # Why: a property that a wrong decoder also passes proves nothing.
    name, fake = MUTANTS[mutant]
    owner = SeparatePair if "." in name else speculative
    monkeypatch.setattr(owner, name.split(".")[-1], fake)
    assert any(caught(kind, seed, 4, 3, 12) for kind in ("other", "near") for seed in range(4))


@pytest.mark.parametrize("K", [1, 3])
def test_draft_forwards_counts_the_drafts_forwards(K):
    # Why: the stats line's "draft forwards" is what a reader weighs a draft's cost by; it must
    # count the draft model's forwards, one per drafted token and one on the prompt's step (the
    # draft reads the prompt there, as the target does). Caught broken variant: a step
    # reporting K + 1 draft forwards
    target, draft = tiny_llama(0, vocab=16), tiny_llama(3, vocab=16, n_layers=1)
    calls = []
    draft.register_forward_hook(lambda *_: calls.append(1))
    stats = Stats()
    list(generate(decode(target, draft, [1, 2, 3, 1, 2], sampler=Sampler(), rng=Random(0), max_new_tokens=12,
                         num_draft=K), max_new_tokens=12, stats=stats))
    assert stats.draft_forwards == len(calls) == stats.drafted + 1 > 1


@pytest.mark.parametrize("beside_ngrams", [False, True])
def test_a_draft_model_reads_the_prompt_on_the_prompts_step(beside_ngrams):
    # Why: the prompt's step is prompt time (generate.Stats: prefill); a draft that reads the
    # prompt there, as the target does (and as llama-speculative counts it), leaves decoding's
    # rate to decoding. Each later draft forward reads at most the two tokens it lacks.
    # Caught broken variant: the draft fed lazily, its first forward the prompt and a token,
    # inside the first drafting step
    target, draft = tiny_llama(0, vocab=16), tiny_llama(3, vocab=16, n_layers=1)
    prompt, rows = [1, 2, 3, 4, 5, 6, 7], []
    draft.register_forward_hook(lambda m, args, out: rows.append(args[0].shape[1]))
    second = Ngram(otherwise=draft) if beside_ngrams else draft
    after = []                                   # draft forwards so far, after each step

    def watch(steps):
        for step in steps:
            after.append(len(rows))
            yield step
    list(generate(watch(decode(target, second, prompt, sampler=Sampler(), rng=Random(0), max_new_tokens=12,
                               num_draft=3)), max_new_tokens=12))
    assert after[0] == 1 and rows[0] == len(prompt)
    assert len(rows) > 1 and max(rows[1:]) <= 2


# --------------------------------------------------------------------------- the policy's K is the K drafted

class Planned:
    """A policy that asks for a planned K on each step after the prompt's, recording each ask."""

    def __init__(self, plan):
        self.plan, self.asked, self.most = plan, [], max(plan)

    @property
    def k(self):
        self.asked.append(self.plan[len(self.asked) % len(self.plan)])
        return self.asked[-1]

    def update(self, k, accepted):
        pass


def drafted_against_asked(kind, seed, temperature=1.0, budget=24):
    """[(K drafted, K the policy asked, cut to the tokens left but one)] of each step after the
    prompt's, sampled: a draft is unsure there, which is where a cut would hide."""
    target, draft = make_pair(kind, seed)
    policy = Planned([3, 1, 4, 0, 2])
    steps = decode(target, draft, [1, 2, 3], sampler=Sampler(temperature), rng=Random(seed),
                   max_new_tokens=budget, policy=policy, trace=True)
    pairs, n = [], 0
    for step in generate_steps(steps, budget):
        if not step.trace["first"]:
            left = budget - n
            pairs.append((step.trace["k"], min(policy.asked[len(pairs)], max(left - 1, 0))))
        n += len(step.tokens)
    return pairs


def generate_steps(steps, budget):
    """The steps a run of `budget` tokens takes, each whole (a decoder never drafts past it)."""
    n = 0
    for step in steps:
        yield step
        n += len(step.tokens)
        if n >= budget:
            return


@pytest.mark.parametrize("kind", ["other", "near", "self"])
def test_each_sampled_step_drafts_the_k_its_policy_chose(kind):
    # Why: K is the policy's speed lever, and any K keeps the law, so neither the law proofs nor
    # the tokens see a step that drafts fewer than it was told (say, stopping once the draft is
    # unsure); greedy runs cannot see it either, a greedy draft being sure by construction
    for seed in range(3):
        pairs = drafted_against_asked(kind, seed)
        assert len(pairs) >= 5 and all(drafted == asked for drafted, asked in pairs), pairs


def test_the_k_contract_catches_a_step_that_drafts_less_when_sampling(monkeypatch):
    # the broken variant: one draft fewer whenever the law is not one-hot (sampled, K > 1)
    real = speculative.draft_then_verify
    monkeypatch.setattr(speculative, "draft_then_verify", lambda pair, seq, k, sampler, rng, stream, **how:
                        real(pair, seq, k - 1 if k > 1 and not sampler.greedy else k, sampler, rng, stream, **how))
    pairs = drafted_against_asked("near", 0)
    assert any(drafted != asked for drafted, asked in pairs)
    assert all(d == a for d, a in drafted_against_asked("near", 0, temperature=0.0))   # greedy: unseen


def test_a_model_beside_the_ngrams_runs_only_where_the_text_has_no_match_and_catches_up():
    # Why: beside the n-grams the model is run only where the text has no match; then it is fed
    # every token it missed, so its law is the model's on the whole text, as a fresh forward's
    target, draft = tiny_llama(0), tiny_llama(1)
    pair = NgramPair(target, Ngram(2, otherwise=draft), capacity=32, scratch=4)
    ids = lambda *t: torch.tensor([t])
    pair.propose(ids(1, 2, 3), torch.arange(3))                        # no match: the model, fed 1 2 3
    guess = pair.propose(ids(1, 2), torch.arange(3, 5))                # 1 2 came before: the text's 3
    assert pair.forwards == 1 and GREEDY.probs(guess).argmax() == 3
    a = pair.propose(ids(6), torch.arange(5, 6))                       # 2 6: the model again, fed 1 2 6
    fresh = draft(ids(1, 2, 3, 1, 2, 6), torch.arange(6))[0, -1]
    assert pair.forwards == 2 and torch.allclose(a, fresh, rtol=0, atol=1e-9)
    pair.cache.length = 6                                              # as if the target had checked them
    pair.rollback(4)                                                   # both caches forget slot 4 on
    assert (pair.cache.length, pair.mcache.length, pair.text) == (4, 4, [1, 2, 3, 1])


def test_a_model_beside_the_ngrams_fed_only_the_last_token_is_caught(monkeypatch):
    # the broken variant: the model fed only the newest token after the n-grams' stretch
    target, draft = tiny_llama(0), tiny_llama(1)
    pair = NgramPair(target, Ngram(2, otherwise=draft), capacity=32, scratch=4)
    ids = lambda *t: torch.tensor([t])
    pair.propose(ids(1, 2, 3), torch.arange(3))
    pair.propose(ids(1, 2), torch.arange(3, 5))
    pair.mcache.length, pair.text = 3, pair.text[:3] + pair.text[4:]  # as if slot 3's token were never fed
    a = pair.propose(ids(6), torch.arange(5, 6))
    fresh = draft(ids(1, 2, 3, 1, 2, 6), torch.arange(6))[0, -1]
    assert not torch.allclose(a, fresh, rtol=0, atol=1e-9)


def test_an_ngram_draft_proposes_the_token_after_the_texts_latest_match_and_no_forward():
    # Why: the text's n-grams are a draft with no model: where the last tokens occurred before it
    # guesses what followed them (a one-hot law), and where they did not it is silent and the
    # step is plain's. Its steps draft at most K (the policy's bound) and run no draft forward.
    target = tiny_llama(0)
    pair = NgramPair(target, Ngram(3), capacity=32, scratch=4)
    ids = lambda *t: torch.tensor([t])
    a = pair.propose(ids(3, 4, 5, 6, 3, 4, 5), torch.arange(7))     # 6 followed 3 4 5
    assert GREEDY.probs(a).argmax() == 6 and Sampler(1.3, top_p=0.5).probs(a)[6] == 1.0
    assert pair.propose(ids(9), torch.arange(7, 8)) is None            # 9 never came before
    assert NgramPair(target, Ngram(3), 32, 4).propose(ids(3, 4, 5, 6, 2, 5), torch.arange(6)) is None  # one token: too short
    latest = NgramPair(target, Ngram(3, least=1), 32, 4).propose(ids(3, 4, 5, 6, 3, 4, 9, 3), torch.arange(8))
    assert latest.argmax() == 4                                        # of two 3s, the latest's next
    stats = Stats()
    steps = decode(target, Ngram(2, least=1), [1, 2, 1, 2, 1], sampler=GREEDY, rng=Random(0), max_new_tokens=24, num_draft=3)
    for step in steps:
        assert step.drafted <= 3 and step.draft_forwards == 0
        stats.drafted += step.drafted
        if stats.drafted > 6:
            break
    assert stats.drafted > 6                   # tiny models repeat themselves: it drafted


def test_the_amateur_is_never_the_texts_ngrams():
    # Why: contrastive weighs the amateur's whole law against the expert's; n-grams have none
    from engine import contrastive
    with pytest.raises(ValueError, match="amateur is a model"):
        next(contrastive.decode(tiny_llama(0), Ngram(3), [1, 2], sampler=GREEDY, rng=Random(0), max_new_tokens=2))
