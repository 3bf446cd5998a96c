"""Where a plain decode step's time goes: matmuls, attention, other ops, and Python.

    python -m tools.split                 # fp32 (prepacked) and --int4, table -> bench-out/split.*
    python -m tools.split --json          # one JSON object

A one-row step of a 135M model is ~120 matmuls and ~1,000 small ops. The matmuls are what the
hardware must do (they stream the weights); the rest is the price of eager PyTorch. This
tool says how big each part is, so that a change to the step can be judged by what it cut.

How: the wall time of a step is measured without the profiler (median of `steps` decode steps
after a chat prompt); then the same steps run under torch.profiler, whose top-level ops are
summed per kind. Each kind's share of the profiled step, times the unprofiled wall, is its ms:
the profiler's own overhead is spread over the kinds in proportion, not billed to one.
"Python" is the wall time outside every op (module calls, argument checks, the decoder loop).
"""
from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

import torch

from engine.decoders import DECODERS
from engine.fast.packed import exact_by_default, prepack, quantize_int4
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
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--out", type=Path, default=Path("bench-out"), help="split.md and split.json go here")
    args = p.parse_args(argv)
    if not (1 <= args.steps <= 4096 and 1 <= args.repeats <= 100):
        p.error("--steps must be in [1, 4096] and --repeats in [1, 100]")
    try:
        from tools.bench import chat_prompt
        prompt, _ = chat_prompt(args.checkpoint)
        result = {"machine": machine("cpu"), "threads": torch.get_num_threads(), "paths": {}}
        for name, model in models(args.checkpoint):
            print(f"split: {name}", file=sys.stderr, flush=True)
            result["paths"][name] = split(model, prompt, args.steps, args.repeats)
        if not args.json:
            out_dir(args.out)
    except (OSError, ValueError) as e:   # OSError: a checkpoint file that cannot be read, too
        print(f"tools.split: error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(result))
        return 0
    table = markdown(result)
    write_atomic(args.out / "split.md", f"Machine: {describe(result['machine'])}\n\n{table}".encode())
    write_atomic(args.out / "split.json", json.dumps(result, indent=1).encode())
    print(table + f"written: {args.out}/split.md, split.json")
    return 0


def markdown(result: dict) -> str:
    lines = ["| path | step ms | tok/s | " + " | ".join(COLUMNS) + " |", "|---" * (len(COLUMNS) + 3) + "|"]
    for name, r in result["paths"].items():
        parts = " | ".join(f"{r[k]:.1f} ({r[k] / r['step_ms']:.0%})" for k in COLUMNS)
        lines.append(f"| {name} | {r['step_ms']:.1f} | {r['tok_s']} | {parts} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
