"""One wiring for both front doors (the CLI, engine/doors/cli.py; the API, engine/doors/api.py):
check a request, and turn (decoder, knobs, --adaptive) into the decoder's steps, with its
policy priced by this machine's costs. Loading is engine/fast/paths.py's (`build`, the path a
run takes, whether it is exact) and engine/load/'s; this file holds only what both doors wire.

    model = build(checkpoint, dtype=..., int4=..., batch_invariant=...)          # fast/paths.py
    steps, knobs, second = wire("lookahead", model, (), prompt, knobs, adaptive=True, price=...,
                                sampler=..., rng=..., max_new_tokens=...)
"""
from __future__ import annotations

import os
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator, NamedTuple

import torch

from engine.adapt.cost import calibrated, draft_price
from engine.adapt.policy import Prices, adaptive as policy_for, pays
from engine.decoders import DECODERS
from engine.draft import Draft, EarlyExit, Ngram, model_of
from engine.fast.aot import check as compilable, compile_step, compiled
from engine.fast.artifacts import cache_home, unwritable
from engine.generate import Step
from engine.llama import Llama, LlamaConfig
from engine.load.tokenizer import Tokenizer
from engine.load.weights import family, second_checkpoint
from engine.sampling import Random, Sampler


def prices(model: Llama, second=None, table: dict | None = None, draft: float | None = None,
           notify: Callable[[str], None] | None = None, live: Callable[[str], None] | None = None,
           measure_now: bool = True) -> Prices:
    """The policy's prices, for the CLI and the API alike: `table` or this machine's k-row costs
    for `model`, and `draft` or, for a 4-bit copy of it, that draft's measured price; each
    measured on first use and kept (engine/adapt/cost.py: `live` hears a measurement start, `notify`
    where it went). On an inexact path
    (int4 or bf16 without their exact kernels) a price moves the tokens too, so both must read
    the same. not measure_now: what is kept, and fixed constants for what is not (a run whose
    tokens no price can move answers first; `prices` again after it keeps them for the next)."""
    table = calibrated(model, notify=notify, live=live, measure_now=measure_now) if table is None else table
    second = model_of(second)                        # beside the n-grams too: the model's price
    if draft is None and isinstance(second, Llama):   # a draft model, a 4-bit copy or another
        draft = draft_price(model, second, notify=notify, live=live, measure_now=measure_now)
    return Prices(table, draft)


def prices_move_tokens(decoder: str, knobs: dict, temperature: float, exact: bool) -> bool:
    """Whether a price can change this run's tokens: where K is sampled by rejection (the seeded
    tokens follow K, the law does not), or off an exact path (a k-row forward rounds apart).
    Match-verified decoders print plain's tokens whatever their policy chooses."""
    return not exact or (temperature > 0 and DECODERS[decoder].rejection(knobs))


class Auto(NamedTuple):
    """--draft auto (the API's second="auto"): every draft that can be built here, as (name,
    draft) pairs, for `pick` to weigh once prices are known; unpriced (the textbook loop), the
    first: a smaller model of the target's family, else the target in 4 bits, else the n-grams."""
    drafts: tuple


