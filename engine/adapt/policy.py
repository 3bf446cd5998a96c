"""What adapts, apart from the algorithms it steers; a reader learning the algorithms may skip it.

Every decoder runs its paper's loop with fixed knobs when it is given no policy. Passed a
policy (`policy=`, the CLI's default), it asks before each step:

    Lookahead.choose(text, room) -> Choice(window, guesses, copy)   lookahead's arm
    CopyLength.length(text, proposal, n, beat, room) -> K           how much of a copy to send
    DraftLength.k, .update(k, accepted)                             speculative decoding's K
    pick_draft(target, drafts, prices)                              --draft auto's choice

by expected tokens per unit of cost. Every choice is one the algorithm is exact under, and it
is made from the tokens seen and fixed prices, never the clock: the same command, seed and
machine print the same tokens. A policy moves the speed, never greedy tokens, never the law,
and never coupled verification's seeded tokens (rejection's follow K; its law does not).

    cost(k rows) = 1 + slope (k - 1)      a k-row forward in one-row forwards, or a table
                                          measured once on this machine (engine/adapt/cost.py);
                                          lookahead and lookup pay DOUBT x each row past the first
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Callable, NamedTuple

import torch

from engine.draft import Draft, EarlyExit, Ngram
from engine.llama import Llama
from engine.lookup import find

# --------------------------------------------------------------------------- prices

# (matmul kind, torch's CPU dispatch) -> extra cost of each row past the first: least squares
# of cost(k) = 1 + slope (k - 1), k <= 32, over the tables in docs/forward-cost*.json (EPYCs,
# 2 threads, SmolLM2-135M; tests/test_policy.py holds each entry to its measurement)
SLOPE = {
    ("PackedLinear", "AVX512"): 0.04,   # oneDNN, reordered weights, Zen 4: 8 rows 1.18x one row
    ("PackedLinear", "AVX2"): 0.04,     # the same on an AVX2-only EPYC: 8 rows 1.17x
    ("Int4Linear", "AVX512"): 0.17,     # torch's int4 kernel, Q8 head, Zen 5: 8 rows 2.05x
    ("Int4Linear", "AVX2"): 0.25,       # 8 rows 2.7x (a bf16 head: packed.Q8_HEAD)
    ("Linear", "AVX512"): 0.06,         # nn.Linear (MKL repacks per call): 8 rows ~ 1.4x
    ("Linear", "AVX2"): 0.07,           # the same on an AVX2-only EPYC (docs/forward-cost.json, naive)
    ("cuda", ""): 0.005,                # a GPU is far from its compute peak at a few rows (not measured here)
}
UNKNOWN_SLOPE = 0.10                    # elsewhere: steep, so guessing must earn its rows
# The text's n-grams as a draft (draft.Ngram(3), matches of 3 or 2 tokens), scored on the greedy
# texts of SmolLM2-135M (4-bit path) for the 14 bench prompts, 64 tokens: at NGRAM_HITS of the
# positions it has a guess, and the guess is the next token NGRAM_PRIOR of the time (its prior
# alpha; chat 0.04 and 0.40, extraction 0.79 and 0.81)
NGRAM_HITS, NGRAM_PRIOR = 0.36, 0.68
# A smaller model of the target's family and tokenizer as the draft: its prior alpha. Greedy
# acceptance of Qwen2.5-Coder-0.5B's drafts by the 1.5B at the first position (4-bit path, the
# pair's bench, docs/pair.md): 0.98 on the HumanEval prompts, 0.78 on the chat ones; the prior
# sits at the lower, so a draft that turns out weak has cost few rows before alpha is measured
FAMILY_PRIOR = 0.8
# The target's own weights in 4 bits as the draft: its prior alpha. 4-bit SmolLM2-135M agrees with
# fp32 on 99.4% of greedy tokens (docs/fidelity.md), and as the draft of the fp32 target it gave
# 6.4-9.1 tokens per target forward on three prompts (alpha ~0.97 or more); at the old prior, 0.9,
# --draft auto priced it below the text's n-grams and ran at 0.97-1.15x plain where it gave 1.69-1.97x
COPY_PRIOR = 0.97
DRAFT_COST = {     # (draft's matmul kind, CPU dispatch) -> its one-row forward / an fp32 target's
    ("Int4Linear", "AVX512"): 0.41,     # the target in 4 bits: Zen 4 0.41, Zen 5 (Q8 head) 0.43 (docs/draft-price.json)
    ("Int4Linear", "AVX2"): 0.65,       # an AVX2-only EPYC: int4 28.7 vs fp32 44.1 ms a step
}


@dataclass(frozen=True)
class Prices:
    table: dict[int, float] | None = None   # k -> cost(k rows)/cost(1 row), measured (engine/adapt/cost.py)
    draft: float | None = None              # one draft token / one-row target forward, measured


def row_cost(model: Llama, table: dict[int, float] | None = None) -> Callable[[int], float]:
    """k -> cost of a k-row forward of `model`, one row = 1 (linear between table points)."""
    if table:
        return lambda k: interpolate(table, k)
    kind = (type(model.layers[0].feed_forward.w13).__name__, torch.backends.cpu.get_cpu_capability())
    if model.tok_embeddings.weight.device.type == "cuda":
        kind = ("cuda", "")
    slope = SLOPE.get(kind, UNKNOWN_SLOPE)
    return lambda k: 1 + slope * (max(k, 1) - 1)


def interpolate(table: dict[int, float], k: int) -> float:
    ks = sorted(table)
    if k <= ks[0] or len(ks) == 1:
        return table[ks[0]]
    for a, b in zip(ks, ks[1:]):
        if k <= b:
            return table[a] + (table[b] - table[a]) * (k - a) / (b - a)
    return table[b] + (table[b] - table[a]) / (b - a) * (k - b)   # past the last point: the last slope


def layer_share(model: Llama, layers: int) -> float:
    """The share of a one-row forward's weight reads spent in layers [0, layers) (the rest:
    the other layers and the LM head), from the model's shapes: one-row steps read weights."""
    return layers * layer_reads(model.config) / reads(model)


