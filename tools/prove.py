"""Certify a sampler: is the law of the tokens it emits the target law?

Two modes, one verdict table (`python -m tools.prove --help`):

- exact (white-box): the sampler draws through an injected random source (the engine's
  `Random` protocol: categorical / bernoulli keyed by (stream, position)); tools/exact_law.py
  walks every branch of those draws, so the law of the first n tokens comes out exactly and
  must match the target's to 1e-12.
- stat (black-box): the sampler uses any RNG it likes. We draw N independent runs, count the
  m possible n-token outcomes and compare the empirical law P^ with the exact target law P:
      TV^ = 1/2 sum_s |P^(s) - P(s)| = max over sets A of P^(A) - P(A)
      P(TV^ >= eps) <= (2^m - 2) exp(-2 N eps^2)        under P (Hoeffding on each of the
                                                         2^m - 2 proper sets A, union bound;
                                                         Bretagnolle-Huber-Carol)
  so we fail when TV^ > eps = sqrt(ln((2^m - 2) / alpha) / (2N)), alpha = 1e-6: a false alarm
  rate <= 1e-6 for any N, no asymptotics. Power: if TV(law, P) = d, Hoeffding on the set A*
  where law > P gives TV^ >= d - sqrt(ln(1/beta) / (2N)) with probability >= 1 - beta, so
  every d >= eps + sqrt(ln(100) / (2N)) is caught with probability >= 0.99 ("detects" below).
  An outcome of target probability 0 (or a token outside [0, V)) fails at once.

Targets and drafts are toy LMs: seeded random logits per prefix (`TableLM`), through the
engine's `Sampler` (temperature, top-k, top-p), or a tiny float64 Llama for the engine's own
decoders. A speculative verifier (Leviathan et al. 2023, arXiv 2211.17192; Chen et al. 2023,
arXiv 2302.01318) is driven by a loop that drafts K tokens from q, asks the verifier, and
appends what it returns, until n tokens are out.

The command line certifies each sampler in a child process under --time-limit (600 s by
default): a sampler that exits the process, raises KeyboardInterrupt, hangs or eats the machine
cannot pass for a verdict, and one whose first call is not back after NOTICE s is said on
stderr. Exit codes: 0 every sampler PASSed; 1 a FAIL was reached; 2 bad input, or a run refused
before it started (its first runs project past --time-limit); 3 no verdict (the sampler ended
the process or raised KeyboardInterrupt, or ran past the limit). Only 0 and 1 come with a
verdict table.
"""
from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.util
import inspect
import itertools
import json
import math
import multiprocessing
import sys
import time
from pathlib import Path
from dataclasses import asdict, dataclass
from typing import Callable, Iterator

import torch

from engine.generate import Step
from engine.fast.machine import available_bytes
from engine.load.template import cap_memory
from engine.sampling import Random, Sampler, verify_rejection
from tools.cli import Parser, first
from tools.exact_law import decoder_law, max_gap, reference_law

ALPHA, BETA, TOL = 1e-6, 0.01, 1e-12
# Bounds on the work the tool takes on, each from what the question needs:
MAX_SAMPLES = 10**7     # stat: N = 10^7 detects TV >= 0.0016 over 16 outcomes (0.0124 over 4,096);
                        # past it the Python loop (~0.6 ms a run here) takes days, the samples GBs
MAX_DRAFT = 64          # K: one verifier call drafts K tokens before the pilot can time anything
MAX_OUTCOMES = 4096     # V^n: the exact walk and the bincount are over V^n outcomes
TIME_LIMIT = 600.0      # s per sampler (--time-limit): an interactive wait; a stat run projected past it
                        # is refused, and a long certification asks for more
NOTICE = 10.0           # s: a sampler's first call still running then is said on stderr (a hang is silent)
PILOT = 50              # stat runs timed before the rest are projected (and refused or stated)
MEMORY = 8 << 30        # bytes a certification may add (RLIMIT_AS in its child), or half of free


class Refused(Exception):
    """Not the sampler's failure: the tool declines the work before it runs past its bounds."""


