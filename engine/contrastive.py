"""Contrastive decoding: emit the tokens an expert likes much more than an amateur does.

Li et al. 2022, "Contrastive Decoding: Open-ended Text Generation as Optimization"
(arXiv 2210.15097); the logit form of O'Brien & Lewis 2023, "Contrastive Decoding Improves
Reasoning in Large Language Models" (arXiv 2309.09117); speculative contrastive decoding,
Yuan et al. 2023 (arXiv 2311.08981). Not contrastive *search*, which is another algorithm.

The amateur is a second Llama with the expert's vocabulary, or EarlyExit(L): the expert's own
first L layers read out through its final norm and LM head (an early exit), taken from the
expert's forward itself, so it costs one more LM-head row per token and nothing else. Either
way it is the draft of an `engine/draft.py` pair, and the expert its target.

But: no beam search (the authors' default), one amateur, batch size 1.
"""
from __future__ import annotations

import math
from typing import Iterator

import torch
from torch import Tensor

from engine.draft import EarlyExit, Ngram, draft_then_verify, pair_for
from engine.generate import Step
from engine.llama import Llama, LlamaConfig
from engine.sampling import Random, Sampler, verify_rejection
from engine.trace import verdicts


def scores(expert_logits: Tensor, amateur_logits: Tensor, alpha: float = 0.1, beta: float = 1.0,
           form: str = "logit", amateur_temperature: float = 1.0) -> Tensor:
    """(..., V) contrastive scores in float64, -inf outside the plausible set V_head.

        V_head = {x : p_E(x) >= alpha * max_w p_E(w)}
        "ratio" (Li et al.):         s(x) = log p_E(x) - log p_A(x)          (beta unused)
        "logit" (O'Brien & Lewis):   s(x) = (1 + beta) l_E(x) - beta l_A(x) / tau
    where p_A = softmax(l_A / tau), tau = amateur_temperature: tau < 1 sharpens the amateur,
    so its confident picks are penalised harder. Per row, l_A / tau and log p_A differ by a
    constant, as do our log p_A and the authors' log_softmax(l_A) / tau; the softmax or argmax
    that follows removes any per-row constant, so all three choices pick the same tokens.
    Example: l_E = [2, 1.5, 0], l_A = [3, 0, 0], beta = 0.5 -> s = [1.5, 2.25, 0].
    """
    if form not in ("logit", "ratio"):
        raise ValueError(f"form must be 'logit' or 'ratio', got {form!r}")
    if not 0 <= alpha <= 1 or not 0 <= beta < math.inf or not 1e-4 <= amateur_temperature < math.inf:
        # beta < 0 would reward the amateur: beta = -1 decodes with the amateur alone; a tau
        # below 1e-4 overflows l_A / tau (1e-310 gives inf - inf = NaN scores)
        raise ValueError(f"need 0 <= alpha <= 1, finite beta >= 0 and amateur_temperature in "
                         f"[1e-4, inf), got {alpha}, {beta} and {amateur_temperature}")
    e = expert_logits.double()                                              # (..., V)
    a = amateur_logits.double() / amateur_temperature                       # (..., V)
    if form == "ratio":
        s = e.log_softmax(-1) - a.log_softmax(-1)
    else:
        s = (1 + beta) * e - beta * a
    # p_E(x) >= alpha max p_E  <=>  l_E(x) >= max l_E + log alpha: the normaliser cancels, and
    # subtle: max + log(alpha) <= max even after rounding, so the argmax is always kept
    cutoff = e.amax(-1, keepdim=True) + (math.log(alpha) if alpha > 0 else -math.inf)
    return s.masked_fill(e < cutoff, float("-inf"))


