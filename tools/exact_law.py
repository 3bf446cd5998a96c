"""Exact output laws, by walking every branch of a decoder's random choices.

Used by the proof suite (tests/) and by the certification tool (tools/prove.py).

`Random` (engine/sampling.py) turns each key (stream, position) into one uniform u, and every
draw is a step function of u: a categorical draw is the inverse CDF at u, a Bernoulli(b) draw
is u < b. So the set of u values that leads to a given outcome is an interval, and its length
is that outcome's probability. `Enumerator` is a drop-in `Random` that, instead of drawing u,
keeps for every key the interval of u consistent with the choices made so far, and branches:
    run the decoder; at each draw, take the first branch not yet explored below this point
    weight of a run = product over draws of |chosen sub-interval| / |interval before|
    replay with the next untried branch until every path has been walked (depth first)
A key drawn twice (on purpose, or by a bug that reuses noise) is handled exactly: the second
draw splits the interval the first one left. The law comes out to float64 rounding (~1e-15).
"""
from __future__ import annotations

from collections import defaultdict

import torch

from engine.generate import generate


class Enumerator:
    """A `Random` stand-in that replays a fixed list of branch choices, then takes branch 0."""

    def __init__(self, path: list[int]):
        self.path = path            # branch index chosen at each draw, in draw order
        self.fanout: list[int] = []  # number of branches seen at each draw
        self.weight = 1.0
        self.interval: dict[tuple[str, int], tuple[float, float]] = {}

    def _draw(self, cuts: list[tuple[float, float, object]], key) -> object:
        """cuts: (lo, hi, outcome) pieces of [0, 1); choose among those meeting the key's interval."""
        lo, hi = self.interval.get(key, (0.0, 1.0))
        pieces = [(max(a, lo), min(b, hi), o) for a, b, o in cuts if min(b, hi) > max(a, lo)]
        i = len(self.fanout)
        choice = self.path[i] if i < len(self.path) else 0
        self.fanout.append(len(pieces))
        a, b, outcome = pieces[choice]
        self.weight *= (b - a) / (hi - lo)
        self.interval[key] = (a, b)
        return outcome

    def categorical(self, probs: torch.Tensor, stream: str, position: int) -> int:
        cdf = probs.double().cumsum(-1).tolist()
        cuts, prev = [], 0.0
        for x, c in enumerate(cdf):
            if c > prev:                                  # token x owns u in [cdf(x-1), cdf(x))
                cuts.append((prev, c, x))
            prev = max(prev, c)
        last = cuts[-1]                                   # rounding slack above cdf[-1]: same
        cuts[-1] = (last[0], 1.0, last[2])                # fallback as engine.sampling.icdf
        return self._draw(cuts, (stream, position))

    def bernoulli(self, prob: float, stream: str, position: int) -> bool:
        prob = min(max(prob, 0.0), 1.0)
        return self._draw([(0.0, prob, True), (prob, 1.0, False)], (stream, position))

    def uniform(self, stream: str, position: int) -> float:
        raise NotImplementedError("decoders draw through categorical / bernoulli only")


def decoder_law(run, n: int, eos_ids=()) -> dict[tuple[int, ...], float]:
    """Exact law of the first n tokens generate() emits; run(rng) returns a decoder generator."""
    law: dict[tuple[int, ...], float] = defaultdict(float)
    path: list[int] = []
    while True:
        rng = Enumerator(path)
        out = tuple(generate(run(rng), max_new_tokens=n, eos_ids=eos_ids))
        law[out] += rng.weight
        # next path: bump the deepest draw that still has an untried branch
        choices = path + [0] * (len(rng.fanout) - len(path))
        while choices and choices[-1] + 1 >= rng.fanout[len(choices) - 1]:
            choices.pop()
        if not choices:
            return dict(law)
        choices[-1] += 1
        path = choices


def reference_law(next_probs, n: int, eos_ids=()) -> dict[tuple[int, ...], float]:
    """P(x_1..x_n) = prod_t p(x_t | x_<t) by walking the tree; next_probs(prefix) -> (V,) probs."""
    law: dict[tuple[int, ...], float] = {}

    def walk(prefix: tuple[int, ...], prob: float):
        if len(prefix) == n or (prefix and prefix[-1] in eos_ids):
            law[prefix] = law.get(prefix, 0.0) + prob
            return
        p = next_probs(prefix)
        for x in p.nonzero().flatten().tolist():
            walk(prefix + (x,), prob * float(p[x]))

    walk((), 1.0)
    return law


def max_gap(a: dict, b: dict) -> float:
    """Largest |P_a(s) - P_b(s)| over all outcomes s."""
    return max(abs(a.get(s, 0.0) - b.get(s, 0.0)) for s in set(a) | set(b))
