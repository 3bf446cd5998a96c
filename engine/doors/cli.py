"""The command line: python -m engine.run --decoder lookahead --prompt "..."

Text streams to stdout as it is accepted (--trace: at the end); one stats line goes to stderr
(or, with --json, one JSON object goes to stdout instead). Bad input is one `error:` line on
stderr and exit code 2, before any text is printed; so is an answer that cannot be written
(stdout closed or full). Ctrl-C exits 130 and keeps what was streamed; a reader that closes
the pipe early (`| head`) ends it quietly with 141, as SIGPIPE would. A closed stderr (`2>&-`)
is taken as /dev/null, and one that fails drops the stats line and the trace, never the
answer: it still exits 0.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import resource
import sys
import textwrap
import time
from pathlib import Path

import torch

from engine.adapt.cost import kept_path, load_table, probed, table_key
from engine.adapt.policy import Prices
from engine.decoders import DECODERS, Decoder, Second
from engine.doors.receipt import line as receipt_line, receipt, reference
from engine.doors.session import (Auto, cache_note, check_context, compile_second, encode, pick, prices, prices_move_tokens,
                                  others_running, second_for, share_cores, slot, wire)
from engine.fast.paths import build, check_compile, check_device, default_path, on_exact_path, path_name
from engine.draft import EarlyExit, Ngram, model_of
from engine.fast.machine import resident_bytes
from engine.fast.aot import compile_step
from engine.generate import Stats, cut, generate
from engine.fast.machine import ATEN_CAPABILITY
from engine.load.config import load_config
from engine.load.tokenizer import StreamDecoder, Tokenizer
from engine.load.weights import DTYPES, default_checkpoint
from engine.sampling import Random, Sampler
from engine.trace import Tracer, traced



class Parser(argparse.ArgumentParser):
    """Bad flags in one line, with exit code 2 (tools/cli.py does the same for the tools)."""
    def error(self, message):
        self.exit(2, f"error: {message}\n")


# the fields as engine.generate.Stats defines them (one definition; none under python -OO)
STATS_HELP = "the stats line (stderr; the same fields in --json):\n" + textwrap.indent(
    textwrap.dedent((Stats.__doc__ or "").partition("\n\n")[2]).strip("\n"), "  ") + """
then whose tokens the run may leave: "near-exact path" (fp32: at a near-tie), "inexact path" (k-row
forwards round a row apart), or "rejection sampling: plain's law, not plain's tokens"; no such note:
it prints them bit for bit (an exact path, or one-row steps only)
  --json keys: decoder, text, path (the path it ran on: 4-bit, dtype, compiled) and path_why, tokens, n_tokens, n_forwards, draft_forwards, tokens_per_forward, drafted,
  accepted, acceptance, hits, verify_steps, hit_rate, step_lengths ({tokens: steps}), arms ({arm: steps}), seconds,
  tokens_per_second, prefill_seconds, decode_tokens_per_second, exact_path, near_exact, held_to
  and law_of (whose tokens, or only whose law, it must print), load_peak_rss_mb,
  decode_peak_rss_mb, notes, priced_by (the k-row cost table an adaptive run read, else null), and
  draft/draft_mb (speculative) or amateur/amateur_mb (contrastive)