def check(config: LlamaConfig, amateur=None, alpha: float = 0.1, beta: float = 1.0, amateur_temperature: float = 1.0,
          form: str = "logit", speculative: bool = False, num_draft: int | None = None, **_) -> int:
    """decode()'s knobs (and an early exit's depth) for an expert of `config`, or a ValueError;
    the front doors call it before any weight is loaded. Returns K (num_draft's default: 4)."""
    if isinstance(amateur, Ngram):   # its "logits" are one token's; contrast needs a whole law
        raise ValueError("the amateur is a model (a Llama or EarlyExit(L)), not the text's n-grams")
    if isinstance(amateur, EarlyExit) and not 0 <= amateur.layers < config.n_layers:
        raise ValueError(f"early-exit amateur needs 0 <= L < {config.n_layers}, got {amateur.layers}")
    scores(torch.zeros(1), torch.zeros(1), alpha, beta, form, amateur_temperature)  # alpha, beta, tau, form
    num_draft = 4 if num_draft is None else num_draft
    if speculative and (type(num_draft) is not int or num_draft < 1):
        raise ValueError(f"num_draft must be an integer >= 1, got {num_draft!r}")
    return num_draft


def decode(expert: Llama, amateur: Llama | EarlyExit, prompt: list[int], *, sampler: Sampler,
           rng: Random, max_new_tokens: int, alpha: float = 0.1, beta: float = 1.0,
           amateur_temperature: float = 1.0, form: str = "logit", speculative: bool = False,
           num_draft: int | None = None, trace: bool = False) -> Iterator[Step]:
    """Contrastive decoding; with `speculative`, the amateur drafts K = num_draft tokens.

        seq = prompt
        loop:                                              # one expert forward per iteration
            t = len(seq)                                   # position of the first new token
            K = min(num_draft, tokens left - 1) if speculative and not the prompt's step else 0
            for i in 0..K:  a_i = amateur(seq + d_<i)[-1]
                            if i < K: d_i ~ q_i = probs(a_i) with key ("draft", t + i)
            e_0..e_K = expert(seq + d_0..d_K-1)[-K-1:]
            p_i = probs(scores(e_i, a_i))                  # the contrastive law at t + i
            out = verify_rejection(p, q, d, rng, t)        # K = 0: x ~ p_0, key ("token", t)
            truncate caches to t + len(out) - 1; seq += out; yield out
    Tokens follow p_CD = probs(scores(expert, amateur)) exactly, drafts or not: rejection
    sampling keeps the target law for any q (here the sampler on the raw amateur logits), and
    a_i is the amateur at the very position e_i verifies. With an early-exit amateur, drafting
    runs layers < L and the verifying pass resumes at L on the same states: layers < L see
    only tokens, so their K/V and states are what a full forward would compute. beta = 1.0 by
    default, as docs/quality.md chose. `trace` puts each position's expert argmax, pick and
    plausible-set size (and the drafts' verdicts) in `Step.trace` (engine/trace.py prints it).
    """
    num_draft = check(expert.config, amateur, alpha, beta, amateur_temperature, form, speculative, num_draft)
    K = min(num_draft, max_new_tokens) if speculative else 0       # no step drafts past the budget
    pair = pair_for(expert, amateur, len(prompt) + max_new_tokens + K + 1, K + 1)  # amateur = the draft
    seq, end = list(prompt), len(prompt) + max_new_tokens
    while True:
        t = len(seq)                                            # position of the first new token
        k = min(K, max(end - t - 1, 0)) if pair.target_seen else 0   # the prompt's step drafts nothing
        # subtle: the amateur also reads d_k-1, for a_k: the row the bonus position needs
        drafts, q, a_rows, e = draft_then_verify(pair, seq, k, sampler, rng, "draft", bonus_row=True)
        s = scores(e, torch.stack(a_rows), alpha, beta, form, amateur_temperature)  # (k+1, V)
        p = sampler.probs(s)                                                # (k+1, V)
        out = verify_rejection(p, q, drafts, rng, t)
        pair.rollback(t + len(out) - 1)                                     # keep accepted drafts
        seq += out
        info = None
        if trace:   # per emitted position: the expert's own choice, the contrastive one, |V_head|
            u, laws = [rng.uniform("accept", t + i) for i in range(k)], (s, torch.stack(a_rows[:k])) if k else None
            info = {"kind": "contrastive", "position": t, "expert": e.argmax(-1).tolist(),
                    "best": s.argmax(-1).tolist(), "plausible": s.isfinite().sum(-1).tolist(),
                    "greedy": sampler.greedy, **verdicts(p, q, drafts, out, u, laws)}
        yield Step(out, drafted=k, accepted=len(out) - 1, draft_forwards=k + 1, trace=info)
