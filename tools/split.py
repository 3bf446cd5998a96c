"""Where a plain decode step's time goes: matmuls, attention, other ops, and Python; and
where a k-row forward's goes (`--rows`), matmul by matmul, on the 4-bit path eager and compiled.

    python -m tools.split                 # fp32 (prepacked) and --int4, table -> bench-out/split.*
    python -m tools.split --json          # one JSON object
    python -m tools.split --rows          # k = 1..32 rows -> bench-out/split-rows.*

A one-row step of a 135M model is ~120 matmuls and ~1,000 small ops. The matmuls are what the
hardware must do (they stream the weights); the rest is the price of eager PyTorch. This
tool says how big each part is, so that a change to the step can be judged by what it cut.

How: the wall time of a step is measured without the profiler (median of `steps` decode steps
after a chat prompt); then the same steps run under torch.profiler, whose top-level ops are
summed per kind. Each kind's share of the profiled step, times the unprofiled wall, is its ms:
the profiler's own overhead is spread over the kinds in proportion, not billed to one.
"Python" is the wall time outside every op (module calls, argument checks, the decoder loop).

--rows: a k-row forward after a cached prompt (what a verify step runs), timed whole; then each
kind of matmul (qkv, o, gate/up, down: every layer's own module, so the weights stream as in a
step; the head) and, eager, attention, timed alone on k rows; "rest" is the forward less those
(norms, RoPE, casts, Python; and, compiled, attention, which lives inside the graph). The
compiled graph calls the same 4-bit kernel as eager, so its matmuls are timed the same way.
"""
from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

import torch

from engine.decoders import DECODERS
from engine.fast.aot import compiled
from engine.fast.packed import exact_by_default, prepack, quantize_int4
from engine.kvcache import KVCache
from engine.llama import causal_mask
from engine.sampling import Random, Sampler
from tools.cli import Parser, first, out_dir, write_atomic
from tools.machine import describe, machine

KINDS = {  # top-level op name -> kind; anything else is "other ops"
    "mkldnn::_linear_pointwise": "matmul", "aten::linear": "matmul", "aten::mm": "matmul",
    "aten::addmm": "matmul", "aten::matmul": "matmul", "aten::_weight_int4pack_mm_for_cpu": "matmul",
    "aten::scaled_dot_product_attention": "attention",
}
COLUMNS = ("matmul", "attention", "other ops", "python")


def decode_steps(model, prompt: list[int], steps: int):
    """A plain greedy run, prefill done, ready to yield `steps` one-row decode steps."""
    run = DECODERS["plain"].decode(model, prompt, sampler=Sampler(), rng=Random(0), max_new_tokens=steps + 1)
    next(run)                                                     # the prompt's forward
    return run


def op_time(events) -> dict[str, float]:
    """us inside ops per kind, from a profile's events: top-level ops only (their children's
    time is inside theirs), so every us is counted once."""
    kinds = dict.fromkeys(COLUMNS[:-1], 0.0)
    for e in events:
        if e.cpu_parent is None:
            kinds[KINDS.get(e.name, "other ops")] += e.cpu_time_total
    return kinds


def split(model, prompt: list[int], steps: int = 32, repeats: int = 3) -> dict:
    """ms per decode step per kind, and the step's wall ms (medians over `repeats` runs)."""
    from torch.profiler import ProfilerActivity, profile
    walls, shares = [], []
    for _ in range(repeats):
        run = decode_steps(model, prompt, steps)
        t0 = time.perf_counter()
        for _ in range(steps):
            next(run)
        walls.append((time.perf_counter() - t0) * 1e3 / steps)
        run = decode_steps(model, prompt, steps)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            t0 = time.perf_counter()
            for _ in range(steps):
                next(run)
            profiled = (time.perf_counter() - t0) * 1e6               # us, as the profiler counts
        kinds = op_time(prof.events())
        kinds["python"] = max(profiled - sum(kinds.values()), 0.0)
        shares.append({k: v / profiled for k, v in kinds.items()})
    wall = statistics.median(walls)
    out = {k: round(wall * statistics.median(s[k] for s in shares), 2) for k in COLUMNS}
    return out | {"step_ms": round(wall, 2), "tok_s": round(1e3 / wall, 1)}


ROWS = (1, 2, 4, 8, 16, 32)
MATMULS = {"qkv": lambda b: b.attention.wqkv, "o": lambda b: b.attention.wo,
           "gate/up": lambda b: b.feed_forward.w13, "down": lambda b: b.feed_forward.w2}
ROW_COLUMNS = (*MATMULS, "head", "attention", "rest")


def timed(fn, repeats: int) -> float:
    """The least ms of fn() over `repeats` calls, after one warm-up call: on a shared 2-core VM
    the median of a few ms drifts by 2x between runs, the least disturbed call much less."""
    fn()
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return min(ts) * 1e3