--trace prints each step on stderr: plain its token; lookahead the window (levels x columns,
with positions), the mask when its shape changes, the arm, the guesses and what was accepted
from which; speculative each draft's p(x), q(x), u and verdict; contrastive the expert's
argmax, the pick and |V_head|; lookup the match and what was accepted of it."""


def parser() -> argparse.ArgumentParser:
    p = Parser(prog="python -m engine.run", description=__doc__ and __doc__.splitlines()[0], epilog=STATS_HELP,
               formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--decoder", default="plain", choices=DECODERS, help="decoding loop")
    p.add_argument("--prompt", help="the prompt (default: read stdin)")
    p.add_argument("--raw", action="store_true",
                   help="send the text as is: no chat template, and special-token strings in it "
                        "(<|im_start|>, <s>) become control tokens. Without --raw the text is one "
                        "user message and such strings in it stay plain text")
    p.add_argument("--max-new-tokens", type=int, default=128, help="token budget")
    p.add_argument("--stop", action="append", default=[], metavar="TEXT",
                   help="end once the output contains TEXT, which is not printed (repeatable)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=0, help="0 = off")
    p.add_argument("--top-p", type=float, default=1.0, help="1 = off")
    p.add_argument("--seed", type=int, default=0, help="seed of the position-keyed random source")
    p.add_argument("--checkpoint", help="HF-format checkpoint dir (default: SmolLM2-135M-Instruct)")
    p.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, ...")
    p.add_argument("--threads", type=int, default=None,
                   help="CPU threads for the matmuls (default: torch's, one per core, split among the engine "
                        "runs on this machine at once on the exact 4-bit path); tokens do not depend on it on the "
                        "exact paths")
    p.add_argument("--dtype", choices=DTYPES,
                   help="weights and activations (default: the fastest exact path here, --int4's bfloat16 on a "
                        "CPU where the model packs in 4-bit groups, else float32 with --batch-invariant; the "
                        "stats line names it). --dtype float32: HF transformers' tokens")
    p.add_argument("--no-prepack", action="store_true",
                   help="plain nn.Linear on CPU instead of oneDNN-reordered fp32/bf16 weights (slower, k-row "
                        "forwards most)")
    p.add_argument("--batch-invariant", action=argparse.BooleanOptionalAction,
                   help="each row of a forward rounds as it would alone (engine/fast/invariant.py), so every decoder "
                        "prints plain's tokens bit for bit where this machine's probe agrees (--json exact_path). "
                        "Default: on for bf16 and --int4 on a CPU (a one-row step costs about the same); off for "
                        "fp32 on a CPU (one-row steps ~9%% slower) and on CUDA (an H200's bf16 plain: 0.63x)")
    p.add_argument("--int4", action=argparse.BooleanOptionalAction,
                   help="(the default on a CPU) layer weights in 4-bit groups (exact for the shipped Q4_1 ones), the LM head in 8-bit "
                        "groups (Q8_0) under an AVX-512 dispatch, bf16 activations: "
                        "about 2x faster one-row steps on CPU, not token-identical to fp32; bf16 activations")
    p.add_argument("--compile", action="store_true",
                   help="--int4's layer stack compiled ahead of time (engine/fast/aot.py): built once per machine and "
                        "model (1-2 minutes; needs a C++ compiler), kept beside the cost table, loaded in seconds "
                        "after. Every decoder prints the compiled plain's tokens, which may differ from eager "
                        "plain's; where it cannot compile, one note and the eager step")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    p.add_argument("--receipt", action="store_true",
                   help="after the run, replay the prompt through this path's plain decoder (contrastive: its "
                        "own one-row steps) with the same sampler and seed, and say on stderr whether this "
                        "run's tokens are its, or the first token where they part and the top-2 logit gap "
                        "there (--json: key receipt); it costs one more plain run")
    p.add_argument("--trace", action="store_true",
                   help="print what every step did on stderr (see below); the answer then comes at the end")
    p.add_argument("--cost-table", metavar="JSON",
                   help="k-row forward costs for the adaptive choices, as written by `python -m tools.bench "
                        "--forward-cost` (default: this machine's, measured once into ~/.cache/engine/; fixed "
                        "constants where that cannot be written)")
    p.add_argument("--adaptive", action=argparse.BooleanOptionalAction, default=True,
                   help="a policy chooses per step from the tokens seen and the prices (engine/adapt/policy.py): "
                        "lookahead's arm (a copy, a plain step, a window size), lookup's copy length, "
                        "speculative's K (0 = a plain step); --no-adaptive: the textbook loop (default on)")
    g = p.add_argument_group("speculative's prices")
    g.add_argument("--draft-cost", type=float,
                   help="one draft token's cost in one-row target forwards, for --adaptive, of an int4 or "
                        "checkpoint draft (layers:L is priced by its share of the layers; default: "
                        "measured once on this machine beside the cost table)")
    add_knobs(p)
    return p


def add_knobs(p: argparse.ArgumentParser) -> None:
    """A flag per knob and second model the registry declares, under its decoder's heading;
    a knob two decoders share (num_draft) is one flag, under the first."""
    seen = set()
    for d in DECODERS.values():
        new = [k for k in d.knobs if k.name not in seen] + [d.second] * (d.second is not None)
        if not new:
            continue
        g = p.add_argument_group(d.about)
        for k in new:
            if isinstance(k, Second):
                g.add_argument(f"--{k.flag}", default=k.default, help=k.help)
            elif k.type is bool:
                g.add_argument(f"--{k.name.replace('_', '-')}", action="store_true", help=k.help)
            else:
                g.add_argument(f"--{k.name.replace('_', '-')}", type=k.type, default=k.default, help=k.help,
                               **({"choices": k.choices} if k.choices else {}))
            seen.add(getattr(k, "name", None))


def models(args, ckpt) -> tuple:
    """The second model a decoder needs, from its flag (session.second_for, as the API reads its
    second=): a checkpoint dir, `layers:L`, `ngram[:n]`, `int4` (the target's checkpoint again
    in 4 bits) or `auto`, every draft of those that can be built here, weighed once priced."""
    d = DECODERS[args.decoder]
    if d.second is None:
        return ()
    spec = getattr(args, d.second.flag)
    why = None
    if args.int4 or args.device != "cpu":
        why = "--draft int4 drafts for a target on the CPU that is not 4-bit itself" + (
            " (pass --dtype float32 for an fp32 target)" if args.int4 else "")
    elif spec == "auto" and ATEN_CAPABILITY == "DEFAULT":
        why = ""   # no SIMD: torch's 4-bit kernel is a scalar loop, dearer than the target's fp32
    # the fp32 target decides every token: its 4-bit copy needs no exact kernels unless asked
    copy = argparse.Namespace(**{**vars(args), "int4": True, "batch_invariant": bool(args.batch_invariant)})
    second = second_for(spec, d.second.flag, Path(ckpt),
                        lambda c, four_bit: load(c, copy if four_bit else args, draft=d.second.flag == "draft"), why)
    if isinstance(second[0], Auto):   # the stats line names the draft auto takes
        args.auto_names = {id(m): name for name, m in second[0].drafts}
    return second


def knobs(args) -> dict:
    """The decoder's knobs the command set; an unset one keeps decode()'s default."""
    return {k: getattr(args, k) for k in DECODERS[args.decoder].names if getattr(args, k) is not None}


def price_policy(args, model, second: tuple, notes: list) -> tuple[tuple, Prices]:
    """The second model and the policy's prices: this machine's cost table (measured once,
    then read back) and a draft model's price; --draft auto takes, of the drafts that can be
    built here, the one that pays most at its prior and prices (session.pick)."""
    # a measurement's start is said at once to a terminal (it takes seconds), where it went after
    # the answer; subtle: not to a pipe, whose reader is promised one error line for a request
    # refused after pricing (a self-draft deeper than the model is the decoder's to say)
    live = (lambda line: warn(f"note: {line}")) if to_terminal(sys.stderr) else None
    # a first run whose tokens no price can move answers first, priced by fixed slopes, and
    # measures after its answer (run(): args.measure_after), for the runs after it
    now = prices_move_tokens(args.decoder, knobs(args), args.temperature, on_exact_path(model, probed))
    # --draft auto: every draft priced, the one that pays most taken (session.pick)
    _, second, p = pick(model, second, lambda d: prices(model, d, args.cost_table, args.draft_cost,
                                                                  notes.append, live, now))
    args.measure_after = not now and args.cost_table is None and (
        p.table is None or (p.draft is None and args.draft_cost is None and second and model_of(second[0]) is not None))
    # which table the choices read: the run's --json and --trace say (a kept table is for good)
    args.priced_by = ("--cost-table" if args.cost_table is not None else
                      str(kept_path(table_key(model))) if p.table is not None else
                      "fixed slopes (this machine's are measured after this run)" if args.measure_after else
                      "fixed slopes (nothing could be kept)")
    if args.trace:   # with the run's notes, after its steps: a trace opens with its first step
        notes.append(f"prices: the k-row costs in {args.priced_by}")
    return second, p


def load(ckpt, args, draft: bool = False):
    return build(ckpt, dtype=DTYPES[args.dtype], device=args.device, int4=args.int4,
                 packed=not args.no_prepack, batch_invariant=args.batch_invariant, draft=draft)


def check_flags(args) -> None:
    """Every flag that can be judged without the checkpoint, before anything is read."""
    if args.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if args.threads is not None and not 1 <= args.threads <= 1024:
        raise ValueError(f"--threads must be in [1, 1024], got {args.threads}")
    # subtle: Python keeps undecodable argv bytes as lone surrogates; the tokenizer would raise
    # on them deep inside, so name them here
    for flag, text in [("--prompt", args.prompt or "")] + [("--stop", t) for t in args.stop]:
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            raise ValueError(f"{flag} is not valid UTF-8 text (character {e.start}: {text[e.start]!r})") from None
    device(args.device)
    if args.int4 and (args.dtype not in (None, "bfloat16") or args.device != "cpu"):
        raise ValueError("--int4 runs on the CPU with bf16 activations: pass --dtype bfloat16 (and no --device)")
    if args.compile:   # the default path is --int4's where nothing else is asked for (checked again once known)
        check_compile(args.int4 is not False and args.dtype in (None, "bfloat16") and args.device == "cpu",
                      args.batch_invariant, "--compile", "--int4 (no --dtype or --device)", "--no-batch-invariant")
    if "" in args.stop:
        raise ValueError("--stop '' would stop before the first token")
    if args.draft_cost is not None and not (math.isfinite(args.draft_cost) and 0.01 <= args.draft_cost <= 100):
        raise ValueError(f"--draft-cost must be a number in [0.01, 100], got {args.draft_cost:g}")
    if args.batch_invariant and args.no_prepack:
        raise ValueError("--batch-invariant sets the packed path's kernel; it has no effect with --no-prepack")
    for flag in ("checkpoint", "draft", "amateur"):
        spec = getattr(args, flag)
        if spec == "":   # '' is not "the default": it is a path nobody meant
            raise ValueError(f"--{flag} '' names no checkpoint")
        L = (spec or "").removeprefix("layers:")
        if flag != "checkpoint" and L != spec and not (L.isascii() and L.isdigit()):
            raise ValueError(f"--{flag} {spec!r}: expected layers:L with L an integer")
        text = (spec or "").split("+", 1)[0]   # ngram[:n]+MODEL: the n-grams, else a draft model
        n = text.removeprefix("ngram").removeprefix(":")
        if flag != "checkpoint" and text.startswith("ngram") and (
                text not in ("ngram", f"ngram:{n}") or n and not (n.isascii() and n.isdigit() and 1 <= int(n) <= 64)):
            raise ValueError(f"--{flag} {spec!r}: expected ngram or ngram:n with n an integer in [1, 64]"
                             " (then, if wanted, +MODEL: a draft model where the text has no match)")
        if flag == "amateur" and (spec or "").startswith("ngram"):
            raise ValueError(f"--amateur {spec!r}: the amateur is a model (a checkpoint or layers:L); "
                             "n-grams draft for speculative only")
    t = args.amateur_temperature   # the same rule as Sampler's temperature (sampling.py)
    if not (math.isfinite(t) and t >= 1e-4):
        raise ValueError(f"--amateur-temperature must be a finite number >= 1e-4 (a smaller one "
                         f"overflows l_A / tau), got {t:g}")


def device(name: str) -> torch.device:
    """--device as torch understands it, on a device that exists here and can hold weights."""
    d = check_device(name, "--device")
    if d.type not in ("cpu", "cuda"):   # meta holds no data; others are untested here
        raise ValueError(f"--device {name!r}: only cpu and cuda[:N] run the engine")
    return d


def read_stdin(most: int) -> str:
    """stdin read to its end but never past `most` bytes (`yes |` never ends)."""
    if sys.stdin is None:
        raise ValueError("no --prompt, and stdin is closed")
    data = getattr(sys.stdin, "buffer", sys.stdin).read(most + 1)
    data = data if isinstance(data, bytes) else data.encode()   # a text stream without .buffer
    if len(data) > most:
        raise ValueError(f"stdin holds more than {most:,} bytes, more text than the model's context can hold")
    try:  # decoded here, strictly: the locale's decoder may keep bad bytes as surrogates
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"stdin is not UTF-8 text ({e.reason}: byte {data[e.start]:#04x} "
                         f"at offset {e.start})") from None


def bound_knobs(args) -> list[str]:
    """Clamp lookahead's and the drafts' sizes to what the token budget can use -> one note per
    clamp. A window column or a draft token past the budget can never be accepted, yet each
    costs memory: --num-draft 10^9 would try to allocate a cache of 10^9 slots. (A lookahead
    step wider than the model's context is lookahead.decode's to refuse.)"""
    notes = []
    for name in DECODERS[args.decoder].sizes:
        top = args.max_new_tokens + 1 if name == "ngram" else args.max_new_tokens   # x and N-1 tokens after it
        v = getattr(args, name)
        if v is not None and v > top:
            notes.append(f"--{name.replace('_', '-')} {v} clamped to {top}, the most the token budget can use")
            setattr(args, name, top)
    return notes


def run(args) -> dict:
    check_flags(args)
    sampler, rng = Sampler(args.temperature, args.top_k, args.top_p), Random(args.seed)
    ckpt = default_checkpoint() if args.checkpoint is None else args.checkpoint
    if not Path(ckpt).is_dir():
        raise ValueError(f"checkpoint {ckpt} is not a directory "
                         "(convert a GGUF with `python -m tools.convert convert`)")
    config = load_config(ckpt)                  # validated before any weight is read
    path = default_path(config, args.device, args.dtype, args.int4, args.batch_invariant, not args.no_prepack)
    args.dtype, args.int4, args.batch_invariant = path.dtype, path.int4, path.batch_invariant
    # other engine runs at once split the cores (on the exact 4-bit path, where tokens do not move)
    threads, args.others = share_cores(args.threads, bool(path.int4 and path.batch_invariant is not False))
    if args.compile and not args.int4:
        raise ValueError(f"--compile compiles the exact 4-bit step, and this run's path is {path.name} ({path.why})")
    tok = Tokenizer.load(ckpt)
    if tok.vocab_size > config.vocab_size:   # an id past the embedding would index no row
        raise ValueError(f"{Path(ckpt) / 'config.json'}: vocab_size {config.vocab_size} is smaller "
                         f"than the tokenizer's {tok.vocab_size} ids")
    # a text of more than context x the longest token's characters cannot fit; 4 bytes a character
    text = args.prompt if args.prompt is not None else read_stdin(4 * tok.max_text_chars)
    prompt = encode(tok, text, args.raw)        # --raw: control tokens on purpose; see --help
    check_context(len(prompt), args.max_new_tokens, config, "--max-new-tokens")
    # subtle: the clamps are said with the run's other notes, after it: checks still to come (the
    # cost table, --draft, the decoder's own knobs) may refuse the run, and a note ahead of the
    # error line would read as if the run went on
    clamps = bound_knobs(args) + [n for n in [cache_note()] if n] + [
        f"{args.others} other engine run(s) share this machine: {threads} thread(s) here (--threads sets them), and "
        "its prices are left for a run alone to measure"] * bool(args.others)
    # every knob of the decoder (an early exit's depth too), judged on the config alone: a bad
    # one costs no load, no 4-bit preparing and no price measuring
    spec = getattr(args, DECODERS[args.decoder].second.flag) if DECODERS[args.decoder].second else None
    early = EarlyExit(int(spec.split(":", 1)[1])) if spec and spec.startswith("layers:") else None
    DECODERS[args.decoder].check(config, early, **knobs(args))
    args.cost_table = load_table(args.cost_table) if args.cost_table is not None else None  # '' too
    model = load(ckpt, args)
    second, notes = models(args, ckpt), clamps    # a bad --draft or --amateur fails before measuring
    if args.compile:   # built once per machine and model (said as it goes), then loaded
        model = compile_step(model, lambda line: warn(f"note: {line}"))
        second = tuple(compile_second(model, m, lambda line: warn(f"note: {line}")) for m in second)
    d, given = DECODERS[args.decoder], knobs(args)
    # a policy is priced by this machine's costs (a note says where they went); --draft auto picks here
    steps, given, second = wire(args.decoder, model, second, prompt, given, adaptive=args.adaptive,
                                price=lambda second: price_policy(args, model, second, notes), sampler=sampler,
                                rng=rng, max_new_tokens=args.max_new_tokens, trace=args.trace)
    load_peak = peak_rss_mb(reset=True)       # the decoding peak is measured from here on
    # a stop string that the newest token completes lies in the text of the last m tokens
    # (m = its bytes: every token is at least one byte); one more token keeps its lead intact
    tail = max((len(s.encode()) for s in args.stop), default=0) + 1
    stop = (lambda ids: any(s in tok.decode(ids[-tail:]) for s in args.stop)) if args.stop else None
    if args.trace:
        ends = lambda tokens, out: cut(tokens, out, args.max_new_tokens, set(tok.eos_ids), stop)
        steps = traced(steps, Tracer(tok.decode), cut=ends)
    stats, out, stream, t0 = Stats(), [], StreamDecoder(tok), time.perf_counter()
    streamed, shown = "", 0
    for x in generate(steps, max_new_tokens=args.max_new_tokens, eos_ids=tok.eos_ids, stop=stop,
                      stats=stats):
        out.append(x)
        if not args.json and x not in tok.eos_ids:
            streamed += stream.push(x)
            if not args.trace:   # traced, the answer waits for the end: a step's lines never break it
                sure = before_stop(streamed, args.stop, final=False)
                print(sure[shown:], end="", flush=True)
                shown = len(sure)
    seconds = time.perf_counter() - t0
    if not args.json:
        print(before_stop(streamed + stream.flush(), args.stop)[shown:], flush=True)
    # the answer is out: now this machine's prices, kept; not beside another run (it came or went)
    if getattr(args, "measure_after", False) and not args.others and not others_running():
        prices(model, second[0] if second else None, None, args.draft_cost, notes.append)
    text = before_stop(tok.decode([x for x in out if x not in tok.eos_ids]), args.stop)
    # subtle: a k-row forward rounds a row apart from a one-row forward (SDPA's key blocks follow
    # the call's shape; in bf16, and on CUDA, the matmuls too), so a decoder that verifies k rows
    # may leave plain's tokens: in fp32 only at a near-tie (logits ~1e-4 apart), in bf16 and int4
    # often. --batch-invariant (bf16 and int4's default on a CPU) makes every kernel
    # row-invariant (engine/fast/invariant.py), probed once on this machine (cost.probed)
    # and compiled (--compile), no forward that decides tokens may have run eager after the prompt
    exact = on_exact_path(model, probed)
    held_to, law_of = promise(d, given, args.temperature)
    receipt_ = None
    if args.receipt:   # the reference: plain, or contrastive's own one-row steps, on this model
        steps = reference(args.decoder, model, second, prompt, given, sampler, args.seed, len(out))
        receipt_ = receipt(model, prompt, out, steps, tok.eos_ids)
        receipt_["line"] = receipt_line(receipt_, lambda t: "(the end)" if t is None else repr(tok.decode([t])))
    return {"decoder": args.decoder, "text": text, "path": path_name(path, model), "path_why": path.why,
            "exact_path": exact, "held_to": held_to, "law_of": law_of,
            "near_exact": not exact and not args.int4 and args.dtype in ("float32", "float64"),
            "tokens": out, "n_tokens": stats.n_tokens, "n_forwards": stats.n_forwards,
            "tokens_per_forward": stats.tokens_per_forward, "seconds": seconds,
            "tokens_per_second": stats.n_tokens / seconds, "prefill_seconds": stats.prefill_seconds,
            "decode_tokens_per_second": stats.decode_tokens_per_second,
            "draft_forwards": stats.draft_forwards, "drafted": stats.drafted, "accepted": stats.accepted,
            "acceptance": stats.acceptance, "hits": stats.hits, "verify_steps": stats.verify_steps,
            "hit_rate": stats.hit_rate, "step_lengths": dict(sorted(stats.step_lengths.items())),
            "arms": dict(sorted(stats.arms.items(), key=lambda a: -a[1])),
            "load_peak_rss_mb": load_peak, "decode_peak_rss_mb": peak_rss_mb(), "notes": notes,
            "priced_by": getattr(args, "priced_by", None), "threads": threads,
            **second_model(args, second), **({"receipt": receipt_} if receipt_ else {})}


def promise(d: Decoder, given: dict, temperature: float) -> tuple[str | None, str | None]:
    """(held_to, law_of): whose tokens a decoder of k-row forwards must print (plain's, or
    contrastive's own one-row steps); sampled and verified by rejection, only whose law (coupled
    keeps the seed's tokens). A decoder of one-row forwards only has nothing to disclaim."""
    if temperature > 0 and d.rejection(given):
        return None, d.held_to
    return None if d.one_row(given) else d.held_to, None


def second_model(args, second: tuple) -> dict:
    """What the second model is ("draft": "int4", "layers:20", a path) and the memory it adds."""
    if DECODERS[args.decoder].second is None:
        return {}
    flag = DECODERS[args.decoder].second.flag
    m, spec = second[0], getattr(args, flag)
    weights = model_of(m)                    # none: the text itself, or the target's own layers
    if weights is None:
        return {flag: f"ngram:{m.n}" if isinstance(m, Ngram) else f"layers:{m.layers}", f"{flag}_mb": 0.0}
    name = getattr(args, "auto_names", {}).get(id(m)) or spec
    return {flag: name, f"{flag}_mb": round(resident_bytes(weights) / 2**20, 1)}


def before_stop(text: str, stops: list[str], final: bool = True) -> str:
    """`text` up to the first stop string; unless final, also less a tail that may begin one.

    Example: stops ["\n\nQ:"]: "A.\n\nQ: x" -> "A."; "A.\n" -> "A." until more text comes.
    """
    text = text[:min((text.find(s) for s in stops if s in text), default=len(text))]
    if final:
        return text
    hold = max((k for s in stops for k in range(1, len(s)) if text.endswith(s[:k])), default=0)
    return text[:len(text) - hold]


def peak_rss_mb(reset: bool = False) -> float:
    """This process's peak resident memory (Linux's VmHWM; ru_maxrss where /proc is missing,
    though it counts a parent's peak after exec). reset: start a new peak after reading it."""
    try:
        status = Path("/proc/self/status").read_text()
        peak = int(next(l for l in status.splitlines() if l.startswith("VmHWM:")).split()[1]) / 1024
    except (OSError, StopIteration):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024   # kB -> MB
    if reset:   # "5" resets VmHWM to VmRSS (Linux >= 4.0); without it the next peak includes this one
        with contextlib.suppress(OSError):
            Path("/proc/self/clear_refs").write_text("5")
    return peak


def main(argv: list[str] | None = None) -> int:
    if sys.stdout is None:   # started with stdout closed (`>&-`): the answer would vanish
        warn("error: stdout is closed: the answer would be lost")
        return 2
    stderr_closed = sys.stderr is None
    if stderr_closed:   # `2>&-`: as 2>/dev/null. subtle: print(file=None) writes to stdout,
        sys.stderr = open(os.devnull, "w")   # so notes would land inside the answer
    args = parser().parse_args(argv)
    try:
        with slot():   # this run is seen by the engine runs that start beside it (session.share_cores)
            result = run(args)
        if args.json:
            print(json.dumps(result))
        sys.stdout.flush()    # here, not at exit: a full disk must be this one line
    except KeyboardInterrupt:
        quiet_stdout()        # what was streamed stays; the rest is not wanted
        return 130
    except BrokenPipeError:   # the reader closed the pipe (| head): it has all it wanted
        quiet_stdout()
        return 141
    except OSError as e:
        quiet_stdout()
        warn(f"error: {e}")
        return 2
    except (ValueError, KeyError) as e:
        warn(f"error: {e}")
        return 2
    if not args.json:
        warn(stats_line(result))
        if "receipt" in result:
            tail = f" (rejection sampling keeps {result['law_of']} law, not its tokens)" if result["law_of"] else ""
            warn(result["receipt"]["line"] + tail)
    for line in result["notes"]:
        warn(f"note: {line}")
    return 0


def to_terminal(stream) -> bool:
    with contextlib.suppress(OSError, ValueError, AttributeError):
        return stream.isatty()
    return False


def warn(line: str) -> None:
    """One line on stderr, if stderr can take it: a full or broken stderr (2>/dev/full) must
    not turn a finished answer into a traceback (nor may --trace's lines: engine/trace.py)."""
    with contextlib.suppress(OSError, ValueError):
        print(line, file=sys.stderr, flush=True)


def stats_line(r: dict) -> str:
    """The stderr stats line; every field is defined in STATS_HELP (--help)."""
    hist = " ".join(f"{k}x{v}" for k, v in r["step_lengths"].items())
    held = r["held_to"]   # whose tokens it must print (run.promise)
    draft = f" | {r['draft_forwards']} draft forwards" if r["draft_forwards"] else ""
    for m in ("draft", "amateur"):   # which model (--draft auto chose one), and the memory it adds
        if m in r:
            mb = f", +{r[m + '_mb']:.0f} MB" if r[m + "_mb"] else ""
            draft = f" | {r['draft_forwards']} draft forwards ({'amateur ' * (m == 'amateur')}{r[m]}{mb})"
            if r[m].startswith("ngram") and "+" not in r[m]:   # the text drafts: no model, no forwards
                draft = f" | draft {r[m]} (the text's own n-grams, no forwards)"
    acc = "" if r["acceptance"] is None else (
        f" | acceptance {r['acceptance']:.2f} ({r['accepted']}/{r['drafted']})"
        + ("" if r["hit_rate"] is None else f" | hit rate {r['hit_rate']:.2f} ({r['hits']}/{r['verify_steps']})"))
    arms = " | arms " + ", ".join(f"{a} x{n}" for a, n in r["arms"].items()) if r.get("arms") else ""
    return (f"[{r['decoder']}] {r['n_tokens']} tokens | {r['n_forwards']} target forwards{draft} | "
            f"{r['tokens_per_forward']:.2f} tok/forward{acc} | tokens per step {hist}{arms} | "
            f"prefill {r['prefill_seconds']:.2f} s | decode {r['decode_tokens_per_second']:.1f} tok/s"
            + (f" | path {r['path']}" + (f" (the default here: {r['path_why']})" if r.get("path_why") else "")
               if r.get("path") else "")
            + (f" | rejection sampling: {r['law_of']} law, not {r['law_of']} tokens" if r.get("law_of") else "")
            + ("" if r["exact_path"] or not held else
               f" | near-exact path: a near-tie may leave {held} tokens (--batch-invariant on fp32: exact)"
               if r.get("near_exact") else
               f" | inexact path: tokens may differ from {held} (k-row forwards round apart)"))


def quiet_stdout() -> None:
    """Make the exit-time flush of stdout harmless once writing to it has failed or stopped.

    subtle: Python flushes sys.stdout at exit, and a failing flush there prints "Exception
    ignored ... BrokenPipeError" and exits 120; pointing fd 1 at /dev/null ends that.
    """
    with contextlib.suppress(OSError, ValueError):
        sys.stdout.flush()
    with contextlib.suppress(OSError, ValueError):
        if sys.stdout is sys.__stdout__:   # only the real stdout (not a test's capture)
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


def console() -> None:
    """The `engine-run` console script (pip install): `python -m engine.run` under another name."""
    import signal
    signal.signal(signal.SIGINT, signal.default_int_handler)
    sys.exit(main())
