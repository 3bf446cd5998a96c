"""The decoder protocol, the plain decoder every other one is checked against, and generate().

A decoder is a generator function
    decode(models..., prompt, *, sampler, rng, max_new_tokens, knobs...) -> Iterator[Step]
One yield is one iteration of its algorithm (one target forward, prefill included); the
Step holds the tokens it accepted. The first is plain's: the prompt alone, one token drawn
(on the exact path a prompt is one attention call, so every decoder must make the same one:
engine/fast/invariant.py). Decoders never stop by themselves: `generate()` alone knows
the token budget, EOS and stop strings, and cuts a multi-token step exactly where one ends.
Decoders size their caches from `max_new_tokens`, not the model's context.
"""
from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, Iterable, Iterator

import torch

from engine.kvcache import KVCache
from engine.llama import Llama
from engine.sampling import Random, Sampler


@dataclass
class Step:
    tokens: list[int]      # newly accepted: the accepted drafted tokens, then one of the target's
    forwards: int = 1      # target forwards spent on them
    drafted: int = 0       # drafted tokens the target verified this step
    accepted: int = 0      # of which accepted: always len(tokens) - 1
    draft_forwards: int = 0  # forwards of the second model (draft or amateur) this step
    trace: dict | None = None  # what happened, only when the decoder is asked to trace (engine/trace.py)
    arm: str = ""          # an adaptive decoder's choice this step ("W2 G2", "K=0"), for the bench


@dataclass
class Stats:
    """What `generate()` counts, every field defined once and the same for every decoder (the
    CLI's stats line and its --help print these):

    tokens            tokens emitted, after the cut at EOS, --stop or the budget
    target forwards   forwards of the model that decides (contrastive: the expert), prefill
                      included: one per step
    draft forwards    forwards of the second model: speculative's draft (K a step),
                      contrastive's amateur (K+1 a step); with layers:L only layers < L + head;
                      then which model it is (--draft auto names its choice) and the memory
                      it adds (an early exit shares the target's weights: none)
    tok/forward       tokens / target forwards
    acceptance        accepted / drafted. drafted: tokens the target verified, proposed by
                      speculative's draft, lookahead's n-gram guesses (trie rows) or lookup's
                      copy, contrastive --speculative's amateur drafts; accepted: those kept,
                      counted after the cut (tokens = steps + accepted). Not shown when
                      nothing was drafted (plain, contrastive without --speculative)
    hit rate          hits / verify steps: steps that kept an accepted draft / steps that
                      verified at least one (adaptive K = 0 steps verify none)
    tokens per step   histogram, "1x15 2x1" = 15 steps of one token and one of two
    arms              an adaptive decoder's choices, steps each: lookahead's plain, copy or
                      window (W2 G2: 2 columns, 2 guesses), lookup's plain or copy,
                      speculative's K (K=0: a plain step); not shown for a textbook loop
    prefill, decode   seconds until the first step (the prompt's forward); tokens per second
                      after it (the first step's tokens excluded)
    """
    n_tokens: int = 0
    n_forwards: int = 0
    draft_forwards: int = 0
    drafted: int = 0
    accepted: int = 0
    hits: int = 0                    # steps that kept at least one accepted draft
    verify_steps: int = 0            # steps that verified at least one drafted token
    first_step_tokens: int = 0       # tokens the prefill forward produced
    prefill_seconds: float = 0.0     # until the first step (the prompt's forward)
    decode_seconds: float = 0.0      # every step after it
    step_lengths: Counter = field(default_factory=Counter)  # tokens per step -> steps
    arms: Counter = field(default_factory=Counter)  # an adaptive decoder's choice -> steps ("K=3", "copy")

    @property
    def tokens_per_forward(self) -> float:
        return self.n_tokens / max(self.n_forwards, 1)

    @property
    def acceptance(self) -> float | None:
        return self.accepted / self.drafted if self.drafted else None

    @property
    def hit_rate(self) -> float | None:
        return self.hits / self.verify_steps if self.verify_steps else None

    @property
    def decode_tokens_per_second(self) -> float:
        # the first step's tokens are paid for by the prefill, so they are not counted here
        done = self.n_tokens - self.first_step_tokens
        return done / self.decode_seconds if self.decode_seconds > 0 else 0.0


def plain(model: Llama, prompt: list[int], *, sampler: Sampler, rng: Random,
          max_new_tokens: int, trace: bool = False) -> Iterator[Step]:
    """One token per forward: x_t ~ p(. | x_<t) with the key ("token", t)."""
    if not prompt:   # before the first read, as the other decoders say it
        raise ValueError("plain needs a prompt of at least one token")
    cache = KVCache.for_model(model, len(prompt) + max_new_tokens, scratch=0)  # checks the context
    device = model.tok_embeddings.weight.device
    tokens = torch.tensor([prompt], device=device)                          # (1, T)
    while True:
        n = cache.length
        positions = torch.arange(n, n + tokens.shape[1], device=device)
        logits = model(tokens, positions, cache, keep=[-1])                  # (1, 1, V)
        x = sampler.draw(logits[0, -1], rng, "token", cache.length)
        yield Step([x], trace={"kind": "plain", "position": cache.length, "token": x, "greedy": sampler.greedy,
                               "p": float(sampler.probs(logits[0, -1])[x]),               # the law's
                               "p_model": float(logits[0, -1].float().softmax(-1)[x])} if trace else None)
        tokens = torch.tensor([[x]], device=device)


def generate(steps: Iterable[Step], *, max_new_tokens: int, eos_ids: Iterable[int] = (),
             stop: Callable[[list[int]], bool] | None = None,
             stats: Stats | None = None) -> Iterator[int]:
    """Stream tokens from a decoder until the budget, an EOS, or `stop(new tokens so far)` is
    true (a stop string's text is complete). The EOS or stopping token is yielded, then it ends."""
    stats = stats if stats is not None else Stats()
    eos, out, t0 = set(eos_ids), [], time.perf_counter()
    if max_new_tokens <= 0:
        return
    for i, step in enumerate(steps):
        now = time.perf_counter()
        if i == 0:
            stats.prefill_seconds = now - t0
        else:
            stats.decode_seconds += now - t0
        stats.n_forwards += step.forwards
        stats.draft_forwards += step.draft_forwards
        stats.drafted += step.drafted
        take, ended = cut(step.tokens, out, max_new_tokens, eos, stop)
        # counted after the cut, like the step lengths: a step cut to n tokens kept n - 1 drafts
        # beyond its one token, whatever it had accepted (so tokens = steps + accepted)
        kept = min(step.accepted, len(take) - 1)
        stats.accepted += kept
        stats.hits += kept > 0
        stats.verify_steps += step.drafted > 0
        stats.step_lengths[len(take)] += 1
        if step.arm:
            stats.arms[step.arm] += 1
        stats.n_tokens += len(take)
        if i == 0:
            stats.first_step_tokens = len(take)
        out += take
        yield from take
        if ended or len(out) >= max_new_tokens:
            return
        t0 = time.perf_counter()


def cut(tokens: list[int], out: list[int], max_new_tokens: int, eos: set[int],
        stop: Callable[[list[int]], bool] | None) -> tuple[list[int], bool]:
    """The tokens of a step that generate() keeps after `out`, and whether the run ends there."""
    take = tokens[:max_new_tokens - len(out)]
    for j, x in enumerate(take):
        if x in eos or (stop is not None and stop(out + take[:j + 1])):
            return take[:j + 1], True
    return take, len(out) + len(take) >= max_new_tokens
