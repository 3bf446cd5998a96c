"""The exact paths, measured: on int4, bf16 and fp32 with --batch-invariant, does every decoder
print that path's plain tokens, greedy and seeded, on every bench prompt?

    python -m tools.exact [--quick] [--max-new-tokens 64] [--paths int4,bf16,fp32]
                          [--no-batch-invariant] [--out bench-out]
    python -m tools.exact --margin [--paths fp32] [--no-batch-invariant]   # how near a near-exact path is

Without --batch-invariant a k-row forward (what lookahead, lookup and speculative verification
run) may round a row apart from plain's one-row forward (--int4 and bf16 often, fp32 by ~1e-4 of
a logit), so an accelerated decoder could leave plain's tokens on that very path.
prepack(batch_invariant=True) makes every kernel row-invariant; rows_round_alike() probes it.
This sweep is the proof in tokens: per path, plain greedy and plain sampled (temperature 0.8,
seed = the prompt's index) are the references, and every other decoder, textbook and with its
policy, is compared with them token by token. Rows whose seeded tokens are not promised equal
are run greedy only: speculative with rejection verification (it keeps plain's law, not its
draws), and contrastive (its drafts are verified by rejection, and its law keeps only the
plausible set, alpha = 0.1, even at beta = 0). --no-batch-invariant runs the same paths
without it, for contrast: there differences are expected. Run it under each kernel dispatch
(ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 for the second, as `make exact` does); the
files are named by the dispatch: exact-<dispatch>[-no-batch-invariant].{md,json}.
"""
from __future__ import annotations

import json
import shlex
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from engine.adapt.policy import POLICIES
from engine.decoders import DECODERS
from engine.doors.session import prices
from engine.draft import EarlyExit, Ngram
from engine.fast.invariant import rows_round_alike
from engine.generate import generate
from engine.kvcache import KVCache
from engine.sampling import Random, Sampler
from tools.cli import Parser, first, at_most, out_dir, write_atomic
from tools.machine import describe, machine

MODES = {"greedy": Sampler(), "seeded": Sampler(temperature=0.8)}
# --paths: the weights' kind (int4: 4-bit layers, bf16 activations; int4-compiled: the CLI's --int4
# --compile, with graphs for the self-draft's and the amateur's early exits too)
KINDS = ("int4", "bf16", "fp32", "int4-compiled")


@dataclass(frozen=True)
class Run:
    name: str
    decode: Callable                    # decode(model, *second, prompt, sampler=, rng=, ...)
    second: tuple = ()                  # the second model: a EarlyExit or an early-exit int
    knobs: Callable = lambda model: {}  # model -> keywords, built afresh per run (a policy learns)
    modes: tuple = tuple(MODES)


