"""Draft-target speculative decoding (Leviathan et al. 2023, arXiv 2211.17192; Chen et al. 2023,
arXiv 2302.01318): a cheap draft proposes K tokens, the target scores all K+1 prefixes in one
forward and keeps a prefix of the drafts plus one token of its own. Two verifications:
- "rejection": accept x ~ q with prob min(1, p/q), else resample: the output law is the target's.
- "coupled": the draft samples with the uniform plain sampling uses at that position and the
  target keeps drafts while its own inverse-CDF draw from that uniform agrees: the output is
  plain sampling's with the same seed, token for token, whatever the draft; it accepts less
  often than rejection sampling (`verify_match` says how much).
The draft is another Llama with the target's vocab (such as `fast.paths.build(checkpoint, int4=True)`,
the target's own weights in 4 bits), `EarlyExit(L)`: the target's layers [0, L) + its norm and
head (an early exit), sharing the target's weights and KV cache, or `Ngram(n)`: the text's own
n-grams, no model at all, proposing only as far as the text repeats, or `Ngram(otherwise=draft)`:
the text where it repeats and a draft Llama elsewhere (engine/draft.py). Whichever,
the target decides every token: the output is the target's, however good the draft.
K is fixed (`num_draft`) unless a policy chooses it per step (engine/adapt/policy.py, DraftLength).
But: batch size 1, one chain of drafts (no trees), no drafts with another tokenizer.
"""
from __future__ import annotations

from typing import Iterator

import torch

from engine.draft import Draft, EarlyExit, draft_then_verify, pair_for
from engine.generate import Step
from engine.llama import Llama, LlamaConfig
from engine.sampling import Random, Sampler, verify_match, verify_rejection
from engine.trace import verdicts


def check(config: LlamaConfig, draft: Draft | None = None, num_draft: int = 4, verify: str = "rejection", **_) -> None:
    """decode()'s knobs (and an early exit's depth) for a target of `config`, or a ValueError;
    the front doors call it before any weight is loaded."""
    if verify not in ("rejection", "coupled"):
        raise ValueError(f"verify must be 'rejection' or 'coupled', got {verify!r}")
    if type(num_draft) is not int or num_draft < 0:
        raise ValueError(f"need an integer num_draft >= 0, got {num_draft!r}")
    if isinstance(draft, EarlyExit) and not 1 <= draft.layers <= config.n_layers:
        raise ValueError(f"self-draft layers must be in [1, {config.n_layers}], got {draft.layers}")


def decode(target: Llama, draft: Draft, prompt: list[int], *, sampler: Sampler,
           rng: Random, max_new_tokens: int, num_draft: int = 4, verify: str = "rejection",
           policy=None, trace: bool = False) -> Iterator[Step]:
    """Speculative decoding; one Step per target forward (the first is plain's, on the prompt alone).

        n = len(x); K = min(K, tokens left - 1), or 0 on the prompt's step (plain's prefill,
                    and the draft reads the prompt too: prompt time, not decoding's)
        for i in 0..K-1: q_i = probs(draft(x_<n+i)); x_{n+i} ~ q_i   key ("draft" | "token", n+i)
                         (an n-gram draft with no match at n+i: K = i)
        p_0..p_K = probs(target(x_<n+K))                            one forward, K+1 rows
        rejection: accept x_{n+i} w.p. min(1, p_i/q_i); first reject: y ~ norm((p_i - q_i)+)
        coupled (a match): y_i ~ p_i with plain's key ("token", n+i); accept while y_i == x_{n+i}
        K = 0 (nothing drafted): y ~ p_0, plain's draw
        all K accepted: bonus y ~ p_K;  emit accepted drafts + y
        truncate both caches to the committed prefix
    p_i is the target's law at position n+i (its row after x_<n+i). `policy` (engine/adapt/policy.py,
    DraftLength) picks K per step from the tokens seen, K = 0 a plain step: never the law,
    and a seed gives the same tokens on every run. `trace` puts each draft's p(x), q(x), u and
    verdict in `Step.trace` (engine/trace.py prints it).
    """
    check(target.config, draft, num_draft, verify)
    # a step never drafts past the budget, so K beyond it would only size the cache
    scratch = min(max(num_draft, policy.most if policy else 0), max_new_tokens) + 1
    pair = pair_for(target, draft, len(prompt) + max_new_tokens + scratch, scratch)
    stream = "draft" if verify == "rejection" else "token"

    # subtle: decode() checks its knobs and sizes its caches when called; the loop below is an
    # inner generator, so it runs step by step as its Steps are read
    def steps(seq: list[int], end: int) -> Iterator[Step]:
        while True:
            n = len(seq)                                       # position of the first new token
            first = not pair.target_seen                       # the prefill: plain's step (generate.py)
            k = 0 if first else min(policy.k if policy else num_draft, max(end - n - 1, 0))
            why = getattr(policy, "why", "") if not first else ""   # the numbers behind K, for the trace
            ran = pair.forwards                                # the draft's forwards before this step
            if first and end - n > 1:                          # a token left to draft for
                pair.prefill(seq)
            # the drafts, their laws q (built only for the trace: a greedy verdict needs none), the
            # draft's logits a, and the target's K+1 rows
            drafts, q, a, logits = draft_then_verify(pair, seq, k, sampler, rng, stream, laws=trace)  # (K, V), (K+1, V)
            asked, k = k, len(drafts)                          # an n-gram draft may propose fewer
            # the verdict, one of three (the box's last lines):
            if not k:                                          # 1. no drafts: plain's own draw
                out = [sampler.draw(logits[0], rng, "token", n)]
            elif verify == "rejection" and not sampler.greedy:  # 2. rejection: min(1, p/q), else the residual
                out = verify_rejection(sampler.probs(logits), q, drafts, rng, n)
            else:   # 3. match: coupled; or greedy, where p and q are one-hot and rejection keeps x_i iff
                    # it is p_i's argmax, then emits that argmax: the match's answer, with no law built
                # one candidate, the drafts: rows (1, K, V), ids (1, K)
                out, _ = verify_match(logits[0], logits[None, 1:], torch.tensor([drafts]), sampler, rng, n)
            if policy and not first:
                policy.update(k, len(out) - 1)
            pair.rollback(n + len(out) - 1)   # the last emitted token is fed next step
            seq += out
            info = None
            if trace:   # the uniform each verdict read: ("accept", t), or plain's ("token", t) if coupled
                p = sampler.probs(logits)                                            # (K+1, V)
                u = [rng.uniform("accept" if verify == "rejection" else "token", n + i) for i in range(k)]
                info = {"kind": "speculative", "position": n, "first": first, "verify": verify, "asked": asked,
                        "adaptive": bool(policy), "greedy": sampler.greedy, "why": why,
                        **verdicts(p, q, drafts, out, u, (logits, torch.stack(a[:k])) if k else None)}
            yield Step(out, forwards=1, drafted=k, accepted=len(out) - 1, draft_forwards=pair.forwards - ran, trace=info,
                       arm=f"K={k}" if policy else "")

    return steps(list(prompt), len(prompt) + max_new_tokens)