def row_split(model, k: int, context: int = 64, repeats: int = 15) -> dict:
    """ms of a k-row forward after `context` cached tokens, and of its parts (see --rows)."""
    c, dtype = model.config, model.tok_embeddings.weight.dtype
    gen = torch.Generator().manual_seed(k)
    cache = KVCache.for_model(model, context + k)
    model(torch.randint(0, c.vocab_size, (1, context), generator=gen), torch.arange(context), cache=cache)
    rows, positions = torch.randint(0, c.vocab_size, (1, k), generator=gen), torch.arange(context, context + k)

    def forward():
        model(rows, positions, cache=cache)
        cache.length = context                                    # the same k slots every time
    out = {"forward": timed(forward, repeats)}
    x = {n: torch.randn(1, k, n, generator=gen).to(dtype) for n in (c.dim, c.hidden_dim, c.n_heads * c.head_dim)}
    for kind, get in MATMULS.items():
        mods = [get(b) for b in model.layers]
        out[kind] = timed(lambda: [m(x[m.in_features]) for m in mods], repeats)
    head = model.packed_head or (lambda h: torch.nn.functional.linear(h, model.tok_embeddings.weight))
    out["head"] = timed(lambda: head(x[c.dim]), repeats)
    if compiled(model) is not None:                               # attention is in the graph
        out["attention"] = 0.0
    else:
        q = torch.randn(1, c.n_heads, k, c.head_dim, generator=gen).to(cache.k.dtype)   # (1, H, k, D)
        kv = cache.k[0, :, :, :context + k], cache.v[0, :, :, :context + k]             # (1, Hkv, S, D)
        mask = causal_mask(context, k)                                                  # (k, S)
        attends = [b.attention.attend for b in model.layers]
        out["attention"] = timed(lambda: [a(q, *kv, attn_mask=mask, enable_gqa=True) for a in attends], repeats)
    out["rest"] = max(out["forward"] - sum(out[kind] for kind in ROW_COLUMNS[:-1]), 0.0)
    return {key: round(v, 3) for key, v in out.items()}


def row_models(checkpoint: Path):
    """The 4-bit path as the CLI runs it, eager, then compiled (built here if it is not yet)."""
    from engine.fast.paths import build
    from engine.fast.aot import compile_step
    q = build(checkpoint, dtype=torch.bfloat16, int4=True)       # as the CLI loads it
    yield "int4 eager", q
    q = compile_step(q, notify=lambda m: print(f"note: {m}", file=sys.stderr, flush=True))
    if compiled(q) is not None:
        yield "int4 compiled", q


def rows_markdown(result: dict) -> str:
    lines = ["| path | k | forward ms | cost(k) | " + " | ".join(ROW_COLUMNS) + " |", "|---" * (len(ROW_COLUMNS) + 4) + "|"]
    for name, by_k in result["rows"].items():
        one = by_k["1"]["forward"]
        for k, r in by_k.items():
            parts = " | ".join(f"{r[c]:.2f}" for c in ROW_COLUMNS)
            lines.append(f"| {name} | {k} | {r['forward']:.2f} | {r['forward'] / one:.2f} | {parts} |")
    return "\n".join(lines) + "\n"


def models(checkpoint: Path):
    """The engine's two CPU paths as the CLI runs them: fp32 prepacked and --int4 (4-bit layers,
    bf16, exact kernels by default: packed.exact_by_default)."""
    from engine.load.weights import load_model
    yield "fp32", prepack(load_model(checkpoint))
    q = quantize_int4(load_model(checkpoint))
    yield "int4", prepack(q, exact_by_default(q))


def main(argv: list[str] | None = None) -> int:
    from engine.load.weights import DEFAULT_CHECKPOINT
    p = Parser(prog="python -m tools.split", description=first(__doc__))
    p.add_argument("--checkpoint", type=Path, default=DEFAULT_CHECKPOINT)
    p.add_argument("--steps", type=int, default=32, help="decode steps per timed run")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per path (median)")
    p.add_argument("--rows", action="store_true", help="k-row forwards (k = 1..32) on the 4-bit path, eager and compiled")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--out", type=Path, default=Path("bench-out"), help="split.md and split.json go here")
    args = p.parse_args(argv)
    if not (1 <= args.steps <= 4096 and 1 <= args.repeats <= 100):
        p.error("--steps must be in [1, 4096] and --repeats in [1, 100]")
    try:
        from tools.bench import chat_prompt
        prompt, _ = chat_prompt(args.checkpoint)
        if not args.json:   # before any work or progress line: a bad --out is the only line
            out_dir(args.out)
        result = {"machine": machine("cpu"), "threads": torch.get_num_threads(), "paths": {}}
        if args.rows:
            result = {"machine": result["machine"], "rows": {}}
            for name, model in row_models(args.checkpoint):
                for k in ROWS:
                    print(f"split: {name}, {k} rows", file=sys.stderr, flush=True)
                    result["rows"].setdefault(name, {})[str(k)] = row_split(model, k, repeats=args.repeats * 5)
        for name, model in ([] if args.rows else models(args.checkpoint)):
            print(f"split: {name}", file=sys.stderr, flush=True)
            result["paths"][name] = split(model, prompt, args.steps, args.repeats)
    except (OSError, ValueError) as e:   # OSError: a checkpoint file that cannot be read, too
        print(f"tools.split: error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(result))
        return 0
    table, name = (rows_markdown(result), "split-rows") if args.rows else (markdown(result), "split")
    write_atomic(args.out / f"{name}.md", f"Machine: {describe(result['machine'])}\n\n{table}".encode())
    write_atomic(args.out / f"{name}.json", json.dumps(result, indent=1).encode())
    print(table + f"written: {args.out}/{name}.md, {name}.json")
    return 0


def markdown(result: dict) -> str:
    lines = ["| path | step ms | tok/s | " + " | ".join(COLUMNS) + " |", "|---" * (len(COLUMNS) + 3) + "|"]
    for name, r in result["paths"].items():
        parts = " | ".join(f"{r[k]:.1f} ({r[k] / r['step_ms']:.0%})" for k in COLUMNS)
        lines.append(f"| {name} | {r['step_ms']:.1f} | {r['tok_s']} | {parts} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
