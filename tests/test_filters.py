"""The sampling filter itself, pinned to an independent definition.

Why it matters: the exact-law proofs compare every decoder with plain sampling, and both share
`Sampler.probs`, so a filter that means the wrong thing (a boundary, a tie, the order of
temperature, top-k and top-p) passes them all. Here the filter meets a slow reference written
from the definitions (HF transformers' order and conventions, Holtzman et al. 2019 for top-p)
and hand-worked examples at exact boundaries and exact ties; each broken variant below fails.

Convention (also in the Sampler docstring): temperature, then top-k (every token tied with the
k-th largest logit is kept), then top-p on the renormalised law (the smallest prefix of the
sorted tokens whose mass reaches top_p; among equal probabilities the lower id comes first).
"""
import math

import pytest
import torch
from hypothesis import assume, given, strategies as st

from engine.sampling import Sampler


def reference(logits: list[float], t: float, k: int, top_p: float) -> tuple[list[float], bool]:
    """Plain-python filter from the definitions; also says if top_p sits within 1e-12 of a cut."""
    x = [v / t for v in logits]
    if k:
        kth = sorted(x, reverse=True)[min(k, len(x)) - 1]
        x = [v if v >= kth else -math.inf for v in x]
    top = max(x)
    w = [math.exp(v - top) for v in x]
    p = [v / sum(w) for v in w]
    near = False
    if top_p < 1:
        kept, mass = set(), 0.0
        for i in sorted(range(len(p)), key=lambda i: (-p[i], i)):     # ties: lower id first
            if mass >= top_p:
                break
            near |= abs(mass - top_p) < 1e-12
            kept.add(i)
            mass += p[i]
        near |= abs(mass - top_p) < 1e-12
        p = [v if i in kept else 0.0 for i, v in enumerate(p)]
        p = [v / sum(p) for v in p]
    return p, near


def log(*w):
    return [math.log(v) for v in w]


# (logits, temperature, top-k, top-p) -> the kept tokens, worked by hand. log(4, 2, 1, 1) gives
# the exact law (1/2, 1/4, 1/8, 1/8), so the cumulative masses 1/2, 3/4, 7/8 are exact.
EXAMPLES = {
    "top-k keeps every tie at the k-th value": ([3.0, 2.0, 2.0, 1.0], 1.0, 2, 1.0, {0, 1, 2}),
    "top-k=1 with a three-way tie keeps all three": ([2.0, 2.0, 2.0, 1.0], 1.0, 1, 1.0, {0, 1, 2}),
    "top-k without ties keeps exactly k": ([3.0, 2.0, 1.0, 0.0], 1.0, 2, 1.0, {0, 1}),
    "top-p reached exactly at 1/2 stops there": (log(4, 2, 1, 1), 1.0, 0, 0.5, {0}),
    "top-p reached exactly at 3/4 stops there": (log(4, 2, 1, 1), 1.0, 0, 0.75, {0, 1}),
    "top-p just above 3/4 takes one more": (log(4, 2, 1, 1), 1.0, 0, 0.7500001, {0, 1, 2}),
    "top-p tie at the cut keeps the lower id": (log(2, 1, 1), 1.0, 0, 0.6, {0, 1}),
    "top-p over four equal tokens keeps the two lowest ids": ([1.0, 1.0, 1.0, 1.0], 1.0, 0, 0.5, {0, 1}),
    "top-p = 1 keeps everything": (log(4, 2, 1, 1), 1.0, 0, 1.0, {0, 1, 2, 3}),
    "temperature before top-p (t=2 flattens: 0.37 < 0.5)": (log(4, 2, 1, 1), 2.0, 0, 0.5, {0, 1}),
    "top-k before top-p (renormalised 2/3 >= 0.6)": (log(4, 2, 1, 1), 1.0, 2, 0.6, {0}),
}


def kept(sampler_cls, logits, t, k, top_p) -> set[int]:
    p = sampler_cls(temperature=t, top_k=k, top_p=top_p).probs(torch.tensor(logits, dtype=torch.float64))
    return set(p.nonzero().flatten().tolist())