def layer_reads(c) -> int:
    """Parameters of one layer's projections: wqkv, wo, w13, w2."""
    return c.dim * (c.n_heads + 2 * c.n_kv_heads) * c.head_dim + c.n_heads * c.head_dim * c.dim \
        + 3 * c.dim * c.hidden_dim


def reads(model: Llama) -> int:
    """The weights a one-row forward of `model` reads, in parameters: every layer's and the
    head's (an embedding lookup reads one row)."""
    c = model.config
    return c.n_layers * layer_reads(c) + c.vocab_size * c.dim


# --------------------------------------------------------------------------- lookahead's arm

# (W, G) arms, cheap to costly: a plain step, then Jacobi windows with G pool guesses. Prompt
# lookup's copy is priced apart, per step: its match length varies from step to step, which a
# per-arm average cannot see. Pool-only arms (W = 0, G = 1 or 4) were never chosen beside it
# (14 bench prompts, 64 tokens each), so they went.
ARMS = ((0, 0), (2, 2), (3, 3), (5, 5))
COPY_MOST = 8                          # the copy arm proposes at most this many tokens


class Choice(NamedTuple):
    window: int       # W: Jacobi columns sent this step (the rest of the window pauses)
    guesses: int      # G: pool n-grams verified
    copy: list[int]   # or prompt lookup's copy, verified alone (window = guesses = 0)


class Lookahead:
    """Lookahead's policy: the copy where its price beats every arm tried, else `Arms`' pick.
    On an exact path every choice prints plain's tokens (tests/test_policy.py)."""

    def __init__(self, cost: Callable[[int], float], n: int, arms=ARMS, copy_most: int = COPY_MOST):
        self.n, self.copy_most, self.arm = n, copy_most, None
        self.arms, self.copier = Arms(arms, cost, n), CopyLength(cost)
        self.most_window, self.most_guesses = max(w for w, _ in arms), max(g for _, g in arms)

    def choose(self, text: list[int], room: int) -> Choice:
        full, m, _ = find(text, self.n, self.copy_most)
        copy = full[:self.copier.length(text, full, m, self.arms.best(), room)]
        self.arm = None if copy else self.arms.choose()
        arms_why = getattr(self.arms, "why", "")            # an Arms stand-in (a test's) may say nothing
        self.why = self.copier.why if copy else arms_why + (f"; {self.copier.why}" if full else "")
        return Choice(0, 0, copy) if copy else Choice(*self.arms.arms[self.arm], [])

    def update(self, tokens: int, rows: int) -> None:
        """The chosen step emitted `tokens` from a forward of `rows` rows (copies are not arms)."""
        if self.arm is not None:
            self.arms.update(self.arm, tokens, rows)


