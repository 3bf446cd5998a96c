"""What a step did, in words: `python -m engine.run --trace` prints this on stderr.

Decoders never print. Asked with `trace=True`, each one puts a plain dict in `Step.trace`
("kind" names the decoder; ids and floats only); this module turns it into lines with the
tokenizer. `claimed(trace)` is what a trace says the step emitted: tests/test_trace.py holds
every decoder to claimed(step.trace) == step.tokens, so the trace cannot tell a story the
tokens do not; a step the run ends inside (an EOS, --stop, the budget) ends with what it kept.
A block starts "#n @t kind": step n, whose first new token sits at position t.

    #12 @47 speculative K=2 rejection
      draft ' Paris'  p=0.912 q=0.85 u=0.118  accept  (u < p/q)
      draft '.'  p=0.05 q=0.601 u=0.402  reject  (u >= p/q)
      corrected ',' ~ norm((p - q)+)
      emitted ' Paris' ','
"""
from __future__ import annotations

import contextlib
import sys
from typing import Callable, Iterable, Iterator

import torch
from torch import Tensor

from engine.lookahead import step_rows, tree_mask


def claimed(trace: dict) -> list[int]:
    """The tokens a trace says its step emitted: the drafted ones it accepted, then one more."""
    kind = trace["kind"]
    if kind == "plain":
        return [trace["token"]]
    if kind == "lookahead":
        return list(trace["grams"][trace["best"]][:trace["accepted"]] if trace["accepted"] else []) + [trace["next"]]
    if kind == "lookup":
        return trace["guess"][:trace["accepted"]] + [trace["next"]]
    if "drafts" not in trace or "next" not in trace:   # a new decoder's own keys (docs/adding-a-decoder.md)
        raise ValueError(f"claimed(): no rule for a {kind!r} trace; give it one here, or speculative's "
                         "keys: 'drafts' (each with 'token' and 'verdict') and 'next'")
    return [d["token"] for d in trace["drafts"] if d["verdict"] == "accept"] + [trace["next"]]


def verdicts(p: Tensor, q: Tensor, drafts: list[int], out: list[int], u: list[float],
             logits: tuple[Tensor, Tensor] | None = None) -> dict:
    """A draft-then-verify step, as its trace holds it (Tracer prints it): each draft's p(x), q(x) (the laws its verdict read), the
    uniform u, and the verdict; then the target's own token (the correction, or the bonus if
    all passed). With the models' `logits` (target (K+1, V), draft (K, V)), also their
    probabilities of x at temperature 1: what a greedy trace shows, its laws being one-hot."""
    k, m = len(drafts), len(out) - 1
    rows, ids = torch.arange(k, device=p.device), torch.tensor(drafts, dtype=torch.long, device=p.device)
    at = lambda probs: probs[rows, ids].tolist()                                 # (K,)
    px, qx = at(p), at(q)
    pm, qm = [at(l[:k].float().softmax(-1)) for l in logits] if logits and k else (px, qx)
    verdict = ["accept"] * m + ["reject"] * (m < k) + ["unverified"] * (k - m - 1)
    return {"k": k, "next": out[-1], "bonus": m == k,
            "drafts": [{"token": x, "p": a, "q": b, "u": c, "verdict": v, "p_model": e, "q_model": f}
                       for x, a, b, c, v, e, f in zip(drafts, px, qx, u, verdict, pm, qm)]}


