"""What to expect on bigger Llamas: one-row step time against the memory read roof, and the cost of
a k-row forward, measured with random weights of real shapes (no checkpoint needed).

    python -m tools.scale [--shapes smollm2-135m llama-3.2-1b llama-3.2-3b] [--int4]

A decoder that verifies k rows per forward pays cost(k)/cost(1) for them, so it must average
more tokens per forward than that to win; the table says how dear rows are at each size.
Writes bench-out/scale.md and scale.json (docs/scale.md is one run, with its machine). --int4 is
the 4-bit path without its exact kernels (--no-batch-invariant): SDPA's attention, as scale.md
was measured; the exact path's rows each add an attention call (docs/archive/speed-log.md).
"""
from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

import torch

from engine.fast.packed import prepack, quantize_int4
from engine.kvcache import KVCache
from engine.llama import LlamaConfig
from tools.bench import SMOLLM2_135M, bandwidth, progress, random_model, time_forward, weight_bytes
from tools.cli import Parser, first, at_most, out_dir, write_atomic
from tools.machine import describe, machine

SHAPES = {   # Llama 3.2's published shapes (tied heads); RoPE scaling does not change a step's time
    "smollm2-135m": SMOLLM2_135M,
    "llama-3.2-1b": LlamaConfig(dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, hidden_dim=8192,
                                vocab_size=128256, tie_embeddings=True),
    "llama-3.2-3b": LlamaConfig(dim=3072, n_layers=28, n_heads=24, n_kv_heads=8, hidden_dim=8192,
                                vocab_size=128256, tie_embeddings=True),
}
KS, CONTEXT = (1, 2, 4, 8, 16), 100


def measure(cfg: LlamaConfig, int4: bool, repeats: int) -> dict:
    """Median ms of k-row forwards after a CONTEXT-token cache, and the copy roof of one row."""
    model = random_model(cfg)
    model = prepack(quantize_int4(model) if int4 else model)
    cache = KVCache.for_model(model, CONTEXT + max(KS))
    model(torch.zeros(1, CONTEXT, dtype=torch.long), torch.arange(CONTEXT), cache)
    time_forward(model, cache, CONTEXT, 1)                            # warm the kernels up
    ms = {k: statistics.median(time_forward(model, cache, CONTEXT, k) for _ in range(repeats)) for k in KS}
    # int4 layers read ~0.56 bytes a weight (codes + a bf16 scale and zero per 32); the head bf16
    layer_bytes = weight_bytes(cfg) - 4 * (cfg.vocab_size * cfg.dim + cfg.dim)
    nbytes = int(layer_bytes * 0.5625 / 4 + 2 * cfg.vocab_size * cfg.dim) if int4 else weight_bytes(cfg)
    bw = bandwidth(repeats=3)
    # a step only reads its weights: the read roof (a sum over memory) bounds it; a copy also
    # writes, so the copy roof (the bench's) is the looser measure a step can beat
    roof = nbytes / (bw["read_gbps"] * 1e9) * 1e3                     # ms
    return {"weight_mb": round(nbytes / 1e6), "ms": {k: round(v, 2) for k, v in ms.items()},
            "ratio": {k: round(ms[k] / ms[1], 2) for k in KS}, **bw,
            "roof_ms": round(roof, 2), "fraction_of_roof": round(roof / ms[1], 2)}


def markdown(result: dict) -> str:
    rows = ["| model | path | weights MB | one row ms | read roof ms | of roof | "
            + " | ".join(f"{k} rows" for k in KS[1:]) + " |", "|---" * (5 + len(KS)) + "|"]
    for name, r in result["shapes"].items():
        rows.append(f"| {name.split(' ')[0]} | {name.split(' ', 1)[1]} | {r['weight_mb']:,} | {r['ms'][1]:.1f} | "
                    f"{r['roof_ms']:.1f} | {r['fraction_of_roof']:.0%} | "
                    + " | ".join(f"{r['ratio'][k]:.2f}x" for k in KS[1:]) + " |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    p = Parser(prog="python -m tools.scale", description=first(__doc__))
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=SHAPES)
    p.add_argument("--int4", action="store_true", help="also the --int4 path of each shape")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", default="bench-out")
    args = p.parse_args(argv)
    at_most(p, args, {"repeats": 100})
    out = out_dir(Path(args.out))
    result = {"machine": machine("cpu"), "threads": torch.get_num_threads(), "context": CONTEXT, "shapes": {}}
    for name in args.shapes:
        for int4 in (False, True) if args.int4 else (False,):
            label = f"{name} {'int4' if int4 else 'fp32'}"
            progress(f"scale: {label} (random weights, building)")
            result["shapes"][label] = measure(SHAPES[name], int4, args.repeats)
    table = markdown(result)
    print(f"machine: {describe(result['machine'])}, {result['threads']} threads\n{table}")
    write_atomic(out / "scale.json", json.dumps(result, indent=1).encode())
    write_atomic(out / "scale.md", f"Machine: {describe(result['machine'])}\n\n{table}\n".encode())
    return 0


if __name__ == "__main__":
    sys.exit(main())