class Arms:
    """Pick (W, G) per step by expected tokens per unit of cost; a plain step is one of the arms.

        value(arm) = decayed tokens its steps emitted / decayed cost of their forwards
        choose: an arm unchosen for patience * (c - 1) steps (c = its nominal cost; untried
                arms count from step 0), cheap to costly, else the arm of highest value
    A try spends at most c - 1 extra units and comes at most once every patience * (c - 1)
    steps: exploration costs at most 1/patience of a plain step per step and per arm (1% each
    at 100). Where rows are cheap (a GPU: c = 1.055 for W2 G2's 12 rows) a window is first
    tried at the 6th step; where they are dear (an AVX2 EPYC's table: c = 1.67) at the 68th.
    """

    def __init__(self, arms, cost, n: int, decay: float = 0.8, patience: int = 100):
        self.arms, self.cost, self.decay = arms, cost, decay
        # rows if every guess is there: x takes the window's first cell, or sits alone
        self.nominal = [cost((n - 1) * (w + g) + (w == 0)) for w, g in arms]
        # subtle: a one-row arm (plain) has nothing to learn: 1 token for 1 unit, known, never retried
        plain = [w + g == 0 for w, g in arms]
        self.wait = [10**9 if p else max(1, round(patience * (c - 1))) for p, c in zip(plain, self.nominal)]
        self.tokens, self.spent = [float(p) for p in plain], [float(p) for p in plain]
        self.last = [0 if p else -1 for p in plain]
        self.step = 0

    def value(self, a: int) -> float:
        return self.tokens[a] / max(self.spent[a], 1e-9)

    def best(self) -> float:
        """The highest value of the arms tried so far (at least plain's 1)."""
        return max(self.value(a) for a in range(len(self.arms)) if self.last[a] >= 0)

    def name(self, a: int) -> str:
        w, g = self.arms[a]
        return f"W{w} G{g}" if w + g else "plain"

    def choose(self) -> int:
        """The arm for this step; `why` says in numbers what chose it (for --trace)."""
        self.step += 1
        for a in sorted(range(len(self.arms)), key=self.nominal.__getitem__):
            if self.step - max(self.last[a], 0) > self.wait[a]:
                self.why = (f"{self.name(a)} is tried: unchosen for {self.step - max(self.last[a], 0) - 1} steps "
                            f"(its wait {self.wait[a]} = patience x (its cost {self.nominal[a]:.2f} - 1))")
                return a                          # not tried for long, or never
        best = max(range(len(self.arms)), key=self.value)
        tried = ", ".join(f"{self.name(a)} {self.value(a):.2f}" for a in range(len(self.arms)) if self.last[a] >= 0)
        self.why = f"{self.name(best)} has the best tokens per unit of cost ({tried})"
        return best

    def update(self, arm: int, tokens: int, rows: int) -> None:
        self.tokens[arm] = self.decay * self.tokens[arm] + tokens
        self.spent[arm] = self.decay * self.spent[arm] + self.cost(rows)
        self.last[arm] = self.step


# --------------------------------------------------------------------------- copy length

