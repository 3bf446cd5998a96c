"""The 4-bit step compiled, for the bench: every layer through one torch.compile'd function
(inductor, C++ wrapper). `make bench COMPILE=1` adds it as a row (tools/bench.py --compile).

It was the CLI's --compile until it gave no gain the VMs' drift lets one call (docs/compile.md),
and was never an exact path; it lives beside the library now, where it is measured.

Why: a one-row int4 step spends more time between its matmuls (norms, RoPE, views, casts,
the Python that calls them) than in them (docs/split.md); inductor fuses the small ops into a
few C++ loops and its C++ wrapper calls them with no Python in between (docs/compile.md).

    model = compile_model(prepack(quantize_int4(load_model(ckpt))), notify=print)

One function serves all L blocks: a block's weights are its inputs, not constants, so its
graphs compile once (seconds each) rather than once per layer, at the cost of one call per
layer. The cache is handed to it as the layer's slots [0, S) and the committed count, so that
nothing it traces depends on which layer runs. Shapes are dynamic: one graph serves every S
and every k, but one row, 0 or 1 cached slots, trimmed rows and a full cache each get their
own, all compiled up front by `warm_up` (20-80 s here, docs/compile.md); a later recompile
is refused.

Exactness: compiled and eager kernels round apart (fused norms and RoPE), and a compiled
model's attention is SDPA's, whose rows round by the call's shape: a compiled run is not an
exact path. The exact path (--batch-invariant) is not compiled:
compile_model leaves it eager with one notice.

Never a traceback, never a wrong answer: where no compiler works, compiling fails, or a
cached artifact will not load, `notify` gets one line and the model runs eager. A model that
falls back mid-run (a shape the warm-up missed) says so: its later tokens may then differ
from a compiled plain run's, since compiled and eager kernels round differently.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.fx.experimental._config
from torch import Tensor, nn

from engine.kvcache import KVCache
from engine.llama import Block, Llama
from engine.invariant import row_attention

# cpp_wrapper: the graph's kernels are called from C++, not from generated Python
OPTIONS = {"cpp_wrapper": True}


class LayerSlots:
    """One layer's cache slots [0, S) as k, v (B, Hkv, S, D), the first `n` committed, seen by
    the compiled block as a KVCache: append writes [n, S) and returns all S keys."""

    def __init__(self, k: Tensor, v: Tensor, n: int):
        self.k, self.v, self.n = k, v, n

    def append(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        n, T = self.n, k.shape[2]
        self.k.narrow(2, n, T).copy_(k)
        self.v.narrow(2, n, T).copy_(v)
        return self.k, self.v                                          # (B, Hkv, S, D)


def block_step(block: Block, x: Tensor, rows: Tensor | None, cos: Tensor, sin: Tensor,
               k: Tensor, v: Tensor, n: int, mask: Tensor | None) -> Tensor:
    """Block.forward on a layer's own cache slots: what torch.compile traces, once."""
    return block(x, rows, cos, sin, LayerSlots(k, v, n), 0, mask)


class Compiled:
    """What every CompiledBlock of a model shares: the compiled function (None once it has
    failed: the whole model is then eager), the stance its calls run under, and the notice."""

    def __init__(self, fn: Callable, notify: Callable[[str], None]):
        self.fn, self.notify = fn, notify
        self.stance = "default"  # compile_model refuses recompiles once warmed up

    def fail(self, what: str) -> None:
        if self.fn is not None:  # one notice, however many layers see the failure
            self.fn = None
            self.notify(what)


class CompiledBlock(nn.Module):
    """A Block whose forward runs the shared compiled block_step on its cache layer; eager
    where there is no cache, and for good once a call has failed (after one notice)."""

    def __init__(self, block: Block, shared: Compiled):
        super().__init__()
        self.block, self.shared = block, shared

    # what the rest of the engine reads of a block (invariant.rows_round_alike, prepack's swaps)
    attention = property(lambda self: self.block.attention)
    feed_forward = property(lambda self: self.block.feed_forward)
    attention_norm = property(lambda self: self.block.attention_norm)
    ffn_norm = property(lambda self: self.block.ffn_norm)

    def forward(self, x: Tensor, rows: Tensor | None, cos: Tensor, sin: Tensor,
                cache: KVCache | None, layer: int, mask: Tensor | None) -> Tensor:
        fn = self.shared.fn
        if cache is None or fn is None:
            return self.block(x, rows, cos, sin, cache, layer, mask)
        n, T = cache.length, x.shape[1]
        if n + T > cache.capacity:  # KVCache.append's check, made before the compiled call
            raise ValueError(f"KV cache full: {n} + {T} slots > capacity {cache.capacity}")
        # subtle: the slots [0, n + T), not the whole buffer: dynamo keeps a view's base size
        # static, and a cache of another capacity would then be a new graph
        k, v = (b.narrow(2, 0, n + T) for b in cache.layers[layer])       # (B, Hkv, S, D)
        # subtle: a tensor made outside inference mode (a caller's mask) has other dispatch
        # keys than one made inside (the causal mask), and dynamo would compile it a graph apart
        x, rows, mask = (t if t is None or t.is_inference() else t.clone() for t in (x, rows, mask))
        try:
            # subtle: a recompile would be a new graph, whose kernels may round a row apart
            # from the warmed-up ones' (and costs seconds mid-run); it is refused instead
            with torch.compiler.set_stance(self.shared.stance):
                return fn(self.block, x, rows, cos, sin, k, v, n, mask)
        except Exception as e:  # noqa: BLE001 -- a compiler failure must leave eager working
            if self.shared.stance == "default":
                raise  # warming up: compile_model tells the cause and restores the blocks
            self.shared.fail(f"compile: a forward of {T} rows after {n} slots needs a new graph "
                             f"({type(e).__name__}); eager from here on, so later tokens may "
                             "differ from a compiled plain run's")
            return self.block(x, rows, cos, sin, cache, layer, mask)


