"""Contrastive decoding: the score formulas, the plausibility mask, and the decoders built on
them. Greedy speculative contrastive decoding must equal greedy contrastive decoding token for
token, with a separate amateur and with an early exit of the expert."""
import math

import pytest
import torch
from hypothesis import example, given, strategies as st

from conftest import DEVICE, tiny_llama
from engine import contrastive
from engine.draft import EarlyExit
from engine.generate import generate, plain
from engine.sampling import Random, Sampler

GREEDY = Sampler()


def random_logits(seed, rows=4, V=16):
    # scales from flat to peaked, so the mask keeps anything from one token to all of them
    g = torch.Generator().manual_seed(seed)
    scale = torch.rand(rows, 1, generator=g, dtype=torch.float64) * 8
    return torch.randn(rows, V, generator=g, dtype=torch.float64) * scale    # (rows, V)


def run(expert, amateur, prompt, n, **knobs):
    knobs.setdefault("sampler", GREEDY)
    knobs.setdefault("rng", Random(0))
    steps = contrastive.decode(expert, amateur, prompt, max_new_tokens=n, **knobs)
    return list(generate(steps, max_new_tokens=n))


def amateur_for(kind, seed):
    # a separate, smaller-and-different Llama, or the expert's first layer (early exit)
    return tiny_llama(seed + 1, n_layers=1) if kind == "model" else EarlyExit(1)


# --------------------------------------------------------------------------- the scores

def check_mask_keeps_expert_argmax(seed, alpha, form):
    e, a = random_logits(seed), random_logits(seed + 1)
    s = contrastive.scores(e, a, alpha, 0.5, form)
    assert torch.isfinite(s.gather(-1, e.argmax(-1, keepdim=True))).all()
    p = e.softmax(-1)
    assert torch.equal(torch.isfinite(s), p >= alpha * p.amax(-1, keepdim=True))


def check_logit_form_by_hand():
    # the amateur loves token 0, so the contrast moves the pick to token 1:
    # 1.5 * [2, 1.5, 0] - 0.5 * [3, 0, 0] = [1.5, 2.25, 0]
    e, a = torch.tensor([2.0, 1.5, 0.0]), torch.tensor([3.0, 0.0, 0.0])
    s = contrastive.scores(e, a, alpha=0.0, beta=0.5, form="logit")
    torch.testing.assert_close(s, torch.tensor([1.5, 2.25, 0.0], dtype=torch.float64))
    assert int(s.argmax()) == 1 and int(e.argmax()) == 0
    # tau = 0.5 doubles the amateur's logits: 1.5 * [2, 1.5, 0] - 0.5 * [6, 0, 0] = [0, 2.25, 0]
    s = contrastive.scores(e, a, alpha=0.0, beta=0.5, form="logit", amateur_temperature=0.5)
    torch.testing.assert_close(s, torch.tensor([0.0, 2.25, 0.0], dtype=torch.float64))


@given(seed=st.integers(0, 2**16), alpha=st.floats(0, 1), form=st.sampled_from(["logit", "ratio"]))
@example(seed=0, alpha=1.0, form="logit")   # the boundary: the argmax alone, kept by ">=" only
@example(seed=0, alpha=0.0, form="ratio")   # every token
def test_plausibility_mask_keeps_the_expert_argmax(seed, alpha, form):
    # Why: V_head is never empty, so a token can always be emitted, and it is the set the
    # papers define: p_E(x) >= alpha * max p_E, computed from the expert alone. Caught broken
    # variant (pinned by the alpha = 1 example, not left to a random draw): "<=" for "<" in the
    # cutoff, which drops the argmax itself at alpha = 1
    check_mask_keeps_expert_argmax(seed, alpha, form)


@given(seed=st.integers(0, 2**16), alpha=st.floats(0, 1), beta=st.floats(0, 2))
def test_logit_form_with_the_expert_as_amateur_returns_the_expert_logits(seed, alpha, beta):
    # Why: (1 + beta) l - beta l = l: an amateur that knows what the expert knows removes nothing.
    e = random_logits(seed)
    s = contrastive.scores(e, e, alpha, beta, "logit")
    keep = torch.isfinite(s)
    torch.testing.assert_close(s[keep], e[keep], atol=1e-12, rtol=0)


