"""Draft-target speculative decoding (Leviathan et al. 2023, arXiv 2211.17192; Chen et al. 2023,
arXiv 2302.01318): a cheap draft proposes K tokens, the target scores all K+1 prefixes in one
forward and keeps a prefix of the drafts plus one token of its own. Two verifications:
- "rejection": accept x ~ q with prob min(1, p/q), else resample: the output law is the target's.
- "coupled": the draft samples with the noise plain sampling uses at that position and the target
  keeps drafts while its own draw agrees (Daliri et al. 2024, arXiv 2408.07978): the output is
  plain sampling's with the same seed, token for token, whatever the draft.
The draft is another Llama with the target's vocab, or `SelfDraft(L)`: the target's layers [0, L)
+ its norm and head (an early exit), sharing the target's weights and KV cache (engine/draft.py).
But: batch size 1, one chain of drafts (no trees), no drafts with another tokenizer.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Iterator

import torch

from engine.draft import pair_for
from engine.generate import Step
from engine.llama import Llama
from engine.sampling import Random, Sampler, verify_match, verify_rejection


@dataclass(frozen=True)
class SelfDraft:
    layers: int   # the draft is the target's layers [0, layers), then its final norm and LM head


def best_k(alpha: float, c_draft: float, c_target: float, max_k: int) -> int:
    """The K in [1, max_k] with the most tokens per second: sum_{i<=K} alpha^i / (K c_draft + c_target).

    Example: best_k(0.8, 0.1, 1.0, 16) == 6 (2.47 tokens per target-forward time).
    """
    tokens = lambda k: sum(alpha ** i for i in range(k + 1))   # (1 - alpha^(K+1)) / (1 - alpha), no 0/0
    return max(range(1, max_k + 1), key=lambda k: tokens(k) / (k * c_draft + c_target))


class _Tuner:
    """Running estimates of the per-token acceptance alpha and of the forward costs."""

    def __init__(self, k: int, max_k: int):
        self.k, self.max_k, self.decay = k, max_k, 0.9     # forget a step's weight in ~10 steps
        self.accepted, self.trials = 1.0, 2.0        # prior alpha = 1/2, forgotten like the rest
        self.c_draft = self.c_target = None

    def update(self, k: int, accepted: int, draft_s: float, target_s: float) -> None:
        d = self.decay
        # a step is `accepted` successes then one failure, unless all k passed (MLE of alpha)
        self.accepted = d * self.accepted + accepted
        self.trials = d * self.trials + accepted + (accepted < k)
        ema = lambda old, new: new if old is None else d * old + (1 - d) * new
        self.c_draft, self.c_target = ema(self.c_draft, draft_s / k), ema(self.c_target, target_s)
        alpha = self.accepted / self.trials
        # subtle: K >= 1 always, so alpha keeps being measured even when drafting does not pay
        self.k = best_k(alpha, self.c_draft, max(self.c_target, 1e-12), self.max_k)  # a frozen test clock


def decode(target: Llama, draft: Llama | SelfDraft, prompt: list[int], *, sampler: Sampler,
           rng: Random, max_new_tokens: int, num_draft: int = 4, verify: str = "rejection",
           adaptive: bool = False, max_draft: int = 16,
           clock: Callable[[], float] = time.perf_counter) -> Iterator[Step]:
    """Speculative decoding; one Step per target forward (the first one also eats the prompt).

        n = len(x); K = min(K, tokens left - 1)
        for i in 0..K-1: q_i = probs(draft(x)); x_{n+i} ~ q_i   key ("draft" | "token", n+i)
        p_0..p_K = probs(target(x_<n+K+1))                          one forward, K+1 rows
        rejection: accept x_{n+i} w.p. min(1, p_i/q_i); first reject: y ~ norm((p_i - q_i)+)
        coupled:   y_i ~ p_i with plain's key ("token", n+i); accept while y_i == x_{n+i}
        all K accepted: bonus y ~ p_K;  emit accepted drafts + y
        truncate both caches to the committed prefix
        adaptive: K = argmax_k sum_{i<=k} alpha^i / (k c_draft + c_target), measured online
    The K schedule depends only on the past, so it never changes the output law; with wall-clock
    costs it may change which tokens a seed gives under "rejection" (never under "coupled").
    """
    if verify not in ("rejection", "coupled"):
        raise ValueError(f"verify must be 'rejection' or 'coupled', got {verify!r}")
    if num_draft < 0 or max_draft < 1:
        raise ValueError(f"need num_draft >= 0, max_draft >= 1; got {num_draft}, {max_draft}")
    capacity = len(prompt) + max_new_tokens + max(num_draft, max_draft if adaptive else 0) + 1
    V, L = target.config.vocab_size, target.config.n_layers
    if isinstance(draft, SelfDraft) and not 1 <= draft.layers <= L:
        raise ValueError(f"self-draft layers must be in [1, {L}], got {draft.layers}")
    pair = pair_for(target, draft.layers if isinstance(draft, SelfDraft) else draft, capacity)
    tuner = _Tuner(max(num_draft, 1), max_draft) if adaptive else None
    device = target.tok_embeddings.weight.device
    as_tensor = lambda tokens: torch.tensor([tokens], dtype=torch.long, device=device)  # (1, T)
    stream = "draft" if verify == "rejection" else "token"

    def steps(seq: list[int], end: int) -> Iterator[Step]:
        while True:
            n = len(seq)                                       # position of the first new token
            k = min(tuner.k if tuner else num_draft, max(end - n - 1, 0))
            t0 = clock()
            drafts, feed = [], seq[pair.draft_seen:]
            q = torch.zeros(k, V, dtype=torch.float64, device=device)                # (K, V)
            for i in range(k):
                logits = pair.propose(as_tensor(feed), torch.arange(n + i - len(feed), n + i, device=device))
                q[i] = sampler.probs(logits)                 # subtle: q is the law x was drawn from
                drafts.append(rng.categorical(q[i], stream, n + i))
                feed = drafts[-1:]
            t1, start = clock(), pair.target_seen
            logits = pair.verify(as_tensor(seq[start:] + drafts), torch.arange(start, n + k, device=device),
                                 k + 1)                                               # (K+1, V)
            if verify == "rejection":
                out = verify_rejection(sampler.probs(logits), q, drafts, rng, n)
            else:
                out, _ = verify_match(logits[0], logits[None, 1:], as_tensor(drafts), sampler, rng, n)
            if tuner and k and start:      # start = 0: the first step's timings include the prompt
                tuner.update(k, len(out) - 1, t1 - t0, clock() - t1)
            pair.rollback(n + len(out) - 1)   # the last emitted token is fed next step
            seq += out
            yield Step(out, forwards=1, drafted=k, accepted=len(out) - 1)

    return steps(list(prompt), len(prompt) + max_new_tokens)