def runs(model=None, family=None) -> list[Run]:
    """Every decoder but plain, textbook and with its policy priced as the CLI prices it (the
    CLI's default: this machine's measured costs, engine.doors.session.prices); family: a
    draft and amateur model of the target's family (--draft), whose rows come first."""
    la, lu, sp, cd = (DECODERS[n] for n in ("lookahead", "lookup", "speculative", "contrastive"))
    draft = EarlyExit(min(20, model.config.n_layers - 1) if model is not None else 20)  # 20 of SmolLM2's 30
    own = [] if family is None else [
        Run("speculative family draft K3 rejection", sp.decode, (family,), lambda m: {"num_draft": 3}, ("greedy",)),
        Run("speculative family draft K3 coupled", sp.decode, (family,), lambda m: {"num_draft": 3, "verify": "coupled"}),
        Run("speculative family draft policy", sp.decode, (family,),
            lambda m: {"policy": POLICIES["speculative"].build(m, family, prices(m, family), {})}, ("greedy",)),
        Run("speculative family draft policy coupled", sp.decode, (family,),
            lambda m: {"verify": "coupled", "policy": POLICIES["speculative"].build(m, family, prices(m, family), {})}),
        Run("speculative n-grams else family draft policy", sp.decode, (Ngram(otherwise=family),),
            lambda m: {"policy": POLICIES["speculative"].build(m, Ngram(otherwise=family), prices(m, family), {})},
            ("greedy",)),
        Run("speculative n-grams else family draft policy coupled", sp.decode, (Ngram(otherwise=family),),
            lambda m: {"verify": "coupled",
                       "policy": POLICIES["speculative"].build(m, Ngram(otherwise=family), prices(m, family), {})}),
        Run("contrastive beta=0 K3 family amateur", cd.decode, (family,),
            lambda m: {"beta": 0.0, "speculative": True, "num_draft": 3}, ("greedy",)),
    ]
    return own + [
        Run("lookahead W5 N4 G5", la.decode, (), lambda m: {"window": 5, "ngram": 4, "guesses": 5}),
        Run("lookahead policy", la.decode, (), lambda m: {"policy": POLICIES["lookahead"].build(m, prices(m), {})}),
        Run("lookup K8", lu.decode, (), lambda m: {"lookup_tokens": 8}),
        Run("lookup policy", lu.decode, (), lambda m: {"policy": POLICIES["lookup"].build(m, prices(m), {})}),
        Run("speculative K4 rejection", sp.decode, (draft,),
            lambda m: {"num_draft": 4, "verify": "rejection"}, ("greedy",)),
        Run("speculative K4 coupled", sp.decode, (draft,), lambda m: {"num_draft": 4, "verify": "coupled"}),
        Run("speculative policy coupled", sp.decode, (draft,),
            lambda m: {"verify": "coupled", "policy": POLICIES["speculative"].build(m, draft, prices(m, draft), {})}),
        # the 4-bit path's default draft: the text's n-grams (rejection: greedy only, sampled it keeps the law)
        Run("speculative n-gram policy", sp.decode, (Ngram(),),
            lambda m: {"policy": POLICIES["speculative"].build(m, Ngram(), prices(m), {})}, ("greedy",)),
        Run("speculative n-gram policy coupled", sp.decode, (Ngram(),),
            lambda m: {"verify": "coupled", "policy": POLICIES["speculative"].build(m, Ngram(), prices(m), {})}),
        Run("contrastive beta=0 K3 amateur 8", cd.decode, (EarlyExit(8),),
            lambda m: {"beta": 0.0, "speculative": True, "num_draft": 3}, ("greedy",)),
    ]


