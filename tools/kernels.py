"""The 4-bit path's matmul against its candidates at k rows: time, whether rows round alike,
and multiply-adds per second against this machine's peak for each kind of arithmetic.

    python -m tools.kernels                    # table -> bench-out/kernels.{md,json}
    python -m tools.kernels --compile          # and Inductor's 4-bit GEMM template and the 4-bit
                                               # weights dequantized in a graph (gcc, ~2 min)

Verification pays only where a forward of k rows costs about one of one row. A kernel serves
an exact path only if it gives a row the same bits whatever the row count (a verify row must
get plain's one-row logits), so the two questions are asked of each candidate together:

- int4 aten: torch's `_weight_int4pack_mm_for_cpu`, the path's kernel today. Per weight it
  unpacks the code to fp32 (w = (q - 8) s + z) and does one fp32 multiply-add per row.
- int4 template: Inductor's C++ GEMM template for the same op (max-autotune, AVX-512 only),
  which unpacks each tile once for 4 rows; the same per-row arithmetic.
- int8 qlinear: the weight rounded to int8 per output channel (twice the 4-bit bytes), each
  row to int8 by its own scale, oneDNN's u8 x s8 -> s32 kernel (VNNI), prepacked. Integer sums
  are exact in any order, so rows round alike by construction, on any CPU.
- bf16 oneDNN: the weight as bf16 (four times the bytes), the bf16 path's PackedLinear.
- int4 dequantized in the graph (`--compile`): the same 4-bit codes, scales and mins unpacked by
  code Inductor writes, one graph for every row count (dynamic rows): "fused" dequantizes inside
  the sum (one reduction kernel, fp32), "blocked" writes the bf16 weight and calls one GEMM.

Then one row through torch's 4-bit kernel for each of a layer's shapes (SmolLM2-135M's), on all
threads and on one, with the bytes it reads per second: on a 2-core VM the one-row kernel runs
at about twice its one-thread rate, so it is bound by its own unpacking arithmetic, not by memory.

Peaks are large GEMMs of each arithmetic (oneDNN: fp32, bf16; int8 through torch._int_mm).
Each figure is the least of `repeats` timed calls: on a shared 2-core VM the least disturbed
call drifts far less than a median of a few microseconds. One shape stands for the layer's
matmuls (gate/up, 3072 x 576, a third of a step's layer bytes).
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

from engine.fast.packed import INT4_MM, Int4Linear, PackedLinear, can_prepack, q4_groups
from tools.cli import Parser, first, out_dir, write_atomic
from tools.machine import describe, machine

ROWS = (1, 2, 4, 8, 16, 32)
SHAPE = (3072, 576)                      # (out, in): a layer's gate/up matmul


def least_us(fn, repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best * 1e6


def int8_qlinear(w: torch.Tensor):
    """x W^T with W ~ s_n w8_n (int8 per output) and x ~ a_m x8_m (int8 per row): the integer
    sums are exact, then y = acc * a * s, per element."""
    qp, ql = torch.ops.onednn.qlinear_prepack, torch.ops.onednn.qlinear_pointwise
    s = w.abs().amax(1) / 127                                          # (out,)
    packed = qp((w / s[:, None]).round().clamp(-127, 127).to(torch.int8), None)
    one, zero = torch.ones(w.shape[0]), torch.zeros(w.shape[0], dtype=torch.long)

    def mm(x: torch.Tensor) -> torch.Tensor:
        x = x.float()
        a = (x.abs().amax(-1, keepdim=True) / 127).clamp(min=1e-30)     # (k, 1): each row its own
        x8 = (torch.round(x / a) + 128).to(torch.uint8)                 # u8 with zero point 128
        acc = ql(x8, 1.0, 128, packed, one, zero, None, 1.0, 0, torch.float32, "none", [], "")
        return acc * a * s                                             # (k, out)
    return mm


def int4_template(lin: Int4Linear):
    """The same op through Inductor's C++ GEMM template (max-autotune), weights as constants
    (the template takes no other); a graph per row count, so each gets the blocking for its own."""
    import torch._inductor.config as ic

    class Op(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("packed", lin.packed)
            self.register_buffer("scales", lin.scales)

        def forward(self, x):
            return INT4_MM(x, self.packed, lin.group, self.scales)
    with ic.patch(max_autotune=True, max_autotune_gemm_backends="CPP", freezing=True):
        return torch.compile(Op(), dynamic=False)


def dequantized(w: torch.Tensor, blocked: bool, compile_: bool = True):
    """x W^T with W = d q + m (Q4_1's groups of 32, as Int4Linear quantizes it) unpacked inside a
    compiled graph: codes (in/2, out) with rows 2j, 2j+1 in one byte's low and high nibble."""
    out, n = w.shape
    q, d, m = q4_groups(w)                                             # (out, in), (out, in/32)
    qt = q.t().contiguous()                                            # (in, out)
    codes = (qt[0::2] | (qt[1::2] << 4)).to(torch.uint8)               # (in/2, out)
    d, m = d.t().contiguous().bfloat16(), m.t().contiguous().bfloat16()  # (in/32, out)

    def weights() -> torch.Tensor:                                     # (in, out) fp32
        q = torch.stack([codes & 15, codes >> 4], 1).view(n // 32, 32, out).float()
        return (q * d.float()[:, None] + m.float()[:, None]).view(n, out)

    def mm(x: torch.Tensor) -> torch.Tensor:
        if blocked:
            return x @ weights().to(x.dtype)                           # (k, out)
        return (x.float()[:, :, None] * weights()[None]).sum(1)        # (k, out)
    return torch.compile(mm, dynamic=True) if compile_ else mm


def candidates(compile_: bool) -> dict:
    torch.manual_seed(0)
    w = torch.randn(*SHAPE) * 0.02
    lin = Int4Linear(w)
    out = {"int4 aten": lambda x: INT4_MM(x, lin.packed, lin.group, lin.scales), "int8 qlinear": int8_qlinear(w)}
    if can_prepack(w.bfloat16()):
        out["bf16 oneDNN"] = PackedLinear(w.bfloat16(), min_rows=2)
    if compile_:
        out["int4 template"] = int4_template(lin)
        out["int4 dequantized in the graph, fused"] = dequantized(w, blocked=False)
        out["int4 dequantized in the graph, blocked"] = dequantized(w, blocked=True)
    return out


LAYER = {"qkv": (960, 576), "o": (576, 576), "gate/up": (3072, 576), "down": (576, 1536)}


def one_row(repeats: int) -> dict:
    """us and GB/s (codes, scales and mins read) of one row through each layer matmul, on this
    run's threads and on one; the weights stay in cache between calls: the kernel's best rate."""
    out, threads = {}, torch.get_num_threads()
    for name, shape in LAYER.items():
        lin, x = Int4Linear(torch.randn(*shape) * 0.02), torch.randn(1, shape[1]).bfloat16()
        read = lin.packed.numel() * lin.packed.element_size() + lin.scales.numel() * lin.scales.element_size()
        out[name] = {"bytes": read}
        for t in dict.fromkeys((threads, 1)):
            torch.set_num_threads(t)
            us = least_us(lambda: INT4_MM(x, lin.packed, lin.group, lin.scales), repeats)
            out[name][f"{t} thread{'s' * (t > 1)}"] = {"us": round(us, 1), "gb_s": round(read / us / 1e3, 1)}
        torch.set_num_threads(threads)
    return out


def peaks(repeats: int) -> dict:
    """GMAC/s of a large GEMM per arithmetic (1024 rows through a 3072 x 576 weight; int8: 2048^3)."""
    x, w = torch.randn(1024, SHAPE[1]), torch.randn(*SHAPE)
    out = {"fp32": 1024 * SHAPE[0] * SHAPE[1] / least_us(lambda: PackedLinear(w)(x), repeats) / 1e3}
    if can_prepack(w.bfloat16()):
        p, xb = PackedLinear(w.bfloat16()), x.bfloat16()
        out["bf16"] = 1024 * SHAPE[0] * SHAPE[1] / least_us(lambda: p(xb), repeats) / 1e3
    a = torch.randint(-127, 128, (2048, 2048), dtype=torch.int8)
    out["int8"] = 2048 ** 3 / least_us(lambda: torch._int_mm(a, a), repeats) / 1e3
    return {k: round(v) for k, v in out.items()}


def measure(compile_: bool, repeats: int) -> dict:
    gen = torch.Generator().manual_seed(1)
    X = torch.randn(max(ROWS), SHAPE[1], generator=gen).bfloat16()
    table = {}
    for name, mm in candidates(compile_).items():
        print(f"kernels: {name}", file=sys.stderr, flush=True)
        alone = torch.cat([mm(X[i:i + 1]) for i in range(max(ROWS))])  # each row by itself
        table[name] = {}
        for k in ROWS:
            x = X[:k].contiguous()
            us = least_us(lambda: mm(x), repeats)
            table[name][str(k)] = {"us": round(us, 1), "rows_alike": bool(torch.equal(mm(x), alone[:k])),
                                   "gmac_s": round(k * SHAPE[0] * SHAPE[1] / us / 1e3, 1)}
    return table


def markdown(result: dict) -> str:
    lines = [f"One {SHAPE[0]} x {SHAPE[1]} matmul; us (cost k / 1 row) [GMAC/s]; `alike`: every "
             "row got its one-row bits.", "", "| kernel | " + " | ".join(f"k={k}" for k in ROWS) + " | alike |",
             "|---" * (len(ROWS) + 2) + "|"]
    for name, by_k in result["kernels"].items():
        one = by_k["1"]["us"]
        cells = [f"{r['us']:.0f} ({r['us'] / one:.2f}) [{r['gmac_s']:.0f}]" for r in by_k.values()]
        alike = "yes" if all(r["rows_alike"] for r in by_k.values()) else "no"
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {alike} |")
    runs = [k for k in next(iter(result["one_row"].values())) if k != "bytes"]   # "2 threads", "1 thread"
    lines += ["", "One row through torch's 4-bit kernel, each layer shape; us [GB/s read]:", "",
              "| matmul | KB read | " + " | ".join(runs) + " |", "|---|---|" + "---|" * len(runs)]
    for name, r in result["one_row"].items():
        cells = [f"{r[k]['us']:.1f} [{r[k]['gb_s']:.1f}]" for k in runs]
        lines.append(f"| {name} | {r['bytes'] / 1e3:.0f} | " + " | ".join(cells) + " |")
    lines += ["", "Peak GMAC/s, large GEMMs: " + ", ".join(f"{k} {v}" for k, v in result["peak_gmac_s"].items())]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = Parser(prog="python -m tools.kernels", description=first(__doc__))
    p.add_argument("--compile", action="store_true", help="also Inductor's 4-bit GEMM template and the weights dequantized in a graph (needs gcc)")
    p.add_argument("--repeats", type=int, default=200, help="timed calls per figure (the least is kept)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--out", type=Path, default=Path("bench-out"), help="kernels.md and kernels.json go here")
    args = p.parse_args(argv)
    if not 1 <= args.repeats <= 100_000:
        p.error("--repeats must be in [1, 100000]")
    try:
        if not args.json:
            out_dir(args.out)
        torch.set_grad_enabled(False)
        result = {"machine": machine("cpu"), "shape": SHAPE, "kernels": measure(args.compile, args.repeats),
                  "one_row": one_row(args.repeats), "peak_gmac_s": peaks(max(3, args.repeats // 40))}
    except (OSError, ValueError, RuntimeError) as e:   # RuntimeError: a kernel this CPU lacks
        print(f"tools.kernels: error: {str(e).splitlines()[0] if str(e) else type(e).__name__}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(result))
        return 0
    table = markdown(result)
    write_atomic(args.out / "kernels.md", f"Machine: {describe(result['machine'])}\n\n{table}".encode())
    write_atomic(args.out / "kernels.json", json.dumps(result, indent=1).encode())
    print(table + f"written: {args.out}/kernels.md, kernels.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