class Tracer:
    """Formats traces with `decode` (ids -> text); remembers the last lookahead mask shown."""

    def __init__(self, decode: Callable[[list[int]], str]):
        self.decode, self.mask = decode, None

    def show(self, ids) -> str:
        return " ".join(repr(self.decode([t])) for t in ids)

    def lines(self, n: int, t: dict) -> list[str]:
        return getattr(self, t["kind"])(f"#{n} @{t['position']} {t['kind']}", t)

    def plain(self, head, t):
        # greedy: the law is one-hot, so show how sure the model was instead
        p = f"argmax, model's p={t['p_model']:.3f}" if t.get("greedy") else f"p={t['p']:.3f}"
        return [f"{head}  {self.show([t['token']])}  {p}"]

    def lookahead(self, head, t):
        W, N, x, P = len(t["levels"][0]) if t["levels"] else 0, t["N"], t["x"], t["position"] - 1
        arm, then = t["arm"], self.show([t["next"]])
        how = ("the prompt's step (plain's)" if t.get("first") else f"W={W} N={N}" if not arm else
               "arm plain (one row)" if arm == "plain" else
               f"arm copy ({len(t['grams'][0])} tokens, priced)" if arm == "copy" else f"arm {arm}")
        out = [f"{head} {how}  x={self.show([x])} @{P}"
               + (f"  (after a prefill of {t['prefill']} prompt tokens)" if t["prefill"] else "")]
        out += [f"  why: {t['why']}"] if t.get("why") else []
        for l, level in enumerate(t["levels"] if W else []):   # level l, column k: position P + l + k
            cells = [x, *level[1:]] if l == 0 else level
            out.append(f"  window level {l} @{P + l}..{P + l + W - 1}: {self.show(cells)}"
                       + ("  (column 0 is x)" if l == 0 else ""))
        if "minted" in t:
            out.append(f"  window minted  @{P + N - 1}..{P + N + W - 2}: {self.show(t['minted'])}"
                       "  (argmax of each column)")
        if (W, N) != self.mask and not t.get("first"):   # the prompt's step is a causal chain
            self.mask = (W, N)                            # the trie's rows change every step
            out += self.picture(t["parent"], P, step_rows(W, N, 0))   # x and the window
        out += [f"  guess {g}: {self.show(gram)}" for g, gram in enumerate(t["grams"])]
        out.append(f"  accepted {t['accepted']} of guess {t['best']}, then {then}" if t["accepted"] else
                   f"  {'no guess matched; ' if t['grams'] else 'no guesses; '}the target's {then}")
        return out + [f"  emitted {self.show(claimed(t))}"]

    def picture(self, parent: list[int], P: int, head: int) -> list[str]:
        """The step's tree mask (lookahead.tree_mask), drawn when the window's W or N changes; rows
        [0, head) are x and the window (level l, column k = row l*W + k), the rest the trie."""
        n = len(parent)
        rows = f"x and the window 0..{head - 1}" if head > 1 else "x"
        trie = f", the guesses' trie {head}..{n - 1}" if n > head else ""
        out = [f"  mask, drawn when the window's shape changes: {n} rows ({rows}{trie}); row i sees row j = x"]
        for i, row in enumerate(tree_mask(parent).tolist()):   # itself and its ancestors
            out.append(f"    {i:3d} @{P + sum(row) - 1:<5d} " + "".join(".x"[seen] for seen in row))
        return out

    def lookup(self, head, t):
        if not t["guess"]:
            why = ("the prompt's step (plain's)" if t.get("first") else "no n-gram match: plain step"
                   if not t.get("found") else f"a match @{t['source']}, none sent ("
                   + ("no room left in the budget" if not t.get("room") else "the policy's price") + "): plain step")
            return [f"{head}  {why}  {self.show([t['next']])}"]
        return [f"{head}  the last {t['ngram']} token(s) also stand @{t['source']}; the {len(t['guess'])} "
                f"after them: {self.show(t['guess'])}",
                f"  accepted {t['accepted']} of {len(t['guess'])}, then {self.show([t['next']])}",
                f"  emitted {self.show(claimed(t))}"]

    def speculative(self, head, t):
        rule = "(u < p/q)" if t["verify"] == "rejection" else "(the target's own draw is x)"
        short = t.get("asked", t["k"]) > t["k"]   # the text's n-grams ran out before K
        note = ("  (the prompt's step: plain's)" if t.get("first") else
                f"  ({t['asked']} asked; the n-grams ran out after {t['k']})" if short and t["k"] else
                f"  ({t['asked']} asked; the n-grams had no match: a plain step)" if short else
                "  (K = 0: a plain step)" if t["k"] == 0 else "")
        out = [f"{head} K={t['k']}{' (adaptive)' if t['adaptive'] else ''} {t['verify']}{note}"]
        out += [f"  why: {t['why']}"] if t.get("why") else []
        out += self.drafts(t["drafts"], rule, t.get("greedy", False))
        return out + [self.last(t), f"  emitted {self.show(claimed(t))}"]

    def contrastive(self, head, t):
        rows = [f"expert argmax {self.show([t['expert'][i]])}  contrastive argmax {self.show([t['best'][i]])}"
                f"  |V_head|={t['plausible'][i]}  pick {self.show([x])}" for i, x in enumerate(claimed(t))]
        if not t["k"]:
            return [f"{head}  {rows[0]}"]
        out = [f"{head} K={t['k']} (the amateur drafts)"]
        out += self.drafts(t["drafts"], "(u < p/q)", t.get("greedy", False))
        return out + [self.last(t)] + [f"  @{t['position'] + i} {r}" for i, r in enumerate(rows)]

    def drafts(self, drafts: list[dict], rule: str, greedy: bool = False) -> list[str]:
        if greedy:   # one-hot laws: p/q is 1 or 0; the models' own probabilities say more
            rule = "(the target's argmax is x)"
        out = []
        for d in drafts:
            x, verdict = self.show([d["token"]]), d["verdict"]
            if verdict == "unverified":
                out.append(f"  draft {x}  not verified (an earlier draft was rejected)")
                continue
            laws = f"models' p={d['p_model']:.3f} q={d['q_model']:.3f}" if greedy else \
                f"p={d['p']:.3g} q={d['q']:.3g} u={d['u']:.3f}"   # .3g: a verdict on p, q < 1e-3 stays checkable
            why = rule if verdict == "accept" else rule.replace("<", ">=").replace(" is ", " is not ")
            out.append(f"  draft {x}  {laws}  {verdict}  {why}")
        return out

    def last(self, t: dict) -> str:
        """The target's own token: p_K is the row after the last draft (rows p_0..p_K)."""
        if t["bonus"]:
            return f"  {'bonus' if t['k'] else 'drew'} {self.show([t['next']])} ~ p_{t['k']}"
        if t.get("verify") == "coupled":
            return f"  corrected {self.show([t['next']])}: the target's own draw there"
        return f"  corrected {self.show([t['next']])} ~ norm((p - q)+)"


def traced(steps: Iterable, tracer: Tracer, file=None, cut: Callable | None = None) -> Iterator:
    """Pass the steps through, printing each one's trace first (on stderr by default). With
    `cut(tokens, out)` (generate.cut, bound to the run's budget, EOS and stops), a step the run
    ends inside says how many of its tokens it kept."""
    out: list[int] = []
    for n, step in enumerate(steps):
        take = cut(step.tokens, out)[0] if cut else step.tokens
        if step.trace is not None:
            lines = tracer.lines(n, step.trace)
            if len(take) < len(step.tokens):
                lines.append(f"  kept {tracer.show(take)}: the run ends there (EOS, --stop or the budget)")
            # a closed or full stderr loses the trace, never the answer the trace came with
            with contextlib.suppress(OSError, ValueError):
                print("\n".join(lines), file=file or sys.stderr, flush=True)
        out += take
        yield step