def second_for(spec, flag: str, target: Path, load: Callable[[Path, bool], Llama], copy_why: str | None) -> tuple:
    """A second-model spec as both doors take it (--draft/--amateur; the API's second=) ->
    decode()'s second model: a Llama, EarlyExit or Ngram as it is; an int or "layers:L" the
    target's first L layers; "ngram[:n]" the text's n-grams; "ngram[:n]+MODEL" (a draft) the
    n-grams where the text repeats, else MODEL ("int4" or a checkpoint); "int4" the target's
    weights in 4 bits; "auto" (a draft) Auto(the drafts above that can be built, a family
    draft also beside the n-grams); else a checkpoint
    directory, which must share the target's tokenizer. load(checkpoint, four_bit) loads on
    the target's path (four_bit: the 4-bit copy); copy_why: why no 4-bit copy can be built
    here, or None."""
    if not isinstance(spec, (str, int)) or isinstance(spec, bool):
        return (spec,)
    if isinstance(spec, int) or spec.startswith("layers:"):
        return (EarlyExit(spec if isinstance(spec, int) else int(spec.split(":", 1)[1])),)
    if spec.startswith("ngram") and "+" in spec and flag == "draft":   # the text where it repeats, else a model
        text, model = spec.split("+", 1)
        ngram, (draft,) = second_for(text, flag, target, load, copy_why)[0], second_for(model, flag, target, load, copy_why)
        if not isinstance(draft, Llama):
            raise ValueError(f"--draft {spec!r}: after 'ngram+' comes a draft model (a checkpoint or int4), got {model!r}")
        return (Ngram(ngram.n, ngram.least, draft),)
    if spec == "ngram" or spec.startswith("ngram:"):
        return (Ngram(int(spec.split(":", 1)[1])) if ":" in spec else Ngram(),)
    if spec == "int4" and flag == "draft":
        if copy_why is not None:
            raise ValueError(copy_why)
        return (load(target, True),)
    if spec != "auto" or flag != "draft":
        return (second_checkpoint(target, spec, lambda c: load(c, False)),)
    drafts = [(str(d), second_checkpoint(target, d, lambda c: load(c, False))) for d in family(target)]
    drafts += [(f"ngram:3+{name}", Ngram(otherwise=d)) for name, d in drafts]
    if copy_why is None:
        try:
            drafts.append(("int4", load(target, True)))
        except ValueError:                       # shapes that do not pack in groups of 32
            pass
    return (Auto(tuple(drafts) + (("ngram:3", Ngram()),)),)


def pick(model: Llama, second: tuple, prices_of: Callable[[Draft | None], Prices]) -> tuple[str, tuple, Prices]:
    """(name, second, its prices): an Auto's draft that pays most at its prices (policy.pays:
    tokens per unit of cost at its prior and best K; the first of equals), else `second` as it
    is ("" its name)."""
    if not second or not isinstance(second[0], Auto):
        return "", second, prices_of(second[0] if second else None)
    scored = [(name, d, prices_of(d)) for name, d in second[0].drafts]
    name, d, p = max(scored, key=lambda s: pays(model, s[1], s[2]))
    return name, (d,), p


def wire(decoder: str, model: Llama, second: tuple, prompt: list[int], knobs: dict, *, adaptive: bool,
         price: Callable[[tuple], tuple[tuple, Prices]], sampler: Sampler, rng: Random,
         max_new_tokens: int, trace: bool = False) -> tuple[Iterator[Step], dict, tuple]:
    """The decoder's steps, the knobs it got and its second model: knobs -> its policy, unless it runs its
    textbook loop (engine/adapt/policy.py, POLICIES) -> decode. `price(second)` gives the
    second model (the CLI's --draft auto may pick another) and the prices, only when a policy
    needs them: measured on a first run, so a textbook run measures nothing."""
    d, a = DECODERS[decoder], policy_for(decoder, knobs, adaptive)
    if a is None and second and isinstance(second[0], Auto):   # no policy, no prices: the first draft
        second = (second[0].drafts[0][1],)
    if a is not None:
        second, prices_ = price(second)
        knobs = {**knobs, "policy": a.build(model, *second, prices_, knobs)}
    steps = d.decode(model, *second, prompt, sampler=sampler, rng=rng, trace=trace,
                     max_new_tokens=max_new_tokens, **knobs)
    return steps, knobs, second


def compile_second(model: Llama, second, notify: Callable[[str], None]):
    """The second model, compiled where the target's step is and it is not yet: an early
    exit's two halves (a self-draft's or an amateur's layers) beside the target's whole stack,
    or a draft or amateur Llama's own 4-bit step (another path's model stays eager: a draft's
    rounding moves no token, the target's verdicts decide them all)."""
    stack = compiled(model)
    if stack is None:
        return second
    if isinstance(second, Auto):
        return Auto(tuple((name, compile_second(model, d, notify)) for name, d in second.drafts))
    if isinstance(second, Ngram) and second.otherwise is not None:
        compile_second(model, second.otherwise, notify)   # compiled in place: the text needs nothing
        return second
    if isinstance(second, EarlyExit) and (0, second.layers) not in stack.runners:
        compile_step(model, notify, splits=[second.layers])
    elif isinstance(second, Llama) and compiled(second) is None:
        try:
            compilable(second)
        except ValueError:
            return second
        compile_step(second, notify)
    return second