@dataclass
class Verdict:
    sampler: str
    mode: str                  # "exact" or "stat"
    passed: bool
    gap: float                 # exact: max |P_sampler(s) - P(s)|; stat: TV^ estimate
    threshold: float           # exact: 1e-12; stat: eps at false-alarm rate alpha
    p_value: float | None      # stat: (2^m - 2) exp(-2 N TV^2), capped at 1; exact: None
    samples: int | None        # stat: N
    outcomes: int              # m, outcomes of positive target probability
    detects: float | None      # stat: smallest TV caught with probability >= 0.99
    note: str = ""


# --------------------------------------------------------------------------- toy laws

class TableLM:
    """Any next-token law: seeded random logits per prefix, through a Sampler; prefix -> (V,)."""

    def __init__(self, seed: int, V: int, sampler: Sampler, scale: float = 1.5):
        self.seed, self.V, self.sampler, self.scale, self.memo = seed, V, sampler, scale, {}

    def __call__(self, prefix: tuple) -> torch.Tensor:
        if prefix not in self.memo:
            g = torch.Generator().manual_seed(hash((self.seed,) + tuple(prefix)) % 2**31)
            logits = torch.randn(self.V, generator=g, dtype=torch.float64) * self.scale
            self.memo[prefix] = self.sampler.probs(logits)
        return self.memo[prefix]


def tiny_llama(seed: int, V: int, n_layers: int, scale: float = 1.5):
    """A random float64 Llama (C=32, H=4, Hkv=2), weights drawn from `seed` (as tests/conftest.py)."""
    from engine.llama import Llama, LlamaConfig
    cfg = LlamaConfig(dim=32, n_layers=n_layers, n_heads=4, n_kv_heads=2, hidden_dim=48, vocab_size=V,
                      rope_theta=10000.0, tie_embeddings=False)
    model, g = Llama(cfg).double(), torch.Generator().manual_seed(seed)
    for name, p in sorted(model.named_parameters()):
        if name.endswith("norm.weight"):
            p.data = 1 + 0.1 * torch.randn(p.shape, generator=g, dtype=p.dtype)
        else:
            p.data = torch.randn(p.shape, generator=g, dtype=p.dtype) * scale / p.shape[-1] ** 0.5
    model.tok_embeddings.weight.data *= p.shape[-1] ** 0.5 / 4
    return model.requires_grad_(False)


def llama_lm(model, prompt: list[int], sampler: Sampler) -> Callable[[tuple], torch.Tensor]:
    """The plain sampler's law after prompt + prefix, from a full forward without any cache."""
    def next_probs(prefix):
        tokens = torch.tensor([prompt + list(prefix)])
        return sampler.probs(model(tokens, torch.arange(tokens.shape[1]))[0, -1])
    return next_probs


# --------------------------------------------------------------------------- exact (white-box)

def spec_run(verify, target, draft, K: int, prompt=()):
    """rng -> the speculative loop over LMs (prefix -> probs), all draws through rng."""
    def run(rng) -> Iterator[Step]:
        seq = list(prompt)
        while True:
            n, drafts = len(seq), []
            qs = []
            for i in range(K):
                qs.append(draft(tuple(seq + drafts)))
                drafts.append(rng.categorical(qs[-1], "draft", n + i))
            p = torch.stack([target(tuple(seq + drafts[:i])) for i in range(K + 1)])     # (K+1, V)
            q = torch.stack(qs) if K else p[:0]                                          # (K, V)
            out = answer(verify(p, q, drafts, rng, n), K)
            seq += out
            yield Step(out)
    return run


def answer(tokens, K: int) -> list[int]:
    """A verifier's tokens, at most K + 1 (K accepted drafts and one of its own), read lazily:
    an endless iterable is cut at K + 2 and fails, instead of filling the memory."""
    # subtle: list(tokens) would never return on itertools.count(); islice stops it
    out = [int(x) for x in itertools.islice(iter(tokens), K + 2)]
    if not out:   # the harness would wait forever for the next token
        raise ValueError("the verifier returned no token")
    if len(out) > K + 1:
        raise ValueError(f"the verifier returned more than K + 1 = {K + 1} tokens for {K} drafts")
    return out