def compile_model(model: Llama, notify: Callable[[str], None], trimmed: bool = False) -> Llama:
    """Swap every block for a CompiledBlock sharing one compiled block_step, compile its
    graphs up front (`warm_up`; `trimmed`: lookahead's trimmed rows too), and return the
    model; on any failure, one notice through `notify` and the eager model. Call it last,
    after prepack: the graphs depend on the kernels the blocks hold.

    The exact path stays eager (one notice): row_attention reads the mask's data to choose
    each row's keys, which a graph cannot (an earlier exact attention's traced form, every
    masked row gathering all its keys, met a dynamo guard that reused a graph at the wrong key
    count)."""
    if model.layers[0].attention.attend is row_attention:
        notify("compile: the exact path (--batch-invariant, bf16's and int4's default) runs eager: its "
               "attention reads the mask to choose each row's keys; build with batch_invariant=False "
               "to compile (tools/compiled.py)")
        return model
    blocks = list(model.layers)
    try:
        shared = Compiled(torch.compile(block_step, dynamic=True, options=OPTIONS), notify)
        for i, block in enumerate(blocks):
            model.layers[i] = CompiledBlock(block, shared)
        # subtle: past dynamo's recompile limit (8 graphs a function, counted over every model
        # compiled in this process) a frame silently runs eager; here that must be an error.
        # And with duck shapes, the warm-up's T = 3 rows would share a symbol with SmolLM2's
        # Hkv = 3 and be specialized to 3: every other row count would need a new graph
        with torch._dynamo.config.patch(recompile_limit=64, fail_on_recompile_limit_hit=True), \
                torch.fx.experimental._config.patch(use_duck_shape=False):
            warm_up(model, trimmed)
    except Exception as e:  # noqa: BLE001 -- no compiler, a compile error, a bad cached artifact
        for i, block in enumerate(blocks):
            model.layers[i] = block
        notify(f"compile: {type(e).__name__}: {first_line(e)}; running eager")
        return model
    shared.stance = "fail_on_recompile"
    return model


def warm_up(model: Llama, trimmed: bool = False) -> None:
    """Compile every graph a decoder reaches: one row (plain), k rows under a mask (every
    accelerating decoder), and with `trimmed`, k rows whose last layers are trimmed to kept
    rows (lookahead's --trim-layers). Slot counts 0 and 1 are graphs apart (dynamo
    specializes them), so a one-token prompt's first two steps get theirs; k rows after a
    one-token prompt do not (a notice, then eager)."""
    P = 3
    cache = KVCache.for_model(model, 2 * P + 2)
    tokens = torch.zeros(1, P, dtype=torch.long, device=model.tok_embeddings.weight.device)
    for n in (0, 1, P):                                                       # T = 1 at n = 0, 1, P
        cache.length = n
        model(tokens[:, :1], torch.tensor([n]), cache)
    for n in (0, P):  # the prompt's forward (n = 0: never trimmed) and later ones, k rows under a mask
        mask = torch.ones(P, n + P, dtype=torch.bool).tril(n)                 # (T, S)
        for keep, trim in ((None, 0),) + ((([0, 2], 1), ([1], 1)) if trimmed and n else ()):
            cache.length = n
            model(tokens, torch.arange(n, n + P), cache, mask=mask, keep=keep, trim_layers=trim)
    # subtle: a window that fills the cache is contiguous, and the cache write's graph depends
    # on that: one row and k rows get a graph for the last slots too
    for n, T in ((cache.capacity - 1, 1), (cache.capacity - P, P)):
        cache.length = n
        mask = None if T == 1 else torch.ones(T, n + T, dtype=torch.bool).tril(n)   # (T, S)
        model(tokens[:, :T], torch.arange(n, n + T), cache, mask=mask)


def first_line(e: Exception) -> str:
    """The cause in one line: inductor's messages run on with advice on TORCH_LOGS."""
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    lines = [line for line in lines if not line.startswith("backend=")]   # "backend=... raised:"
    return lines[0][:200] if lines else "no message"