class CopyLength:
    """How much of prompt lookup's proposal to send: the length that pays for its rows.

    Every proposal, sent or not, is checked against the tokens that followed it: a sent guess
    is accepted exactly that far (verify_match, on exact paths), so this shadow check is free
    and no step is spent exploring. By match length n and guess position j:

        p[n, j] = (agreed + a) / (checked + 1)        P(token j agrees | tokens < j agreed)
        E(K)    = 1 + sum_{j<K} prod_{i<=j} p[n, i]     tokens a forward with K guessed emits
        K*      = argmax_K E(K) / cost(1 + K), or 0 when that is <= beat (plain's 1)

    The prior a is 1/2, but 1/5 for the first token after a one-token match (n = 1, j = 0):
    that token agreed 0.17 of the time over the 14 bench prompts and 0.19 over 15 others
    (`bench/heldout.json`), where every other (n, j) agreed 0.4-0.9 of the time.
    """

    def __init__(self, cost: Callable[[int], float]):
        self.cost = cost
        self.checked, self.agreed = Counter(), Counter()      # (n, j) -> counts, as in p[n, j]
        self.pending: list[tuple[int, int, list[int]]] = []   # (text position, n, proposal)

    def length(self, text: list[int], proposal: list[int], n: int, beat: float = 1.0,
               room: int | None = None) -> int:
        """K* for `proposal` (find()'s guess after a match of n tokens) at the end of `text`:
        0 unless its tokens per unit of cost beat `beat`; at most `room` (the budget left)."""
        self.learn(text)
        if proposal:
            self.pending.append((len(text), n, proposal))
        best, cut, tokens, alive, priced = beat, 0, 1.0, 1.0, []
        for j in range(min(len(proposal), len(proposal) if room is None else room)):
            a = 0.2 if (n, j) == (1, 0) else 0.5                       # the prior (above)
            alive *= (self.agreed[n, j] + a) / (self.checked[n, j] + 1)
            tokens += alive
            priced.append(f"K={j + 1}: {tokens:.2f}/{self.cost(j + 2):.2f}")
            if tokens / self.cost(j + 2) > best:
                best, cut = tokens / self.cost(j + 2), j + 1
        # for --trace: E(K) / cost(1 + K) of each length, against what it had to beat
        self.why = (f"copy of {cut} after a {n}-token match: expected tokens / cost {best:.2f} beats {beat:.2f}"
                    if cut else f"a {n}-token match's copy does not pay ({', '.join(priced) or 'no room'}; "
                    f"to beat {beat:.2f})") + (f" [{', '.join(priced)}]" if cut else "")
        return cut

    def learn(self, text: list[int]) -> None:
        """Check each proposal against the tokens that followed it, once they decide it."""
        waiting = []
        for at, n, full in self.pending:
            after = text[at:at + len(full)]
            j = next((i for i, (a, b) in enumerate(zip(full, after)) if a != b), len(after))
            if j == len(after) < len(full):                  # agrees so far, not yet decided
                waiting.append((at, n, full))
                continue
            for i in range(min(j + 1, len(full))):           # positions 0..j were checked
                self.checked[n, i] += 1
                self.agreed[n, i] += i < j
        self.pending = waiting


# --------------------------------------------------------------------------- speculative's K

def best_k(alpha: float, c_draft: float, c_verify: Callable[[int], float], max_k: int) -> int:
    """The K in [0, max_k] with the most tokens per unit cost, K = 0 being a plain step (cost 1):
        sum_{i<=K} alpha^i / (K c_draft + c_verify(K))          (Leviathan et al., walltime factor)

    Example: best_k(0.8, 0.1, lambda k: 1.0, 16) == 6 (2.47 tokens per unit); at alpha = 0.1
    no K pays for its drafts, and K = 0 wins.
    """
    return max(range(max_k + 1), key=lambda k: rate(alpha, k, c_draft, c_verify))


def rate(alpha: float, k: int, c_draft: float, c_verify: Callable[[int], float]) -> float:
    tokens = sum(alpha ** i for i in range(k + 1))   # (1 - alpha^(K+1)) / (1 - alpha), no 0/0
    return tokens / (k * c_draft + c_verify(k) if k else 1.0)