def certify_exact(name: str, run, law: dict, n: int) -> Verdict:
    """run(rng) -> iterator of Steps; law: the target law of the first n tokens."""
    got = decoder_law(run, n)
    gap = max_gap(got, law)
    return Verdict(name, "exact", gap < TOL, gap, TOL, None, None, sum(v > 0 for v in law.values()), None)


# --------------------------------------------------------------------------- stat (black-box)

def log_sets(m: int) -> float:
    """ln(2^m - 2), the number of proper subsets of m outcomes, without overflow (m >= 2)."""
    return m * math.log(2) + math.log1p(-2.0 ** (1 - m))


def threshold(N: int, m: int, alpha: float = ALPHA) -> float:
    """eps with (2^m - 2) exp(-2 N eps^2) = alpha."""
    return math.sqrt((log_sets(m) - math.log(alpha)) / (2 * N))


def detects(N: int, m: int, alpha: float = ALPHA, beta: float = BETA) -> float:
    """The smallest TV caught with probability >= 1 - beta (see the module docstring)."""
    return threshold(N, m, alpha) + math.sqrt(math.log(1 / beta) / (2 * N))


def certify_samples(name: str, samples: torch.Tensor, law: dict, V: int, alpha: float = ALPHA) -> Verdict:
    """samples (N, n) token ids, one independent run per row; law over n-tuples of [0, V)."""
    N, n = samples.shape
    outcomes = sorted(s for s, v in law.items() if v > 0)
    m = max(len(outcomes), 2)
    eps, power = threshold(N, m, alpha), detects(N, m, alpha)
    if ((samples < 0) | (samples >= V)).any():
        bad = int(samples[(samples < 0) | (samples >= V)][0])
        return Verdict(name, "stat", False, 1.0, eps, 0.0, N, m, power, f"emitted token {bad} outside [0, {V})")
    idx = (samples * V ** torch.arange(n - 1, -1, -1)).sum(-1)                             # (N,)
    counts = torch.bincount(idx, minlength=V ** n).double()                                # (V^n,)
    P = torch.zeros(V ** n, dtype=torch.float64)
    for s in outcomes:
        P[sum(x * V ** (n - 1 - j) for j, x in enumerate(s))] = law[s]
    tv = 0.5 * float((counts / N - P).abs().sum())
    if (counts[P == 0] > 0).any():
        return Verdict(name, "stat", False, tv, eps, 0.0, N, m, power, "emitted an outcome of target probability 0")
    p_value = math.exp(min(0.0, log_sets(m) - 2 * N * tv * tv))
    return Verdict(name, "stat", tv <= eps, tv, eps, p_value, N, m, power)


def spec_samples(verify, target, draft, K: int, n: int, N: int, seed: int = 0, prompt=(),
                 limit: float | None = None, name: str = "") -> torch.Tensor:
    """N independent runs of the speculative loop with a black-box verify(p, q, drafts) -> tokens.

    Drafts come from q through our own generator; the verifier may use any RNG it likes.
    With `limit` (s), the first PILOT runs are timed and the rest projected: past the limit the
    run is Refused; otherwise a run of 10 s or more says on stderr how long it will take.
    """
    g, rows = torch.Generator().manual_seed(seed), torch.full((N, n), -1, dtype=torch.long)  # (N, n)
    t0 = time.monotonic()
    for r in range(N):
        if limit is not None and r == min(PILOT, N - 1) and r:
            pace(name, N, r, time.monotonic() - t0, limit)
        seq = list(prompt)
        while len(seq) < len(prompt) + n:
            drafts, qs = [], []
            for i in range(K):
                qs.append(draft(tuple(seq + drafts)))
                drafts.append(int(torch.multinomial(qs[-1], 1, generator=g)))
            p = torch.stack([target(tuple(seq + drafts[:i])) for i in range(K + 1)])
            out = answer(verify(p, torch.stack(qs) if K else p[:0], drafts), K)
            if any(not 0 <= x < p.shape[1] for x in out):   # outside the vocab: certify_samples says so
                seq += out
                break
            seq += out
        got = seq[len(prompt):len(prompt) + n]
        rows[r, :len(got)] = torch.tensor(got, dtype=torch.long)
    return rows


