"""Sampling: logits -> probabilities, the one door to randomness, and verification.

Every random choice in the engine is a draw from a `Random` the caller passes in, and every
draw is keyed by (stream, absolute position): `Random(seed)` maps each key to one uniform u,
and a categorical draw is the inverse CDF at u. So a decoder that samples position t with key
("token", t) gets the very token plain sampling gets there, however many tokens it handles
per forward. Because a draw is a step function of u, a test can replace `Random` with a
source that walks every interval of u and so computes a decoder's exact output law.

Verification primitives, written once for all decoders:
- `verify_rejection`: chain speculative sampling (Leviathan et al. 2023, arXiv 2211.17192;
  Chen et al. 2023, arXiv 2302.01318), keeps the target law for any draft law q.
- `verify_match`: draw from the target with position-keyed noise and accept the candidate
  tokens that equal the draws (lookahead n-grams, lookup copies, coupled drafts). Output ==
  plain sampling with the same seed, token for token.
"""
from __future__ import annotations

import operator
import random
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class Sampler:
    """Logits -> the law to sample: temperature, then top-k, then top-p (HF transformers' order).

    top-k keeps every token whose logit is >= the k-th largest, so ties at the k-th value all
    stay (as HF's top-k warper does). top-p then keeps the smallest prefix of the tokens sorted
    by probability whose mass reaches top_p (Holtzman et al. 2019): a token stays when the mass
    before it is < top_p. Among tokens of equal probability the lower id comes first, so a tie
    straddling the cut keeps the lower ids; HF transformers 5.24.0 keeps the higher ones (the
    same number of tokens). Pinned by hand-worked examples in tests/test_filters.py.
    """
    temperature: float = 0.0   # 0 = greedy (argmax)
    top_k: int = 0             # 0 = off
    top_p: float = 1.0         # 1 = off

    def __post_init__(self):
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 <= t < float("inf"):
            raise ValueError(f"temperature must be a finite number >= 0, got {t!r}")
        # subtle: a subnormal t (1e-310) makes logits / t infinite and softmax NaN, which would
        # sample garbage without a word; below 1e-4 the law is argmax up to ties anyway
        if 0 < t < 1e-4:
            raise ValueError(f"temperature {t:g} is below 1e-4: that is greedy up to rounding "
                             "(and overflows nearer 0); pass 0 for greedy")
        # subtle: bool is an int, and top_k=2.5 would be compared, never used as a count
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top-k must be an integer >= 0, got {self.top_k!r}")
        if isinstance(self.top_p, bool) or not isinstance(self.top_p, (int, float)) \
                or not 0 < self.top_p <= 1:
            raise ValueError(f"top-p must be a number in (0, 1], got {self.top_p!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def probs(self, logits: Tensor) -> Tensor:
        """(..., V) logits -> (..., V) float64 probabilities; one-hot argmax when greedy."""
        x = logits.double()
        if torch.isnan(x).any() or (x == float("-inf")).all(-1).any():
            raise ValueError("logits are NaN or all -inf: no token can be sampled")
        if self.greedy:
            # ties go to the lowest id, as torch.argmax does
            return torch.zeros_like(x).scatter_(-1, x.argmax(-1, keepdim=True), 1.0)
        x = x / self.temperature
        if self.top_k and self.top_k < x.shape[-1]:
            kth = x.topk(self.top_k, dim=-1).values[..., -1:]                 # (..., 1)
            x = x.masked_fill(x < kth, float("-inf"))
        p = torch.softmax(x, dim=-1)
        if self.top_p < 1:
            # keep the smallest prefix of the sorted vocab whose mass reaches top_p
            sp, order = p.sort(dim=-1, descending=True)
            drop = sp.cumsum(-1) - sp >= self.top_p                          # mass before >= top_p
            p = p.masked_fill(drop.scatter(-1, order, drop), 0.0)
            p = p / p.sum(-1, keepdim=True)
        return p

    def draw(self, logits: Tensor, rng: Random, stream: str, position: int) -> int:
        """One token from (V,) logits: rng.categorical(self.probs(logits), stream, position).

        Greedy takes a shortcut with the same answer: the inverse CDF of a one-hot law is its
        argmax for every u, so no float64 law is built (~15 vocab-wide ops a step fewer).
        """
        if not self.greedy:
            return rng.categorical(self.probs(logits), stream, position)
        x = int(logits.argmax())                      # ties: the lowest id, as probs() has it
        # subtle: argmax returns a NaN's index, and 0 for a row of -inf; both fail here
        if not logits[x] > float("-inf"):
            raise ValueError("logits are NaN or all -inf: no token can be sampled")
        return x


# --------------------------------------------------------------------------- randomness

class Random:
    """Seeded, position-keyed uniforms: u(stream, position) is fixed by (seed, stream, position)."""

    def __init__(self, seed: int = 0):
        # the seed is written into every key's string: a float or a tuple would run but give
        # draws no other caller could reproduce by the documented integer seed
        if isinstance(seed, bool) or not isinstance(seed, int) or not -2**63 <= seed < 2**64:
            raise ValueError(f"seed must be an integer in [-2^63, 2^64), got {seed!r}")
        self.seed = seed

    def uniform(self, stream: str, position: int) -> float:
        # str seeds go through sha512 in CPython: stable across runs, platforms and processes
        return random.Random(f"{self.seed}/{stream}/{position}").random()

    def categorical(self, probs: Tensor, stream: str, position: int) -> int:
        """Inverse CDF: the first x with cdf(x) > u."""
        return icdf(probs, self.uniform(stream, position))

    def bernoulli(self, prob: float, stream: str, position: int) -> bool:
        return self.uniform(stream, position) < prob


def icdf(probs: Tensor, u: float) -> int:
    """The token x with cdf(x-1) <= u < cdf(x); never a token of probability 0.

    probs must be one law (V,) (see `check_probs`) and u in [0, 1), else ValueError.
    """
    check_probs(probs, "probs")
    if probs.dim() != 1:
        raise ValueError(f"probs must be one row (V,), got shape {tuple(probs.shape)}")
    if not 0 <= u < 1:
        raise ValueError(f"u must be in [0, 1), got {u}")
    cdf = probs.double().cumsum(-1)                                          # (V,)
    x = int(torch.searchsorted(cdf, torch.tensor([u], dtype=cdf.dtype, device=cdf.device), right=True))
    # subtle: rounding can leave cdf[-1] <= u < 1; then take the last token with mass
    return x if x < len(cdf) else int(probs.nonzero()[-1])


# --------------------------------------------------------------------------- input checks

PROB_TOL = 1e-6   # |sum - 1| allowed for a float64 row; 1e-4 for lower precision rows


def check_probs(rows: Tensor, name: str) -> None:
    """Each row (last dim) is a law: finite, >= 0, summing to 1 within PROB_TOL, else ValueError.

    A few whole-tensor ops and one host sync, so decoders can afford it every step.
    """
    if not torch.is_floating_point(rows) or rows.dim() == 0:
        raise ValueError(f"{name} must be a float tensor of probability rows, got {rows.dtype} {tuple(rows.shape)}")
    if rows.numel() == 0:
        return
    tol = PROB_TOL if rows.dtype == torch.float64 else 1e-4
    x = rows.double()
    sums = x.sum(-1)
    # a NaN or inf anywhere makes its row's sum NaN or inf, which fails the sum test
    if not bool(((sums - 1).abs() <= tol).all() & (x.min() >= 0)):
        raise ValueError(f"{name} rows must be finite, >= 0 and sum to 1 (within {tol:g}): "
                         f"min {float(x.min()):.6g}, sums {sums.flatten()[:4].tolist()}")


def check_ids(ids: list[int], V: int, name: str) -> None:
    """Token ids are ints in [0, V): -1 (a common padding id) would index token V-1."""
    for x in ids:
        try:
            ok = not isinstance(x, bool) and 0 <= operator.index(x) < V
        except TypeError:
            ok = False
        if not ok:
            raise ValueError(f"{name} must be token ids in [0, {V}), got {x!r}")


# --------------------------------------------------------------------------- verification

def verify_rejection(p: Tensor, q: Tensor, drafts: list[int], rng: Random, position: int) -> list[int]:
    """Chain rejection sampling; returns the accepted drafts plus one corrected or bonus token.

    drafts x_0..x_{K-1}, x_i at absolute position `position + i`, drawn from q_i (q is (K, V));
    p (K+1, V) holds the target's rows p_0..p_K, p_i the law at x_i's position.
        accept x_i with prob min(1, p_i(x_i) / q_i(x_i))
        on the first rejection emit y ~ norm(max(0, p_i - q_i)) and stop
        if all K accepted, emit a bonus y ~ p_K: the row after the last draft (0-indexed row K;
        drawing it from p_{K-1}, the last draft's own row, is the classic bug)
    P(emit x) = q(x) min(1, p/q) + (1 - sum min(p, q)) (p - q)_+(x) / sum (p - q)_+ = p(x).
    Bad input (shapes, ids outside [0, V), rows that are not laws, see `check_probs`) is a
    ValueError: a certification tool calls this with other people's drafts.
    """
    K = len(drafts)
    if p.dim() != 2 or q.dim() != 2 or p.shape[0] != K + 1 or tuple(q.shape) != (K, p.shape[1]):
        raise ValueError(f"with {K} drafts p must be ({K + 1}, V) and q ({K}, V), "
                         f"got {tuple(p.shape)} and {tuple(q.shape)}")
    check_ids(drafts, p.shape[1], "drafts")
    check_probs(p, "p")
    check_probs(q, "q")
    out = []
    for i, x in enumerate(drafts):
        if not q[i, x] > 0:
            raise ValueError(f"draft token {x} has q = 0: it could not have been drawn from q")
        if rng.bernoulli(min(1.0, float(p[i, x] / q[i, x])), "accept", position + i):
            out.append(x)
            continue
        residual = (p[i] - q[i]).clamp(min=0)                                # (V,)
        # subtle: sum is 0 only if p == q, where rejection has probability 0 (bar rounding)
        residual = residual / residual.sum() if residual.sum() > 0 else p[i]
        out.append(rng.categorical(residual, "residual", position + i))
        return out
    out.append(rng.categorical(p[len(drafts)], "token", position + len(drafts)))
    return out


def verify_match(first: Tensor, rows: Tensor, candidates: Tensor, sampler: Sampler,
                 rng: Random, position: int) -> tuple[list[int], int]:
    """Draw y_j ~ p_j with the key plain sampling uses; accept while some candidate agrees.

    A candidate drawn with the same uniform (coupled drafts: x = icdf(q, u), y = icdf(p, u),
    one shared u per position) is a shared-uniform inverse-CDF coupling, not a Gumbel or
    MinHash one (Daliri et al. 2024, arXiv 2408.07978, study those). It buys seed-identity
    with plain sampling, at a price: it accepts less often than rejection sampling, and how
    often depends on the order of the vocabulary. p = (.3, .3, .4), q = (0, .3, .7): rejection
    accepts with probability sum min(p, q) = 0.7; this coupling only when u >= .6, 0.4; with
    the tokens ordered (1, 2, 0), 0.7 (tests/test_sampling.py computes all three exactly).

    first (V,) logits for `position`; candidates (G, n) token ids; rows (G, n, V) logits,
    rows[g, j] = the target's logits after candidates[g, :j+1]. Returns the emitted tokens
    (1 to n+1) and the index of the candidate they follow (0 if none matched).
        y_0 ~ p(first); alive = {g : c_g[0] == y_0}
        while alive: y_j ~ p(rows[g*, j-1]) for the first g* in alive; alive &= c_g[j] == y_j
    Every y_j is the plain sampler's draw at position + j given the same prefix.
    Shapes that disagree or candidate ids outside [0, V) are a ValueError.
    """
    V = first.shape[-1] if first.dim() == 1 else -1
    if V < 0 or candidates.dim() != 2 or tuple(rows.shape) != (*candidates.shape, V):
        raise ValueError(f"verify_match needs first (V,), candidates (G, n), rows (G, n, V); got "
                         f"{tuple(first.shape)}, {tuple(candidates.shape)}, {tuple(rows.shape)}")
    ids = candidates.tolist()   # read once: one tensor op per element costs more than the draw
    if candidates.numel() and not (candidates.dtype in (torch.int64, torch.int32)
                                   and all(0 <= t < V for c in ids for t in c)):
        raise ValueError(f"candidates must be token ids in [0, {V}), got {candidates.flatten().tolist()[:8]}")
    y = sampler.draw(first, rng, "token", position)
    out, alive, best = [y], list(range(len(ids))), 0
    for j in range(candidates.shape[1] if ids else 0):
        alive = [g for g in alive if ids[g][j] == y]
        if not alive:
            break
        best = alive[0]
        y = sampler.draw(rows[best, j], rng, "token", position + j + 1)
        out.append(y)
    return out, best