@given(seed=st.integers(0, 2**16), form=st.sampled_from(["logit", "ratio"]))
def test_a_constant_added_to_either_row_changes_nothing(seed, form):
    # Why: logits are defined up to a per-row constant; the contrastive law must not see it.
    e, a = random_logits(seed), random_logits(seed + 1)
    c = random_logits(seed + 2)[:, :1] * 10                                 # (rows, 1)
    sampler = Sampler(temperature=0.7, top_k=8, top_p=0.9)
    want = sampler.probs(contrastive.scores(e, a, 0.1, 0.5, form))
    for e2, a2 in [(e + c, a), (e, a - c)]:
        got = sampler.probs(contrastive.scores(e2, a2, 0.1, 0.5, form))
        torch.testing.assert_close(got, want, atol=1e-12, rtol=0)


def test_ratio_form_matches_a_hand_computation():
    # Why: pin Li et al.'s score, log p_E - log p_A with p_A = softmax(l_A / tau), and the mask.
    e, a, tau = [2.0, 1.0, 0.0, -3.0], [1.0, 1.0, 1.0, 0.0], 0.5
    # p_E(x) / max p_E = exp(l_E(x) - 2) = [1, .37, .14, .007]: alpha = 0.1 drops token 3 only
    s = contrastive.scores(torch.tensor(e), torch.tensor(a), 0.1, 0.5, "ratio", tau)
    lse_e = math.log(sum(math.exp(x) for x in e))
    lse_a = math.log(sum(math.exp(x / tau) for x in a))
    want = [(x - lse_e) - (y / tau - lse_a) for x, y in zip(e[:3], a[:3])] + [-math.inf]
    torch.testing.assert_close(s, torch.tensor(want, dtype=torch.float64), atol=1e-12, rtol=0)
    # the amateur is flat on tokens 0..2, so the gaps are the expert's: 1 and 1
    assert torch.allclose(s[:2] - s[1:3], torch.ones(2, dtype=torch.float64))


def test_logit_form_matches_a_hand_computation():
    # Why: pin O'Brien & Lewis's (1 + beta) l_E - beta l_A / tau, sign of beta included.
    check_logit_form_by_hand()


def test_broken_variants_are_caught(monkeypatch):
    # Why: the checks above must have teeth; each plausible bug below has to trip one of them.
    right = contrastive.scores

    def mask_from_amateur(e, a, alpha=0.1, beta=0.5, form="logit", tau=1.0):
        s = right(e, a, 0.0, beta, form, tau)
        return s.masked_fill(a < a.amax(-1, keepdim=True) + math.log(max(alpha, 1e-300)), -math.inf)

    def beta_flipped(e, a, alpha=0.1, beta=0.5, form="logit", tau=1.0):
        # (1 - beta) l_E + beta l_A / tau: the knob check refuses beta < 0, so flip by hand
        return (1 - beta) * right(e, a, alpha, 0.0, form, tau) + beta * a.double() / tau

    def caught(check, *args):
        try:
            check(*args)
        except AssertionError:
            return True
        return False

    monkeypatch.setattr(contrastive, "scores", mask_from_amateur)
    assert any(caught(check_mask_keeps_expert_argmax, seed, 0.5, "logit") for seed in range(20))
    monkeypatch.setattr(contrastive, "scores", beta_flipped)
    assert caught(check_logit_form_by_hand)
    # and the decoder must really go through `scores`: with the broken mask it leaves the
    # expert's greedy path even at beta = 0
    monkeypatch.setattr(contrastive, "scores", mask_from_amateur)
    expert, prompt = tiny_llama(0), [1, 2, 3]
    want = list(generate(plain(expert, prompt, sampler=GREEDY, rng=Random(0), max_new_tokens=12),
                         max_new_tokens=12))
    assert run(expert, amateur_for("model", 0), prompt, 12, alpha=0.9, beta=0.0) != want


# --------------------------------------------------------------------------- the decoders

@given(seed=st.integers(0, 2**16), kind=st.sampled_from(["model", "layers"]),
       speculative=st.booleans())
def test_contrastive_beta0_equals_expert_greedy(seed, kind, speculative):
    # Why: with beta = 0 the logit form is the expert's own logits (masked around their
    # argmax), so CD must reduce to the baseline decoder token for token.
    expert = tiny_llama(seed % 3, n_layers=2)
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, 16, (1 + seed % 5,), generator=g).tolist()
    want = list(generate(plain(expert, prompt, sampler=GREEDY, rng=Random(0), max_new_tokens=10),
                         max_new_tokens=10))
    got = run(expert, amateur_for(kind, seed % 3), prompt, 10, beta=0.0, speculative=speculative,
              num_draft=1 + seed % 4)
    assert got == want


