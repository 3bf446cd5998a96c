"""One wiring for both front doors (the CLI, engine/doors/cli.py; the API, engine/doors/api.py):
load a model as a path asks, check a request, and turn (decoder, knobs, --adaptive) into the
decoder's steps, with its policy priced by this machine's costs.

    model = build(checkpoint, dtype=..., int4=..., batch_invariant=...)
    steps, knobs = wire("lookahead", model, (), prompt, knobs, adaptive=True, price=...,
                        sampler=..., rng=..., max_new_tokens=...)
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Callable, Iterator, NamedTuple

import torch

from engine.adapt.cost import calibrated, draft_price, probed
from engine.adapt.policy import Prices, adaptive as policy_for
from engine.decoders import DECODERS
from engine.draft import EarlyExit
from engine.fast.aot import check as compilable, compile_step, compiled
from engine.fast.artifacts import cache_home, unwritable
from engine.fast.invariant import row_attention
from engine.fast.packed import exact_by_default, packs, prepack
from engine.fast.prepared import int4_model
from engine.generate import Step
from engine.kvcache import ATEN_CAPABILITY
from engine.llama import Llama, LlamaConfig
from engine.load.config import load_config
from engine.load.tokenizer import Tokenizer
from engine.load.weights import load_model
from engine.sampling import Random, Sampler


def build(checkpoint, *, dtype: torch.dtype = torch.float32, device: str = "cpu", int4: bool = False,
          packed: bool = True, batch_invariant: bool | None = None, draft: bool = False,
          notify: Callable[[str], None] = lambda m: print(f"note: {m}", file=sys.stderr)) -> Llama:
    """The model as the CLI loads it: on `device` (cpu, cuda[:N]) in `dtype`; int4: --int4, the
    layer weights in 4-bit groups with bf16 activations (CPU; `dtype` is then bf16's); packed:
    the oneDNN matmuls (--no-prepack: False); batch_invariant: --batch-invariant (CPU or CUDA),
    every decoder's tokens plain's bit for bit (fp32, bf16, int4); None, as the CLI: on where
    it costs a one-row step nothing, bf16 and int4 on a CPU (packed.exact_by_default); notify:
    where a kept 4-bit file was bad and is prepared anew (engine/fast/prepared.py); draft: a
    speculative draft, whose 4-bit LM head may be 4-bit too (packed.quantize_int4's head_bits)."""
    device = check_device(device)
    if batch_invariant and not packed:   # as the CLI refuses --batch-invariant --no-prepack
        raise ValueError("batch_invariant sets the packed path's kernels: it has no effect with packed=False")
    if int4:   # quantized from the fp32 weights (Q4_1 grids come back exactly), kept on disk
        if torch.device(device).type != "cpu":
            raise ValueError(f"int4 quantizes a float32 CPU model, got one on {device}")
        model = int4_model(checkpoint, notify, head_bits=4 if draft else 8)
    else:
        model = load_model(checkpoint, device, dtype)
    if not packed:
        return model
    return prepack(model, exact_by_default(model) if batch_invariant is None else batch_invariant)


class RunPath(NamedTuple):
    """Which path a run takes: the flags it was given, the unasked ones filled in (`default_path`)."""
    dtype: str                   # a key of load.weights.DTYPES
    int4: bool
    batch_invariant: bool | None
    why: str = ""                # why the default is not the 4-bit path here ('' when asked for)

    @property
    def name(self) -> str:
        """The path in a few words, for the stats line: "int4 bf16", "fp32 batch-invariant", ..."""
        short = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16", "float64": "fp64"}[self.dtype]
        return ("int4 " if self.int4 else "") + short + (" batch-invariant" if self.batch_invariant and not self.int4
                                                       and short != "bf16" else "")


def path_name(path: "RunPath", model: Llama) -> str:
    """The path a loaded model runs on, as the stats line and Engine.path name it."""
    return path.name + (" compiled" if compiled(model) is not None else "")


def default_path(config: LlamaConfig, device: str = "cpu", dtype: str | None = None, int4: bool | None = None,
                 batch_invariant: bool | None = None, packed: bool = True) -> RunPath:
    """The path asked for, or where the flags leave it open the fastest one that is exact here:
    --int4 --dtype bfloat16 on a CPU whose kernels have SIMD, for a model whose projections
    pack in 4-bit groups (exact against its own plain where the kernel probe agrees); else
    fp32 with --batch-invariant (exact on a CPU and on CUDA; HF's tokens, but for a near-tie).
    --int4 alone means bf16 activations; a --dtype alone means that dtype, not 4 bits."""
    if dtype is None and int4 is None:
        why = (f"a model on {torch.device(device).type}" if torch.device(device).type != "cpu" else
               "no SIMD in torch's kernel dispatch" if ATEN_CAPABILITY == "DEFAULT" else
               "" if packs_int4(config) else "projections that do not pack in 4-bit groups of 32")
        if not why:
            return RunPath("bfloat16", True, batch_invariant)
        exact = packed and torch.device(device).type in ("cpu", "cuda")   # where its kernels are
        return RunPath("float32", False, exact if batch_invariant is None else batch_invariant, why)
    int4 = bool(int4)
    return RunPath(dtype or ("bfloat16" if int4 else "float32"), int4, batch_invariant)


def packs_int4(c: LlamaConfig) -> bool:
    """Whether every layer projection of a model so shaped takes torch's 4-bit kernel (packed.packs)."""
    q, kv = c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim
    shapes = [(q + 2 * kv, c.dim), (c.dim, q), (2 * c.hidden_dim, c.dim), (c.dim, c.hidden_dim)]
    return all(packs(torch.empty(o, i, device="meta")) for o, i in shapes)


def check_device(name, what: str = "device") -> torch.device:
    """`name` as torch understands it, on a device that exists here; else one ValueError."""
    try:
        d = torch.device(name)
    except (RuntimeError, ValueError, TypeError) as e:
        raise ValueError(f"{what} {name!r}: not a device ({str(e).splitlines()[0]})") from None
    if d.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"{what} {name}: CUDA is not available here")
    if d.type == "cuda" and d.index is not None and d.index >= torch.cuda.device_count():
        raise ValueError(f"{what} {name}: there are {torch.cuda.device_count()} CUDA devices")
    return d


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
    if draft is None and isinstance(second, Llama):   # a draft model, a 4-bit copy or another
        draft = draft_price(model, second, notify=notify, live=live, measure_now=measure_now)
    return Prices(table, draft)


def prices_move_tokens(decoder: str, knobs: dict, temperature: float, exact: bool) -> bool:
    """Whether a price can change this run's tokens: where K is sampled by rejection (the seeded
    tokens follow K, the law does not), or off an exact path (a k-row forward rounds apart).
    Match-verified decoders print plain's tokens whatever their policy chooses."""
    return not exact or (temperature > 0 and DECODERS[decoder].rejection(knobs))


def wire(decoder: str, model: Llama, second: tuple, prompt: list[int], knobs: dict, *, adaptive: bool,
         price: Callable[[tuple], tuple[tuple, Prices]], sampler: Sampler, rng: Random,
         max_new_tokens: int, trace: bool = False) -> tuple[Iterator[Step], dict, tuple]:
    """The decoder's steps, the knobs it got and its second model: knobs -> its policy, unless it runs its
    textbook loop (engine/adapt/policy.py, POLICIES) -> decode. `price(second)` gives the
    second model (the CLI's --draft auto may pick another) and the prices, only when a policy
    needs them: measured on a first run, so a textbook run measures nothing."""
    d, a = DECODERS[decoder], policy_for(decoder, knobs, adaptive)
    if a is not None:
        second, prices_ = price(second)
        knobs = {**knobs, "policy": a.build(model, *second, prices_, knobs)}
    steps = d.decode(model, *second, prompt, sampler=sampler, rng=rng, trace=trace,
                     max_new_tokens=max_new_tokens, **knobs)
    return steps, knobs, second


def second_checkpoint(target: str | Path, checkpoint: str | Path, load: Callable[[str | Path], Llama]) -> Llama:
    """A draft or an amateur from its checkpoint directory, loaded by `load` (the target's
    path), or one ValueError where its tokenizer does not give the target's ids to the same text."""
    load_config(checkpoint)   # a missing or malformed checkpoint: its own error, first
    why = Tokenizer.load(target).same_ids(Tokenizer.load(checkpoint))
    if why is not None:
        raise ValueError(f"{checkpoint}: its tokenizer is not the target's ({why}); a draft or an "
                         "amateur must share the target's tokenizer")
    return load(checkpoint)


def compile_second(model: Llama, second, notify: Callable[[str], None]):
    """The second model, compiled where the target's step is and it is not yet: an early
    exit's two halves (a self-draft's or an amateur's layers) beside the target's whole stack,
    or a draft or amateur Llama's own 4-bit step (another path's model stays eager: a draft's
    rounding moves no token, the target's verdicts decide them all)."""
    stack = compiled(model)
    if stack is None:
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


def check_compile(int4: bool, batch_invariant: bool | None, flag: str, four_bit: str, inexact: str) -> None:
    """The CLI's and the API's one rule for compiling: only the exact 4-bit step is compiled
    (engine/fast/aot.py), so `flag` needs `four_bit` and refuses `inexact`; else a ValueError."""
    if not int4 or batch_invariant is False:
        raise ValueError(f"{flag} compiles the exact 4-bit step: pass {four_bit} (and not {inexact})")


def on_exact_path(model: Llama) -> bool:
    """Whether every decoder on `model` prints its plain's tokens bit for bit: each row of a
    forward rounds as it would alone (fast.invariant.row_attention, and matmuls that keep rows
    apart), as this machine's kernel probe agrees (adapt.cost.probed, kept per machine), and,
    compiled, no forward that decides tokens ran eager since the prompt's."""
    return model.layers[0].attention.attend is row_attention and probed(model) \
        and not getattr(compiled(model), "eager", 0)
