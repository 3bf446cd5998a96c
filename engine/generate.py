"""The decoder protocol, the plain decoder every other one is checked against, and generate().

A decoder is a generator function
    decode(models..., prompt, *, sampler, rng, max_new_tokens, knobs...) -> Iterator[Step]
One yield is one iteration of its algorithm (one target forward, prefill included); the
Step holds the tokens it accepted. Decoders never stop by themselves: `generate()` alone knows
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
    tokens: list[int]      # newly accepted, len >= 1
    forwards: int = 1      # target forwards spent on them
    drafted: int = 0       # draft tokens the target verified this step
    accepted: int = 0      # of which accepted


@dataclass
class Stats:
    n_tokens: int = 0
    n_forwards: int = 0
    drafted: int = 0
    accepted: int = 0
    hits: int = 0                    # steps that accepted at least one draft token
    first_step_tokens: int = 0       # tokens the prefill forward produced
    prefill_seconds: float = 0.0     # until the first step (the prompt's forward)
    decode_seconds: float = 0.0      # every step after it
    step_lengths: Counter = field(default_factory=Counter)  # tokens per step -> steps

    @property
    def tokens_per_forward(self) -> float:
        return self.n_tokens / max(self.n_forwards, 1)

    @property
    def decode_tokens_per_second(self) -> float:
        # the first step's tokens are paid for by the prefill, so they are not counted here
        done = self.n_tokens - self.first_step_tokens
        return done / self.decode_seconds if self.decode_seconds > 0 else 0.0


def plain(model: Llama, prompt: list[int], *, sampler: Sampler, rng: Random,
          max_new_tokens: int) -> Iterator[Step]:
    """One token per forward: x_t ~ p(. | x_<t) with the key ("token", t)."""
    cache = KVCache.for_model(model, len(prompt) + max_new_tokens, scratch=0)  # checks the context
    device = model.tok_embeddings.weight.device
    tokens = torch.tensor([prompt], device=device)                          # (1, T)
    while True:
        n = cache.length
        positions = torch.arange(n, n + tokens.shape[1], device=device)
        logits = model(tokens, positions, cache, keep=[-1])                  # (1, 1, V)
        x = rng.categorical(sampler.probs(logits[0, -1]), "token", cache.length)
        yield Step([x])
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
        stats.drafted += step.drafted
        stats.accepted += step.accepted
        stats.hits += step.accepted > 0
        take, ended = step.tokens[:max_new_tokens - len(out)], False
        for j, x in enumerate(take):
            if x in eos or (stop is not None and stop(out + take[:j + 1])):
                take, ended = take[:j + 1], True
                break
        stats.step_lengths[len(take)] += 1
        stats.n_tokens += len(take)
        if i == 0:
            stats.first_step_tokens = len(take)
        out += take
        yield from take
        if ended or len(out) >= max_new_tokens:
            return
        t0 = time.perf_counter()