def failures(sampler_cls) -> list[str]:
    """The hand-worked examples this sampler class gets wrong."""
    return [name for name, (x, t, k, top_p, want) in EXAMPLES.items() if kept(sampler_cls, x, t, k, top_p) != want]


def test_the_hand_worked_examples_are_exact():
    assert torch.softmax(torch.tensor(log(4, 2, 1, 1), dtype=torch.float64), -1).tolist() == [.5, .25, .125, .125]
    for name, (x, t, k, top_p, want) in EXAMPLES.items():
        p, _ = reference(x, t, k, top_p)
        assert {i for i, v in enumerate(p) if v > 0} == want, name


def test_the_filter_keeps_exactly_the_hand_worked_tokens():
    assert failures(Sampler) == []


def test_the_filter_renormalises_what_it_keeps():
    p = Sampler(1.0, top_p=0.75).probs(torch.tensor(log(4, 2, 1, 1), dtype=torch.float64))
    assert p.tolist() == [2 / 3, 1 / 3, 0.0, 0.0]


@given(seed=st.integers(0, 2**16), t=st.floats(0.1, 4.0), k=st.integers(0, 9), top_p=st.floats(0.01, 1.0),
       ties=st.booleans())
def test_the_filter_equals_the_reference_definition(seed, t, k, top_p, ties):
    x = torch.randn(8, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * 2
    if ties:   # exact ties, where conventions matter: logits on a coarse grid
        x = x.round()
    want, near = reference(x.tolist(), t, k, top_p)
    assume(not near)   # a top_p within 1e-12 of a cut is decided by rounding; EXAMPLES pin those
    got = Sampler(temperature=t, top_k=k, top_p=top_p).probs(x)
    torch.testing.assert_close(got, torch.tensor(want, dtype=torch.float64), atol=1e-12, rtol=0)


# --------------------------------------------------------------------------- broken variants

def filtered(x, t, k, top_p, order="tkp", keep_k_ties=True, strict=False, ties_high=False):
    """A small filter with switches for the bugs the planted-bug study found."""
    def temp(x):
        return x / t

    def topk(x):
        if not k or k >= len(x):
            return x
        if keep_k_ties:
            return x.masked_fill(x < x.topk(k).values[-1], -math.inf)
        return torch.full_like(x, -math.inf).scatter(0, x.topk(k).indices, x.gather(0, x.topk(k).indices))

    def topp(x):
        p = torch.softmax(x, -1)
        if top_p >= 1:
            return x
        ids = sorted(range(len(p)), key=lambda i: (-float(p[i]), -i if ties_high else i))
        before, drop = 0.0, torch.zeros(len(p), dtype=torch.bool)
        for i in ids:
            drop[i] = before > top_p if strict else before >= top_p
            before += float(p[i])
        return x.masked_fill(drop, -math.inf)
    for step in order:
        x = {"t": temp, "k": topk, "p": topp}[step](x)
    return torch.softmax(x, -1)


def broken(**bug):
    class Broken(Sampler):
        def probs(self, logits):
            return filtered(logits.double(), self.temperature, self.top_k, self.top_p, **bug)
    return Broken


BROKEN = {
    "top-k keeps exactly k, dropping ties": broken(keep_k_ties=False),
    "top-p keeps one past an exact boundary (> instead of >=)": broken(strict=True),
    "top-p ties keep the higher id (HF transformers' side)": broken(ties_high=True),
    "top-p before temperature": broken(order="ptk"),
    "top-p before top-k": broken(order="tpk"),
}


def test_the_switchable_filter_unbroken_passes():
    # Why: the broken variants differ from this one by a single switch each.
    assert failures(broken()) == []


@pytest.mark.parametrize("name", BROKEN)
def test_a_broken_filter_fails_the_hand_worked_examples(name):
    assert failures(BROKEN[name]) != []
