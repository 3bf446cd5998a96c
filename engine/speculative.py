"""Draft-target speculative decoding (Leviathan et al. 2023, arXiv 2211.17192; Chen et al. 2023,
arXiv 2302.01318): a cheap draft proposes K tokens, the target scores all K+1 prefixes in one
forward and keeps a prefix of the drafts plus one token of its own. Two verifications:
- "rejection": accept x ~ q with prob min(1, p/q), else resample: the output law is the target's.
- "coupled": the draft samples with the uniform plain sampling uses at that position and the
  target keeps drafts while its own inverse-CDF draw from that uniform agrees: the output is
  plain sampling's with the same seed, token for token, whatever the draft; it accepts less
  often than rejection sampling (`verify_match` says how much).
The draft is another Llama with the target's vocab (such as `draft.int4_copy(target)`, the
target's own weights in 4 bits), or `SelfDraft(L)`: the target's layers [0, L) + its norm and
head (an early exit), sharing the target's weights and KV cache (engine/draft.py). Either way
the target decides every token: the output is the target's, however good the draft.
But: batch size 1, one chain of drafts (no trees), no drafts with another tokenizer.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator

import torch

from engine.cost import DRAFT_COST, layer_share, row_cost
from engine.draft import draft_then_verify, pair_for
from engine.generate import Step
from engine.llama import Llama
from engine.sampling import Random, Sampler, verify_match, verify_rejection
from engine.trace import verdicts


@dataclass(frozen=True)
class SelfDraft:
    layers: int   # the draft is the target's layers [0, layers), then its final norm and LM head


def best_k(alpha: float, c_draft: float, c_verify: Callable[[int], float], max_k: int) -> int:
    """The K in [0, max_k] with the most tokens per unit cost, K = 0 being a plain step (cost 1):
        sum_{i<=K} alpha^i / (K c_draft + c_verify(K))          (Leviathan et al., walltime factor)

    Example: best_k(0.8, 0.1, lambda k: 1.0, 16) == 6 (2.47 tokens per unit); at alpha = 0.1
    no K pays for its drafts, and K = 0 wins.
    """
    tokens = lambda k: sum(alpha ** i for i in range(k + 1))   # (1 - alpha^(K+1)) / (1 - alpha), no 0/0
    cost = lambda k: k * c_draft + c_verify(k) if k else 1.0
    return max(range(max_k + 1), key=lambda k: tokens(k) / cost(k))


class Tuner:
    """K per step from the acceptance seen so far and fixed costs (engine/cost.py), never the clock.

        alpha = decayed accepted / decayed trials        (a step: `accepted` successes, then a
                                                          failure unless all K passed)
        K = best_k(alpha, c_draft, c_verify, max_k)
        at K = 0 nothing is measured, so after `probe` plain steps one step drafts K = 1;
        each probe that does not lift K doubles the wait (32, 64, 128, up to 256 steps); a
        probe whose draft is accepted sets it back to 32
    With c_draft = 0.74 (a 20-of-30-layer self-draft of SmolLM2-135M), K = 1 pays only when
    alpha > 0.75, so a weak draft decodes at plain's pace bar its probes. The schedule is a
    function of the tokens seen, so a seed gives the same tokens on every run.
    """

    def __init__(self, k: int, max_k: int, c_draft: float, c_verify: Callable[[int], float],
                 prior: float = 0.5, probe: int = 32):
        self.k, self.max_k, self.decay = k, max_k, 0.9     # forget a step's weight in ~10 steps
        self.c_draft, self.c_verify = c_draft, c_verify
        self.accepted, self.trials = 2 * prior, 2.0        # prior alpha, worth 2 trials, forgotten like the rest
        self.first_probe = self.probe = probe
        self.idle = 0                                      # plain steps since the last measurement

    @property
    def alpha(self) -> float:
        return self.accepted / self.trials

    def update(self, k: int, accepted: int) -> None:
        if k:
            d = self.decay
            self.accepted = d * self.accepted + accepted
            self.trials = d * self.trials + accepted + (accepted < k)
            self.idle = 0
        else:
            self.idle += 1
        self.k = best_k(self.alpha, self.c_draft, self.c_verify, self.max_k)
        if self.k or (k and accepted == k):                # drafting pays, or a probe all accepted
            self.probe = self.first_probe
        elif self.idle >= self.probe:                      # probe: one draft, to measure alpha
            self.k, self.probe = 1, min(2 * self.probe, 8 * self.first_probe)


def costs(target: Llama, draft: Llama | SelfDraft, cost_table=None,
          draft_cost: float | None = None) -> tuple[float, Callable[[int], float], float]:
    """(cost of one draft token, K -> cost of the verifying forward, prior alpha), in units of a
    one-row target forward. `draft_cost` is a measured price (engine.cost.draft_price); without
    it a draft of the target's own shapes in 4 bits costs DRAFT_COST by CPU dispatch, another
    one its share of the target's parameters.

    The prior: a self-draft or a foreign draft 1/2; a copy of the target in fewer bits 0.9
    (its 4-bit copy: 4-bit SmolLM2-135M agrees with fp32 on 99.4% of greedy tokens: docs/fidelity.md).
    """
    rows = row_cost(target, cost_table)
    if isinstance(draft, SelfDraft):       # layers < L: 1 row per draft; the rest on K+1 rows
        lower = layer_share(target, draft.layers)
        head = 1 - layer_share(target, target.config.n_layers)
        return lower + head, lambda k: lower + (1 - lower) * rows(k + 1), 0.5
    kind = type(draft.layers[0].feed_forward.w13).__name__
    copy = draft.config == target.config and kind == "Int4Linear"
    if draft_cost is None:
        size = lambda m: sum(p.numel() for p in m.parameters())
        draft_cost = DRAFT_COST.get((kind, torch.backends.cpu.get_cpu_capability()), 0.6) \
            if copy else size(draft) / size(target)
    return draft_cost, lambda k: rows(k + 1), 0.9 if copy else 0.5


def pays(target: Llama, draft: Llama | SelfDraft, cost_table=None, draft_cost: float | None = None) -> float:
    """Tokens per unit of cost at the draft's prior alpha and its best K (1.0: plain's pace),
    what `--draft auto` compares drafts by."""
    c_draft, c_verify, prior = costs(target, draft, cost_table, draft_cost)
    k = best_k(prior, c_draft, c_verify, 16)
    return sum(prior ** i for i in range(k + 1)) / (k * c_draft + c_verify(k) if k else 1.0)


def decode(target: Llama, draft: Llama | SelfDraft, prompt: list[int], *, sampler: Sampler,
           rng: Random, max_new_tokens: int, num_draft: int | None = None, verify: str = "rejection",
           adaptive: bool = False, max_draft: int = 16, cost_table: dict[int, float] | None = None,
           draft_cost: float | None = None, trace: bool = False) -> Iterator[Step]:
    """Speculative decoding; one Step per target forward (the first one also eats the prompt).

        n = len(x); K = min(K, tokens left - 1)
        for i in 0..K-1: q_i = probs(draft(x)); x_{n+i} ~ q_i   key ("draft" | "token", n+i)
        p_0..p_K = probs(target(x_<n+K+1))                          one forward, K+1 rows
        rejection: accept x_{n+i} w.p. min(1, p_i/q_i); first reject: y ~ norm((p_i - q_i)+)
        coupled:   y_i ~ p_i with plain's key ("token", n+i); accept while y_i == x_{n+i}
        all K accepted: bonus y ~ p_K;  emit accepted drafts + y
        truncate both caches to the committed prefix
        adaptive: K = argmax_k sum_{i<=k} alpha^i / (k c_draft + c_verify(k)), K = 0 a plain step
    The K schedule depends only on the tokens seen (`Tuner`), so it never changes the output law,
    and a seed gives the same tokens on every run, under either verification. `trace` puts each
    draft's p(x), q(x), u and verdict in `Step.trace` (engine/trace.py prints it).
    """
    if verify not in ("rejection", "coupled"):
        raise ValueError(f"verify must be 'rejection' or 'coupled', got {verify!r}")
    given, num_draft = num_draft, (0 if adaptive else 4) if num_draft is None else num_draft
    if not all(type(k) is int for k in (num_draft, max_draft)) or num_draft < 0 or max_draft < 1:
        raise ValueError(f"need integers num_draft >= 0, max_draft >= 1; got {num_draft!r}, {max_draft!r}")
    L = target.config.n_layers
    if isinstance(draft, SelfDraft) and not 1 <= draft.layers <= L:
        raise ValueError(f"self-draft layers must be in [1, {L}], got {draft.layers}")
    # a step never drafts past the budget, so K beyond it would only size the cache
    num_draft, max_draft = min(num_draft, max_new_tokens), min(max_draft, max(max_new_tokens, 1))
    price = costs(target, draft, cost_table, draft_cost) if adaptive else None   # c_draft, c_verify, prior
    if adaptive and given is None:     # start where the prior and the costs say: K = 0 for a
        num_draft = best_k(price[2], *price[:2], max_draft)   # draft that costs most of a forward
    scratch = max(num_draft, max_draft if adaptive else 0) + 1
    capacity = len(prompt) + max_new_tokens + scratch
    pair = pair_for(target, draft.layers if isinstance(draft, SelfDraft) else draft, capacity, scratch)
    tuner = Tuner(num_draft, max_draft, *price) if adaptive else None
    stream = "draft" if verify == "rejection" else "token"

    def steps(seq: list[int], end: int) -> Iterator[Step]:
        while True:
            n = len(seq)                                       # position of the first new token
            k = min(tuner.k if tuner else num_draft, max(end - n - 1, 0))
            drafts, q, _, logits = draft_then_verify(pair, seq, k, sampler, rng, stream)  # (K, V), (K+1, V)
            if not k:       # a plain step: plain's draw, which is either verification's with no drafts
                out = [sampler.draw(logits[0], rng, "token", n)]
            elif verify == "rejection":
                out = verify_rejection(sampler.probs(logits), q, drafts, rng, n)
            else:
                out, _ = verify_match(logits[0], logits[None, 1:], torch.tensor([drafts]), sampler, rng, n)
            if tuner:
                tuner.update(k, len(out) - 1)
            pair.rollback(n + len(out) - 1)   # the last emitted token is fed next step
            seq += out
            info = None
            if trace:   # the uniform each verdict read: ("accept", t), or plain's ("token", t) if coupled
                p = sampler.probs(logits)                                            # (K+1, V)
                u = [rng.uniform("accept" if verify == "rejection" else "token", n + i) for i in range(k)]
                info = {"kind": "speculative", "position": n, "verify": verify, "adaptive": bool(tuner),
                        **verdicts(p, q, drafts, out, u)}
            yield Step(out, forwards=1, drafted=k, accepted=len(out) - 1, draft_forwards=k, trace=info,
                       arm=f"K={k}" if tuner else "")

    return steps(list(prompt), len(prompt) + max_new_tokens)