def encode(tokenizer: Tokenizer, text: str, raw: bool = False) -> list[int]:
    """A text prompt's ids, as the CLI and the API send it: one user message in the chat
    template (none: the text itself); raw (--raw): the text itself, its special-token strings
    (<|im_start|>, <s>) become control tokens. A blank text is a ValueError."""
    if not text.strip():
        raise ValueError("the prompt is empty")
    if raw or not tokenizer.chat_template:
        return tokenizer.encode(text, special=raw)
    return tokenizer.encode_chat([{"role": "user", "content": text}])


def check_context(n: int, max_new_tokens: int, config: LlamaConfig, flag: str = "max_new_tokens") -> None:
    """n prompt tokens and the token budget must fit the model's context, else a ValueError
    naming the budget as `flag`."""
    if n + max_new_tokens > config.max_seq_len:
        capped = ", capped at its sliding window" if config.sliding_window else ""
        raise ValueError(f"prompt ({n} tokens) + {flag} ({max_new_tokens}) exceeds the model's "
                         f"context ({config.max_seq_len}{capped})")


def cache_note() -> str | None:
    """One note where this machine's cache folder takes no file: the run goes on uncached."""
    folder = cache_home() / "engine"
    why = unwritable(folder)
    return None if why is None else (f"cannot write the cache {folder} ({why}): this run goes on without it "
                                     "(its 4-bit weights prepared anew, priced by fixed constants) and keeps "
                                     "nothing (set XDG_CACHE_HOME to a writable folder)")


def say(line: str) -> None:
    """A note on stderr, as the CLI prints it (compile's progress and fallbacks)."""
    print(f"note: {line}", file=sys.stderr, flush=True)


SLOTS = 16                        # engine runs at once that see each other
CORES = torch.get_num_threads()   # torch's default: one thread per core
_held: list[int] = []   # the slot (a lock file's fd) this process holds while a CLI run lasts


def slots(folder: Path | None = None) -> Path:
    """Where the slots are: one folder per user of this machine, whatever the cache folder (two
    runs with their own XDG_CACHE_HOME share the cores all the same)."""
    return folder or Path(tempfile.gettempdir()) / f"engine-runs-{getattr(os, 'getuid', lambda: 0)()}"


@contextmanager
def slot(folder: Path | None = None):
    """This run's slot among the engine runs on this machine, held while the block runs: an
    flock on one of SLOTS files in `slots()`, which the system lets go when the process ends, so
    a killed run leaves none behind. Nothing where the folder cannot be written."""
    fd = None
    try:
        import fcntl                                       # POSIX; elsewhere every run is alone
        slots(folder).mkdir(parents=True, exist_ok=True)
        for i in range(SLOTS):
            fd = os.open(slots(folder) / f"slot-{i}", os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except OSError:
                os.close(fd)
                fd = None
    except (ImportError, OSError):
        fd = None
    if fd is not None:
        _held.append(fd)
    try:
        yield
    finally:
        if fd is not None:
            _held.remove(fd)
            os.close(fd)                                   # closing lets the lock go


def others_running(folder: Path | None = None) -> int:
    """How many other engine runs hold a slot now (this process's own not counted); a run takes
    its slot before it looks, so two that start together each see the other."""
    try:
        import fcntl
        mine = [os.fstat(fd) for fd in _held]
        others = 0
        for path in slots(folder).glob("slot-*"):
            if any(os.path.samestat(m, os.stat(path)) for m in mine):
                continue
            fd = os.open(path, os.O_RDWR)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)   # free: nobody there
            except OSError:
                others += 1
            finally:
                os.close(fd)
        return others
    except (ImportError, OSError):
        return 0


def share_cores(threads: int | None, exact_int4: bool) -> tuple[int, int]:
    """(the threads this run takes, set in torch; the other engine runs it saw): `threads` if
    given (then it looks for none); else, on the exact 4-bit
    path (where a row's bits do not depend on the split: tests/test_faults.py) and with other
    engine runs holding slots, this machine's cores split among them; else torch's default.
    subtle: two runs of 2 threads each on 2 cores do not share, they collide (OpenMP threads spin
    while they wait: a first run took 149 s beside another, 11 s alone; 16 s each at 1 thread)."""
    others = others_running() if threads is None and exact_int4 else 0
    if others:
        threads = max(1, CORES // (others + 1))
    if threads is not None:
        torch.set_num_threads(threads)
    return torch.get_num_threads(), others