def pace(name: str, N: int, done: int, seconds: float, limit: float) -> None:
    """Project N runs from the first `done`; refuse past `limit`, state it when it is long."""
    total = seconds / done * N
    if total > limit:
        raise Refused(f"{name}: {N:,} runs would take about {clock(total)} ({seconds / done * 1e3:.2f} ms "
                      f"a run over the first {done}), past --time-limit {limit:g} s: ask for fewer "
                      f"--samples or a longer --time-limit")
    if total >= 10:
        print(f"note: {name}: {N:,} runs, about {clock(total)} (timed over the first {done})",
              file=sys.stderr, flush=True)


def clock(s: float) -> str:
    return f"{s:.0f} s" if s < 120 else f"{s / 60:.0f} min" if s < 7200 else f"{s / 3600:.1f} h"


def planted(law: dict, tv: float, toward: str, V: int, n: int):
    """A batched sampler whose law is exactly tv away from `law`: P_d = P + d (Q - P) / TV(P, Q).

    toward "mode": Q = all mass on the likeliest outcome (the always-accept kind of bias);
    toward "uniform": Q = uniform over P's support (a too-flat sampler).
    """
    if not (math.isfinite(tv) and tv >= 0) or toward not in ("mode", "uniform"):
        raise ValueError(f"planted:{tv}:{toward}: want planted:TV[:mode|uniform] with TV a number >= 0")
    keys = sorted(law)
    P = torch.tensor([law[s] for s in keys], dtype=torch.float64)
    if toward == "mode":
        Q = torch.zeros_like(P).index_fill_(0, P.argmax(), 1.0)
    else:
        Q = (P > 0).double() / (P > 0).sum()
    span = 0.5 * float((Q - P).abs().sum())
    if tv > span:
        raise ValueError(f"a planted bias of TV {tv} toward {toward} needs TV(P, Q) >= {tv}, have {span:.4f}")
    Pd = P + tv * (Q - P) / span if tv else P
    table = torch.tensor(keys, dtype=torch.long)                                           # (m, n)

    def sample(N: int, seed: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(seed)
        return table[torch.multinomial(Pd, N, replacement=True, generator=g)]              # (N, n)
    return sample


# --------------------------------------------------------------------------- built-in samplers

def hf_speculative(p: torch.Tensor, q: torch.Tensor, drafts: list[int]) -> list[int]:
    """HF transformers' `_speculative_sampling` (assisted generation, do_sample), fed p and q as
    log-probabilities in float32, as a model's logits would be; torch's global RNG decides."""
    from transformers.generation.utils import _speculative_sampling
    K = len(drafts)
    if K < 1:
        raise ValueError("hf-speculative needs --draft-len >= 1 (it slices the last K ids)")
    ids = torch.tensor([[0] + list(drafts)])                                     # (1, 1 + K)
    tokens, _ = _speculative_sampling(ids, q.log().float()[None], K, p.log().float()[None])
    return tokens[0].tolist()


def load(spec: str) -> Callable:
    """'module:function' or 'path/to/file.py:function' -> the function; a one-line ValueError
    otherwise, whatever importing the module did (a syntax error, an exception, sys.exit)."""
    mod, _, fn = spec.rpartition(":")
    if not mod or not fn:
        raise ValueError(f"sampler {spec!r}: expected a built-in name, module:function or file.py:function")
    if mod.startswith(".") and not mod.endswith(".py"):
        raise ValueError(f"sampler {spec!r}: a relative module name; give its dotted name from the "
                         "current directory or the path of its .py file")
    try:
        module = from_file(mod) if mod.endswith(".py") or "/" in mod else importlib.import_module(mod)
        f = getattr(module, fn)
    except (Exception, SystemExit) as e:  # noqa: BLE001  (the module's own code ran in there)
        raise ValueError(f"sampler {spec!r}: cannot load it ({type(e).__name__}: "
                         f"{str(e).splitlines()[0] if str(e) else ''})") from None
    if not callable(f):
        raise ValueError(f"sampler {spec!r}: {fn} is not a function")
    return f


def from_file(path: str):
    """The module in a .py file, by path (relative to the current directory)."""
    file = Path(path)
    if not file.is_file():
        raise FileNotFoundError(f"no such file {path}")
    spec = importlib.util.spec_from_file_location(file.stem, file)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def white_box(f: Callable) -> bool:
    """verify(p, q, drafts, rng, position) draws through rng; verify(p, q, drafts) does not."""
    try:
        return len(inspect.signature(f).parameters) >= 5
    except (TypeError, ValueError):
        return False


def certify(spec: str, mode: str, V: int, n: int, K: int, sampler: Sampler, N: int, seed: int,
            limit: float | None = None, returned: Callable[[], None] = lambda: None) -> Verdict:
    """One sampler by name: engine-*, hf-speculative, planted:TV[:mode|uniform], module:function.
    `limit` (s): a stat run whose first runs project past it is Refused. `returned()` is called
    once the sampler's first call has returned (at once for the tool's own samplers)."""
    target, draft, prompt = TableLM(11, V, sampler), TableLM(22, V, sampler), ()
    law = reference_law(lambda pre: target(tuple(prompt) + pre), n)
    if spec.startswith("planted:") or spec.startswith("engine-") and spec != "engine-rejection":
        returned()   # the tool's own code: no stranger's call to wait on
    if spec.startswith("planted:"):
        sample = planted(law, *planted_spec(spec), V, n)
        return certify_samples(spec, sample(N, seed), law, V)
    if spec in ("engine-plain", "engine-speculative", "engine-coupled", "engine-lookahead"):
        if mode != "exact":
            raise ValueError(f"{spec} runs on a tiny Llama in --mode exact only")
        return certify_engine_decoder(spec, V, n, K, sampler)
    if spec == "engine-rejection":
        f = verify_rejection
    elif spec == "hf-speculative":
        f = hf_speculative
    else:
        f = load(spec)
    if mode == "exact" and not white_box(f):
        raise ValueError(f"{spec}: --mode exact needs verify(p, q, drafts, rng, position) drawing through rng")
    if spec == "hf-speculative" and K < 1:
        raise ValueError("hf-speculative needs --draft-len >= 1 (it slices the last K ids)")
    f = first_return(f, returned)
    try:   # from here on an exception is the sampler's failure, not bad input
        if mode == "exact":
            return certify_exact(spec, spec_run(f, target, draft, K, prompt), law, n)
        if white_box(f):   # a white-box verifier run black-box: a fresh seeded Random per call
            seeds, g = iter(range(seed * 10**9, 10**18)), f
            f = lambda p, q, d: g(p, q, d, Random(next(seeds)), 0)  # noqa: E731
        torch.manual_seed(seed)   # black-box samplers on torch's global RNG: a run is reproducible
        return certify_samples(spec, spec_samples(f, target, draft, K, n, N, seed, prompt, limit, spec), law, V)
    except (Refused, MemoryError):   # the tool's bounds, not the sampler's law: no verdict
        raise
    except Exception as e:  # noqa: BLE001
        return Verdict(spec, mode, False, float("nan"), float("nan"), None, None, 0, None,
                       f"the sampler raised {type(e).__name__}: {e}")


def first_return(f: Callable, returned: Callable[[], None]) -> Callable:
    """f, calling returned() once, after its first call has returned (white_box still reads
    f's signature through functools.wraps)."""
    said = []

    @functools.wraps(f)
    def call(*args):
        out = f(*args)
        if not said:
            said.append(True)
            returned()
        return out
    return call


def planted_spec(spec: str) -> tuple[float, str]:
    """'planted:TV[:mode|uniform]' -> (TV, toward); a misspelling is an error, not a default."""
    parts = spec.split(":")
    try:
        tv = float(parts[1])
    except ValueError:
        tv = math.nan
    toward = parts[2] if len(parts) == 3 else "mode" if len(parts) == 2 else ""
    if not (math.isfinite(tv) and tv >= 0) or toward not in ("mode", "uniform"):
        raise ValueError(f"sampler {spec!r}: want planted:TV[:mode|uniform] with TV a number >= 0")
    return tv, toward


def certify_engine_decoder(spec: str, V: int, n: int, K: int, sampler: Sampler) -> Verdict:
    """The engine's own decoders on tiny float64 Llamas, exactly (as tests/test_proofs.py)."""
    from engine import lookahead, speculative
    from engine.generate import plain
    target, draft = tiny_llama(5, V, 3), tiny_llama(6, V, 1)
    prompt = [1 % V, 3 % V, 0]
    law = reference_law(llama_lm(target, prompt, sampler), n)
    runs = {
        "engine-plain": lambda rng: plain(target, prompt, sampler=sampler, rng=rng, max_new_tokens=n),
        "engine-speculative": lambda rng: speculative.decode(target, draft, prompt, sampler=sampler, rng=rng,
                                                             max_new_tokens=n, num_draft=K),
        "engine-coupled": lambda rng: speculative.decode(target, draft, prompt, sampler=sampler, rng=rng,
                                                         max_new_tokens=n, num_draft=K, verify="coupled"),
        "engine-lookahead": lambda rng: lookahead.decode(target, prompt, sampler=sampler, rng=rng,
                                                         max_new_tokens=n, window=2, ngram=3, guesses=2),
    }
    return certify_exact(spec, runs[spec], law, n)


def power_curve(law: dict, V: int, n: int, N: int, runs: int, tvs=(0, .0025, .005, .0075, .01, .02, .05)):
    """Detection rate of planted biases: {(toward, tv): fraction of `runs` runs that FAIL}."""
    rates = {}
    for toward in ("mode", "uniform"):
        for tv in tvs:
            sample = planted(law, tv, toward, V, n)
            fails = sum(not certify_samples("", sample(N, 1000 * r + 7), law, V).passed for r in range(runs))
            rates[toward, tv] = fails / runs
    return rates


def plot_power(rates: dict, N: int, m: int, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for toward in ("mode", "uniform"):
        tvs = sorted(tv for t, tv in rates if t == toward)
        ax.plot(tvs, [rates[toward, tv] for tv in tvs], "o-", label=f"bias toward {toward}")
    ax.axvline(detects(N, m), ls="--", c="gray", label=f"stated: detects TV >= {detects(N, m):.4f}")
    ax.axvline(threshold(N, m), ls=":", c="gray", label=f"threshold eps = {threshold(N, m):.4f}")
    ax.set(xlabel="planted TV distance", ylabel="fraction of runs that FAIL",
           title=f"black-box power, N = {N:,}, {m} outcomes, false alarm <= 1e-6")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


# --------------------------------------------------------------------------- CLI

def table(verdicts: list[Verdict]) -> str:
    rows = ["| sampler | mode | verdict | gap / TV^ | threshold | p-value | N | outcomes | detects TV >= |",
            "|---|---|---|---|---|---|---|---|---|"]
    for v in verdicts:
        f = lambda x, spec: "-" if x is None else format(x, spec)  # noqa: E731
        rows.append(f"| {v.sampler} | {v.mode} | {'PASS' if v.passed else 'FAIL'} | {v.gap:.3g} | "
                    f"{v.threshold:.3g} | {f(v.p_value, '.3g')} | {f(v.samples, 'd')} | {v.outcomes} | "
                    f"{f(v.detects, '.4f')} |" + (f" {v.note}" if v.note else ""))
    return "\n".join(rows)


def main(argv=None) -> int:
    ap = Parser(prog="python -m tools.prove", description=first(__doc__, "\n\n"),
                epilog="exit: 0 all PASS, 1 a FAIL, 2 bad input or refused before starting, 3 no verdict")
    ap.add_argument("samplers", nargs="+", metavar="SAMPLER",
                    help="engine-rejection | engine-plain | engine-speculative | engine-coupled | "
                         "engine-lookahead | hf-speculative | planted:TV[:mode|uniform] | module:function "
                         "| path/to/file.py:function (verify(p, q, drafts[, rng, position]) -> tokens)")
    ap.add_argument("--mode", choices=["exact", "stat"], default="exact", help="default exact")
    ap.add_argument("--vocab", type=int, default=4, help="V (default 4)")
    ap.add_argument("--tokens", type=int, help="n, positions whose joint law is checked (default K + 1, so that "
                                                "the first call's own token, its bonus if all K pass, is checked)")
    ap.add_argument("--draft-len", type=int, default=2, help=f"K drafts per verifier call (default 2, <= {MAX_DRAFT})")
    ap.add_argument("--samples", type=int, default=300_000,
                    help=f"N runs in --mode stat (default 300,000, <= {MAX_SAMPLES:,})")
    ap.add_argument("--temperature", type=float, default=1.0, help="default 1")
    ap.add_argument("--top-k", type=int, default=0, help="default 0 (off)")
    ap.add_argument("--top-p", type=float, default=1.0, help="default 1 (off)")
    ap.add_argument("--seed", type=int, default=0, help="in [0, 2^32), default 0")
    ap.add_argument("--time-limit", type=float, default=TIME_LIMIT, metavar="S",
                    help=f"seconds per sampler (default {TIME_LIMIT:g}): a stat run projected past it is "
                         "refused before the rest runs; any certification still running at S is stopped "
                         f"(exit 3); a first sampler call still running after {NOTICE:g} s is said on stderr")
    ap.add_argument("--json", action="store_true", help="one JSON list of verdicts instead of the table")
    a = ap.parse_args(argv)
    if a.tokens is None:   # K + 1, or as many as V^n <= MAX_OUTCOMES allows
        a.tokens = max(1, min(a.draft_len + 1, 12, int(math.log(MAX_OUTCOMES, max(a.vocab, 2)) + 1e-9)))
    torch.set_num_threads(1)   # tiny tensors: thread hand-offs cost more than the math
    try:
        check_args(a)
        sampler = Sampler(a.temperature, a.top_k, a.top_p)
        if sampler.greedy:
            raise ValueError("--temperature must be > 0: a greedy law is a single point")
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if a.tokens <= a.draft_len:   # subtle: the classic wrong bonus row then passes every check
        print(f"note: n = {a.tokens} <= K = {a.draft_len}: a verifier's own token after K accepted drafts "
              "lies past the checked tokens, so a wrong bonus row cannot fail (--tokens K + 1 checks it)",
              file=sys.stderr)
    verdicts = []
    for s in a.samplers:
        try:
            kind, got = isolated(lambda returned: certify(s, a.mode, a.vocab, a.tokens, a.draft_len, sampler,
                                                          a.samples, a.seed, a.time_limit, returned),
                                 a.time_limit, s)
        except KeyboardInterrupt:   # the child is gone (isolated's finally); so is every verdict
            return 130
        if kind != "verdict":   # no table at all: a partial one could pass for the whole answer
            print(f"error: {got}", file=sys.stderr)
            return 2 if kind == "error" else 3
        verdicts.append(got)
    clean = lambda d: {k: None if isinstance(x, float) and math.isnan(x) else x for k, x in d.items()}  # noqa: E731
    print(json.dumps([clean(asdict(v)) for v in verdicts], indent=1) if a.json else table(verdicts))
    return 0 if all(v.passed for v in verdicts) else 1


def check_args(a) -> None:
    """Every bound that can be judged before a sampler runs, so nothing big starts."""
    # subtle: test n first; V ** n with n = 10^9 is itself a huge integer that takes minutes
    if not 2 <= a.vocab <= 64 or not 1 <= a.tokens <= 12 or a.vocab ** a.tokens > MAX_OUTCOMES:
        raise ValueError(f"need 2 <= V <= 64, n >= 1 and V^n <= {MAX_OUTCOMES} outcomes, got V={a.vocab}, n={a.tokens}")
    if not 0 <= a.draft_len <= MAX_DRAFT:
        raise ValueError(f"--draft-len must be in [0, {MAX_DRAFT}], got {a.draft_len}")
    if not 1 <= a.samples <= MAX_SAMPLES:
        raise ValueError(f"--samples must be in [1, {MAX_SAMPLES:,}] (N = {MAX_SAMPLES:,} detects TV >= "
                         f"{detects(MAX_SAMPLES, 16):.4f} over 16 outcomes; more takes days), got {a.samples:,}")
    if not 0 <= a.seed < 2**32:
        raise ValueError(f"--seed must be in [0, 2^32), got {a.seed}")
    if not 1 <= a.time_limit <= 7 * 86400:   # NaN fails too
        raise ValueError(f"--time-limit must be in [1, 604800] seconds, got {a.time_limit:g}")


def isolated(work: Callable[[Callable[[], None]], Verdict], limit: float, name: str = "the sampler"
             ) -> tuple[str, object]:
    """work(returned) in a forked child under a time and memory limit -> ("verdict", Verdict),
    ("error", why: bad input or Refused) or ("none", why no verdict was reached). work calls
    returned() once the sampler's first call is back; until then, past NOTICE s, a note says so.

    A sampler is someone else's code: it may call sys.exit(0) or os._exit(0), loop forever or
    allocate without bound. Only a Verdict sent back through the pipe is a verdict.
    """
    ctx = multiprocessing.get_context("fork")   # the child inherits the loaded sampler code
    recv, send = ctx.Pipe(duplex=False)
    child = ctx.Process(target=child_main, args=(send, work), daemon=True)
    child.start()
    send.close()
    try:
        return answer_within(recv, limit, name)
    except EOFError:
        child.join(5)
        return "none", (f"no verdict: the sampler's process ended (exit code {child.exitcode}) "
                        "before one was reached")
    finally:
        if child.is_alive():
            child.kill()
        child.join()


def answer_within(recv, limit: float, name: str) -> tuple[str, object]:
    """The child's message within `limit` s, past its ("returned", None); one note on stderr if
    the sampler's first call is not back after NOTICE s, since a hang is otherwise silent until
    the limit. EOFError: the child died."""
    start, noted, back = time.monotonic(), limit <= NOTICE, False   # a limit that near needs no note
    while True:
        left = limit - (time.monotonic() - start)
        wait = left if noted or back else min(left, NOTICE - (time.monotonic() - start))
        if recv.poll(max(wait, 0)):   # subtle: poll is also True at EOF, when the child died
            kind, got = recv.recv()
            if kind != "returned":
                return kind, got
            back = True
        elif time.monotonic() - start >= limit:
            return "none", f"no verdict within --time-limit {limit:g} s: the certification was stopped"
        elif not (noted or back):
            noted = True
            print(f"note: {name}: the sampler's first call has not returned after {NOTICE:g} s; still "
                  f"waiting (--time-limit {limit:g} s)", file=sys.stderr, flush=True)


def child_main(send, work) -> None:
    try:
        limit_memory()
        message = "verdict", work(lambda: send.send(("returned", None)))
    except (ValueError, Refused) as e:
        message = "error", str(e)
    except SystemExit as e:   # the sampler called sys.exit() while running
        message = "none", f"no verdict: the sampler called sys.exit({e.code!r})"
    except MemoryError:
        message = "none", "no verdict: out of the memory a certification may use (RLIMIT_AS)"
    except BaseException as e:  # noqa: BLE001  KeyboardInterrupt, say: else multiprocessing prints
        # its traceback. A real Ctrl-C reaches the parent too, which leaves with 130 and kills us
        message = "none", f"no verdict: the sampler raised {type(e).__name__}"
    with contextlib.suppress(OSError):   # the parent may be gone (Ctrl-C)
        send.send(message)


def limit_memory() -> None:
    """Cap this process's address space at what it maps now plus MEMORY (or half the free
    memory): a sampler that allocates without bound gets a MemoryError, not the machine. Without
    /proc nothing is capped: the time limit still stops it."""
    free = available_bytes("cpu")
    cap_memory(MEMORY if free is None else min(MEMORY, free // 2))


if __name__ == "__main__":
    sys.exit(main())