class DraftLength:
    """K per step from the acceptance seen so far and fixed costs, never the clock.

        alpha = decayed accepted / decayed trials        (a step: `accepted` successes, then a
                                                          failure unless all K passed)
        K = best_k(alpha, c_draft, c_verify, most)
        at K = 0 nothing is measured, so after `probe` plain steps one step drafts K = 1;
        each probe that does not lift K doubles the wait (32, 64, 128, up to 256 steps); a
        probe whose draft is accepted sets it back to 32
    With c_draft = 0.74 (a 20-of-30-layer self-draft of SmolLM2-135M), K = 1 pays only when
    alpha > 0.75, so a weak draft decodes at plain's pace bar its probes.
    """

    def __init__(self, k: int, most: int, c_draft: float, c_verify: Callable[[int], float],
                 prior: float = 0.5, probe: int = 32):
        self.k, self.most, self.decay = k, most, 0.9       # forget a step's weight in ~10 steps
        self.c_draft, self.c_verify = c_draft, c_verify
        self.accepted, self.trials = 2 * prior, 2.0        # prior alpha, worth 2 trials, forgotten like the rest
        self.first_probe = self.probe = probe
        self.idle = 0                                      # plain steps since the last measurement
        self.why = self.reason()

    def reason(self) -> str:
        """K's numbers, for --trace: alpha, each K's tokens per unit of cost at it, against K = 0's 1."""
        alpha = self.accepted / self.trials
        rates = ", ".join(f"K={k}: {rate(alpha, k, self.c_draft, self.c_verify):.2f}" for k in range(min(self.most, 4) + 1))
        return f"alpha {alpha:.2f}, a draft token {self.c_draft:.2f} of a step; tokens per unit of cost {rates}"

    def update(self, k: int, accepted: int) -> None:
        if k:
            self.accepted = self.decay * self.accepted + accepted
            self.trials = self.decay * self.trials + accepted + (accepted < k)
            self.idle = 0
        else:
            self.idle += 1
        self.k = best_k(self.accepted / self.trials, self.c_draft, self.c_verify, self.most)
        if self.k or (k and accepted == k):                # drafting pays, or a probe all accepted
            self.probe = self.first_probe
        elif self.idle >= self.probe:                      # probe: one draft, to measure alpha
            self.k, self.probe = 1, min(2 * self.probe, 8 * self.first_probe)
        self.why = self.reason() + (f"; K=1 probes alpha after {self.idle} plain steps" if self.k and not
                                    best_k(self.accepted / self.trials, self.c_draft, self.c_verify, self.most) else "")


def costs(target: Llama, draft: Draft,
          prices: Prices = Prices()) -> tuple[float, Callable[[int], float], float]:
    """(cost of one draft token, K -> cost of the verifying forward, prior alpha), in units of a
    one-row target forward. Without a measured `prices.draft`, a draft of the target's own
    shapes in 4 bits costs DRAFT_COST by CPU dispatch (1 if the target is 4-bit too), another
    one its share of parameters.

    The prior: a self-draft 1/2; a copy of the target in fewer bits COPY_PRIOR; another model (a smaller
    one of the target's family, sharing its tokenizer: the doors check that) FAMILY_PRIOR; the
    text's n-grams NGRAM_PRIOR, where they have a token to propose; the n-grams with a model
    otherwise, the mix of the two at NGRAM_HITS. Unmeasured, another model's
    draft token costs its share of the weights a one-row forward reads (its layers and head).
    """
    rows = row_cost(target, prices.table)
    if isinstance(draft, Ngram) and draft.otherwise is not None:
        # the text's guess at NGRAM_HITS of the positions (free, NGRAM_PRIOR), the model's
        # elsewhere (its price and prior): each a share of one draft token
        c, verify, prior = costs(target, draft.otherwise, prices)
        return (1 - NGRAM_HITS) * c, verify, NGRAM_HITS * NGRAM_PRIOR + (1 - NGRAM_HITS) * prior
    if isinstance(draft, Ngram):           # no forward: a draft token costs its verify row alone
        return 0.0, lambda k: rows(k + 1), NGRAM_PRIOR
    if isinstance(draft, EarlyExit):       # layers < L: 1 row per draft; the rest on K+1 rows
        lower = layer_share(target, draft.layers)
        head = 1 - layer_share(target, target.config.n_layers)
        return lower + head, lambda k: lower + (1 - lower) * rows(k + 1), 0.5
    kind, copy = type(draft.layers[0].feed_forward.w13).__name__, four_bit_copy(target, draft)
    c = prices.draft
    if c is None and copy:   # unmeasured: by CPU dispatch; a 4-bit target's own copy is one target row
        same = kind == type(target.layers[0].feed_forward.w13).__name__
        c = 1.0 if same else DRAFT_COST.get((kind, torch.backends.cpu.get_cpu_capability()), 0.6)
    elif c is None:
        c = reads(draft) / reads(target)
    return c, lambda k: rows(k + 1), COPY_PRIOR if copy else FAMILY_PRIOR