def progress(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def tokens(decode: Callable, model, second: tuple, prompt: list[int], mode: str, seed: int,
           n: int, eos, knobs: dict) -> list[int]:
    steps = decode(model, *second, prompt, sampler=MODES[mode], rng=Random(seed), max_new_tokens=n, **knobs)
    return list(generate(steps, max_new_tokens=n, eos_ids=eos))


def compare(labels: list[str], ref: list[list[int]], got: list[list[int]]) -> dict:
    """Prompts whose tokens are identical, of all, and where the first difference is."""
    first = None
    for label, a, b in zip(labels, ref, got):
        if a != b and first is None:
            pos = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            first = {"prompt": label, "position": pos, "plain": a[pos:pos + 1], "decoder": b[pos:pos + 1]}
    return {"identical": sum(a == b for a, b in zip(ref, got)), "total": len(ref), "first": first}


def sweep(model, prompts: dict[str, list[int]], eos, n: int, rows: list[Run], tag: str = "") -> dict:
    """{run name: {mode: compare(...)}}: each run's tokens against plain's, prompt by prompt;
    prompt i is sampled with seed i."""
    labels, got = list(prompts), {}
    for r in [Run("plain", DECODERS["plain"].decode)] + rows:
        for mode in r.modes:
            t0 = time.perf_counter()
            got[r.name, mode] = [tokens(r.decode, model, r.second, p, mode, i, n, eos, r.knobs(model))
                                 for i, p in enumerate(prompts.values())]
            done = compare(labels, got["plain", mode], got[r.name, mode])
            progress(f"{tag}{r.name} {mode}: {done['identical']}/{done['total']} identical to plain "
                     f"({time.perf_counter() - t0:.0f} s)")
    return {r.name: {m: compare(labels, got["plain", m], got[r.name, m]) for m in r.modes} for r in rows}


def margin(model, prompts: dict[str, list[int]], n: int, rows: int = 16) -> dict:
    """How near plain a verify step is: plain greedy's one-row logits against the same tokens'
    logits from forwards of `rows` rows (as a verify step sends them), per prompt and step.
    A decoder leaves plain's greedy tokens only where the top-2 gap is below the difference."""
    diff, gaps = [], []
    d = model.tok_embeddings.weight.device
    t = lambda x: torch.tensor(x, device=d)
    r = lambda a, b: torch.arange(a, b, device=d)
    with torch.inference_mode():
        for p in prompts.values():
            caches = [KVCache.for_model(model, len(p) + n + rows) for _ in range(2)]
            one = [model(t([p]), r(0, len(p)), caches[0])[0, -1]]                    # (V,) each
            model(t([p]), r(0, len(p)), caches[1])
            for i in range(n):
                one.append(model(t([[int(one[-1].argmax())]]), t([len(p) + i]), caches[0])[0, -1])
            toks = [int(x.argmax()) for x in one[:-1]]
            k = torch.cat([model(t([toks[s:s + rows]]), r(len(p) + s, len(p) + s + len(toks[s:s + rows])),
                                 caches[1])[0] for s in range(0, n, rows)])               # (n, V)
            L = torch.stack(one[1:]).float()                                                # (n, V)
            diff += (L - k.float()).abs().amax(-1).tolist()
            top = L.topk(2, -1).values
            gaps += (top[:, 0] - top[:, 1]).tolist()
    d, g = torch.tensor(diff), torch.tensor(gaps)
    return {"steps": len(diff), "max_diff": d.max().item(), "median_diff": d.median().item(),
            "smallest_gaps": sorted(gaps)[:5], "gaps_below_max_diff": int((g <= d.max()).sum())}


def load(checkpoint: Path, kind: str, batch_invariant: bool, device: str = "cpu"):
    """The model as the CLI loads it (engine.fast.paths.build): int4 from the fp32 weights (CPU only),
    else bf16 or fp32."""
    from engine.fast.aot import compile_step
    from engine.fast.paths import build
    model = build(checkpoint, dtype=torch.bfloat16 if kind.startswith(("bf16", "int4")) else torch.float32,
                  device=device, int4=kind.startswith("int4"), batch_invariant=batch_invariant)
    splits = [min(20, model.config.n_layers - 1), 8]
    return compile_step(model, progress, splits=splits) if kind == "int4-compiled" else model


def load_family(checkpoint: Path, draft: Path, kind: str, batch_invariant: bool, device: str = "cpu"):
    """--draft beside the target, loaded as the CLI's --draft PATH loads it on that path."""
    from engine.fast.paths import build
    from engine.load.weights import second_checkpoint
    return second_checkpoint(checkpoint, draft, lambda c: build(
        c, dtype=torch.bfloat16 if kind.startswith(("bf16", "int4")) else torch.float32, device=device,
        int4=kind.startswith("int4"), batch_invariant=batch_invariant, draft=True))


def cell(c: dict | None) -> str:
    if c is None:
        return "-"
    s = f"{c['identical']}/{c['total']}"
    f = c["first"]
    return s + (f" (first: {f['prompt']} @ {f['position']})" if f else "")


def table(result: dict) -> str:
    lines = [f"Every decoder's tokens against plain's on the same path, {result['max_new_tokens']} new "
             f"tokens, {result['prompts']} prompts: prompts identical / total.",
             f"Machine: {describe(result['machine'])}.", "",
             "| path | rows round alike | decoder | greedy | seeded (T=0.8, seed = prompt index) |",
             "|---|---|---|---|---|"]
    for path, r in result["paths"].items():
        for name, modes in r["decoders"].items():
            lines.append(f"| {path} | {r['rows_round_alike']} | {name} | {cell(modes.get('greedy'))} "
                         f"| {cell(modes.get('seeded'))} |")
    return "\n".join(lines) + "\n"


def parse_args(argv):
    from engine.load.weights import DEFAULT_CHECKPOINT
    p = Parser(prog="python -m tools.exact", description=first(__doc__))
    p.add_argument("--checkpoint", type=Path, default=DEFAULT_CHECKPOINT)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--quick", action="store_true", help="one prompt per category")
    p.add_argument("--paths", default=",".join(KINDS[:3]), help=f"comma-separated, of {', '.join(KINDS)}")
    p.add_argument("--no-batch-invariant", action="store_true",
                   help="the same paths without --batch-invariant, for contrast (differences expected)")
    p.add_argument("--margin", action="store_true",
                   help="instead of the sweep: one-row against 16-row logits of plain's tokens, and top-2 gaps")
    p.add_argument("--device", default="cpu", help="cpu or cuda[:N] (there --paths bf16,fp32: int4 is CPU-only)")
    p.add_argument("--draft", type=Path, default=None,
                   help="a smaller model of the target's family (make pair's 0.5B): speculative's draft and "
                        "contrastive's amateur in rows of their own")
    p.add_argument("--prompts", type=int, default=None, help="only the first N prompts (after --quick)")
    p.add_argument("--out", type=Path, default=Path("bench-out"))
    args = p.parse_args(argv)
    at_most(p, args, {"max_new_tokens": 4096})
    if args.prompts is not None and args.prompts < 1:
        p.error(f"--prompts must be >= 1, got {args.prompts}")
    args.paths = args.paths.split(",")
    if not args.paths or not set(args.paths) <= set(KINDS) or len(set(args.paths)) < len(args.paths):
        p.error(f"--paths: distinct names of {', '.join(KINDS)}, got {','.join(args.paths)!r}")
    if args.device not in ("cpu", "cuda") and not args.device.startswith("cuda:"):
        p.error(f"--device: cpu or cuda[:N], got {args.device!r}")
    if args.device != "cpu" and (any(k.startswith("int4") for k in args.paths) or not torch.cuda.is_available()):
        p.error(f"--device {args.device}: " + ("CUDA is not available here" if not torch.cuda.is_available() else
                                             "int4 runs on the CPU only"))
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from tools.bench import bench_prompts
    try:
        out = out_dir(args.out)
        by_cat, eos = bench_prompts(args.checkpoint, args.quick)
        prompts = {f"{cat}#{i}": p for cat, ps in by_cat.items() for i, p in enumerate(ps)}
        prompts = dict(list(prompts.items())[:args.prompts])
        dispatch = torch.backends.cpu.get_cpu_capability() if args.device == "cpu" else "cuda"
        result = {"machine": machine(args.device), "dispatch": dispatch, "device": args.device,
                  "max_new_tokens": args.max_new_tokens, "prompts": len(prompts), "seconds": 0,
                  "batch_invariant": not args.no_batch_invariant, "paths": {}, "command": "python -m tools.exact " + shlex.join(sys.argv[1:] if argv is None else argv)}
        t0 = time.perf_counter()
        for kind in args.paths:
            path = kind + ("" if args.no_batch_invariant else " batch-invariant")
            progress(f"{path}: loading {args.checkpoint}")
            model = load(args.checkpoint, kind, not args.no_batch_invariant, args.device)
            if args.margin:
                m = margin(model, prompts, args.max_new_tokens)
                print(f"{path}: {m}", flush=True)
                result["paths"][path] = {"margin": m}
                continue
            family = None if args.draft is None else load_family(args.checkpoint, args.draft, kind,
                                                                     not args.no_batch_invariant, args.device)
            if family is not None and kind == "int4-compiled":
                from engine.doors.session import compile_second
                compile_second(model, family, progress)
            result["paths"][path] = {"rows_round_alike": rows_round_alike(model), "decoders": sweep(
                model, prompts, eos, args.max_new_tokens, runs(model, family), f"{path}: ")}
            del model, family
            result["seconds"] = round(time.perf_counter() - t0)
            write(out, result)   # after each path: a run cut short keeps the paths it finished
    except (OSError, ValueError) as e:
        print(f"tools.exact: error: {e}", file=sys.stderr)
        return 2
    if args.margin:
        name = f"margin-{result['dispatch']}" + ("" if result["batch_invariant"] else "-no-batch-invariant")
        write_atomic(out / f"{name}.json", (json.dumps(result, indent=1) + "\n").encode())
        return 0
    print(table(result), end="")
    return 0


def write(out: Path, result: dict) -> None:
    name = f"exact-{result['dispatch']}" + ("" if result["batch_invariant"] else "-no-batch-invariant")
    write_atomic(out / f"{name}.json", (json.dumps(result, indent=1) + "\n").encode())
    write_atomic(out / f"{name}.md", table(result).encode())


if __name__ == "__main__":
    sys.exit(main())
