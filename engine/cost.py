"""The adaptive decoders' price list: what a forward costs, in units of a one-row forward.

Lookahead picks its arm (plain, lookup, a window size) and speculative decoding its draft
length K by expected tokens per unit of cost. The cost comes from this fixed model, never
from the wall clock, so the choice depends only on the tokens seen so far: the same command,
seed and machine print the same tokens on every path, including the inexact ones (bf16,
int4) whose k-row forwards round differently from one-row forwards.

    cost(k rows) = 1 + slope * (k - 1)              a forward of k rows, one row = 1

`slope` is set by the matmul kind, from `python -m tools.bench --forward-cost` (median
cost(8)/cost(1) and cost(16)/cost(1) on the machines in docs/speed.md). A user who wants the
price list of their own machine measures it with that command and passes the JSON it writes
(`--cost-table bench-out/forward-cost.json`): a fixed file, so the tokens stay put.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

from engine.llama import Llama

SLOPE = {                      # extra cost of each row past the first, by matmul kind
    "PackedLinear": 0.03,      # oneDNN, reordered weights: 8 rows ~ 1.2x one row
    "Int4Linear": 0.08,        # torch's int4 kernel: 8 rows ~ 1.6x
    "Linear": 0.06,            # nn.Linear on CPU (MKL repacks per call): 8 rows ~ 1.4x
    "cuda": 0.005,             # a GPU is far from its compute peak at a few rows
}


def row_cost(model: Llama, table: dict[int, float] | None = None) -> Callable[[int], float]:
    """k -> cost of a k-row forward of `model`, one row = 1 (linear between table points)."""
    if table:
        return lambda k: interpolate(table, k)
    kind = type(model.layers[0].feed_forward.w13).__name__
    if model.tok_embeddings.weight.device.type == "cuda":
        kind = "cuda"
    slope = SLOPE.get(kind, SLOPE["Linear"])
    return lambda k: 1 + slope * (max(k, 1) - 1)


def interpolate(table: dict[int, float], k: int) -> float:
    ks = sorted(table)
    if k <= ks[0]:
        return table[ks[0]]
    for a, b in zip(ks, ks[1:]):
        if k <= b:
            return table[a] + (table[b] - table[a]) * (k - a) / (b - a)
    a, b = ks[-2:] if len(ks) > 1 else (ks[0], ks[0])   # past the last point: the last slope
    slope = (table[b] - table[a]) / (b - a) if b > a else 0.0
    return table[b] + slope * (k - b)


def load_table(path: str | Path) -> dict[int, float]:
    """The k -> cost(k)/cost(1) ratios of a `tools.bench --forward-cost` JSON (its first model)."""
    try:
        d = json.loads(Path(path).read_text())
        rows = next(iter(d["forward_cost"].values()))
        table = {int(k): float(r["ratio"]) for k, r in rows.items()}
    except (OSError, ValueError, KeyError, TypeError, StopIteration, AttributeError) as e:
        raise ValueError(f"{path}: not a forward-cost JSON from tools.bench ({e})") from None
    if 1 not in table or any(not 0 < v < 1e6 for v in table.values()):
        raise ValueError(f"{path}: the cost table needs k = 1 and positive ratios")
    return table


def layer_share(model: Llama, layers: int) -> float:
    """The share of a one-row forward's weight reads spent in layers [0, layers) (the rest:
    the other layers and the LM head), from the model's shapes: one-row steps read weights."""
    c = model.config
    per_layer = c.dim * (c.n_heads + 2 * c.n_kv_heads) * c.head_dim + c.n_heads * c.head_dim * c.dim \
        + 3 * c.dim * c.hidden_dim                                     # wqkv, wo, w13, w2
    return layers * per_layer / (c.n_layers * per_layer + c.vocab_size * c.dim)