def four_bit_copy(target: Llama, draft: Draft) -> bool:
    """Whether `draft` has the target's config in 4-bit layers (--draft int4, or a 4-bit target's
    own checkpoint as its draft): its price is measured (engine/adapt/cost.py, draft_price)."""
    return isinstance(draft, Llama) and draft.config == target.config \
        and type(draft.layers[0].feed_forward.w13).__name__ == "Int4Linear"


def draft_length(target: Llama, draft: Draft, prices: Prices = Prices(),
                 start: int | None = None, most: int = 16) -> DraftLength:
    """Speculative decoding's policy; it starts at `start`, or where the prior and prices say
    (K = 0 for a draft that costs most of a forward)."""
    c_draft, c_verify, prior = costs(target, draft, prices)
    k = best_k(prior, c_draft, c_verify, most) if start is None else start
    return DraftLength(k, most, c_draft, c_verify, prior)


def pays(target: Llama, draft: Draft, prices: Prices = Prices()) -> float:
    """Tokens per unit of cost at the draft's prior alpha and its best K (1.0: plain's pace).
    The text's n-grams draft on NGRAM_HITS of the steps only, the rest being plain steps:
        (h E(K) + 1 - h) / (h c_verify(K) + 1 - h),   E(K) = sum_{i<=K} alpha^i"""
    c_draft, c_verify, prior = costs(target, draft, prices)
    k = best_k(prior, c_draft, c_verify, 16)
    if not isinstance(draft, Ngram) or draft.otherwise is not None:   # a model drafts at every position
        return rate(prior, k, c_draft, c_verify)
    h, tokens = NGRAM_HITS, sum(prior ** i for i in range(k + 1))
    return (h * tokens + 1 - h) / (h * (c_verify(k) if k else 1.0) + 1 - h)


def pick_draft(target: Llama, drafts: list[tuple[Draft, Prices]]) -> Draft:
    """--draft auto: of (draft, its prices) pairs, the draft that `pays` most; the first of equals."""
    return max(drafts, key=lambda d: pays(target, *d))[0]


# --------------------------------------------------------------------------- per decoder

# subtle: a copy's length and an arm are each the best of several estimates, and the best of
# noisy estimates is overrated (the optimizer's curse); a kept price is also one moment's (a
# two-row forward measured 1.15-1.30x a one-row one within an hour on one VM). So lookahead's and
# lookup's policies pay each row past the first DOUBT times its price. Scored without a clock
# on 14 bench and 15 held-out prompts, under the kept prices and two others: tokens per unit of
# cost up 0.3-1.7% in every case, the worst prompt no worse (docs/archive/speed-log.md)
DOUBT = 1.25


def doubted(cost: Callable[[int], float]) -> Callable[[int], float]:
    return lambda k: 1 + DOUBT * (cost(k) - 1)


def for_lookahead(model: Llama, prices: Prices, knobs: dict) -> Lookahead:
    return Lookahead(doubted(row_cost(model, prices.table)), knobs.get("ngram") or 4)


def for_lookup(model: Llama, prices: Prices, knobs: dict) -> CopyLength:
    return CopyLength(doubted(row_cost(model, prices.table)))


def for_speculative(target: Llama, draft: Draft, prices: Prices, knobs: dict) -> DraftLength:
    return draft_length(target, draft, prices, start=knobs.get("num_draft"))


@dataclass(frozen=True)
class Adaptive:
    """How a registry decoder adapts: `build(model, [second,] prices, knobs)` makes what its
    decode(policy=) takes, unless a knob of `fixed_by` was given (then the textbook loop)."""
    build: Callable
    fixed_by: tuple[str, ...] = ()

    def adapts(self, knobs: dict, adaptive: bool = True) -> bool:
        return adaptive and not set(self.fixed_by) & set(knobs)


# the registry's decoders that take a policy (engine/decoders.py names them all)
POLICIES = {"lookahead": Adaptive(for_lookahead, fixed_by=("window", "guesses")),
            "speculative": Adaptive(for_speculative),
            "lookup": Adaptive(for_lookup)}


def adaptive(decoder: str, knobs: dict, adapt: bool = True) -> Adaptive | None:
    """The policy `decoder` runs under with these knobs and --adaptive, or None: its textbook loop."""
    a = POLICIES.get(decoder)
    return a if a is not None and a.adapts(knobs, adapt) else None