@given(seed=st.integers(0, 2**16), K=st.integers(1, 5), kind=st.sampled_from(["model", "layers"]),
       form=st.sampled_from(["logit", "ratio"]))
def test_speculative_greedy_equals_contrastive_greedy(seed, K, kind, form):
    # Why: SCD verifies the amateur's drafts against the contrastive law; greedy, that law is a
    # point mass, so SCD must emit exactly CD's tokens, however many drafts it accepts.
    expert, amateur = tiny_llama(seed % 3), amateur_for(kind, seed % 3)
    prompt = [seed % 16, (seed // 16) % 16]
    knobs = dict(alpha=0.05, beta=1.0, form=form, amateur_temperature=0.5 + seed % 3 / 2)
    want = run(expert, amateur, prompt, 14, **knobs)
    assert run(expert, amateur, prompt, 14, speculative=True, num_draft=K, **knobs) == want


def test_amateur_equal_to_expert_accepts_every_draft():
    # Why: the drafts must really be verified against the right rows. With the expert as its
    # own amateur and beta = 0, q == p_CD greedy, so each step emits K + 1 tokens.
    expert, K = tiny_llama(0), 3
    steps = contrastive.decode(expert, tiny_llama(0), [1, 2], sampler=GREEDY, rng=Random(0),
                               max_new_tokens=13, beta=0.0, speculative=True, num_draft=K)
    assert [len(next(steps).tokens) for _ in range(4)] == [1] + [K + 1] * 3   # the prompt's step drafts none


def test_no_speculative_step_drafts_a_token_the_budget_cannot_keep():
    # Why: K was fixed at min(num_draft, budget), so the last steps had the amateur draft (and
    # the expert verify) tokens that generate() then cut; a step now drafts at most the tokens
    # left but one, as speculative's does. The expert as its own amateur accepts every draft.
    expert, K, budget = tiny_llama(0), 3, 7
    steps = contrastive.decode(expert, tiny_llama(0), [1, 2], sampler=GREEDY, rng=Random(0),
                               max_new_tokens=budget, beta=0.0, speculative=True, num_draft=K)
    drafted, made = [], 0
    while made < budget:
        step = next(steps)
        drafted.append(step.drafted)
        made += len(step.tokens)
    assert drafted == [0, 3, 1] and made == budget       # 1 token, then 1 + 3, then 2 left: one draft + its bonus


@pytest.mark.parametrize("kind", ["model", "layers"])
def test_sampling_draws_position_keyed_tokens_from_the_contrastive_law(kind):
    # Why: the lead's exact-law proofs rely on this contract: token t is
    # rng.categorical(sampler.probs(scores(l_E, l_A)), "token", t), with temperature, top-k and
    # top-p applied to the scores. The reference recomputes both models from scratch each time.
    expert, amateur = tiny_llama(1, scale=0.5), amateur_for(kind, 1)
    sampler, rng, prompt = Sampler(temperature=0.9, top_k=10, top_p=0.95), Random(7), [3, 1, 4]
    knobs = dict(alpha=0.02, beta=0.8, form="ratio" if kind == "model" else "logit",
                 amateur_temperature=0.7)
    got = run(expert, amateur, prompt, 10, sampler=sampler, rng=rng, **knobs)
    seq = list(prompt)
    for _ in range(10):
        x = torch.tensor([seq], device=DEVICE)
        pos = torch.arange(len(seq), device=DEVICE)
        e = expert(x, pos)[0, -1]
        if kind == "model":
            a = amateur(x, pos)[0, -1]
        else:
            a = expert.head(expert.blocks(expert.tok_embeddings(x), pos, stop=amateur.layers))[0, -1]
        p = sampler.probs(contrastive.scores(e, a, **knobs))
        seq.append(rng.categorical(p, "token", len(seq)))
    assert got == seq[len(prompt):]


def test_bad_amateurs_are_clear_errors():
    expert = tiny_llama(0)
    with pytest.raises(ValueError, match="vocab"):
        run(expert, tiny_llama(1, vocab=32), [1], 2)
    with pytest.raises(ValueError, match="early-exit"):
        run(expert, EarlyExit(expert.config.n_layers), [1], 2)
    with pytest.raises(ValueError, match="EarlyExit"):
        run(expert, 1, [1], 2)                # a bare layer count is not an early exit
    with pytest.raises(ValueError, match="form"):
        run(expert, EarlyExit(1), [1], 2, form="ratios")
