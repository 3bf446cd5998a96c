"""The 4-bit step compiled, for the bench: the whole layer stack as one torch.compile'd graph
(inductor, C++ wrapper), on the exact path. `make bench COMPILE=1` adds its rows
(tools/bench.py --compile).

It lives beside the library, where it is measured: it was the CLI's --compile until, compiled
block by block, it gave no gain (docs/compile.md), and its warm-up takes minutes.

Why: a one-row int4 step spends about half its time between its kernels (norms, RoPE, views,
casts and the Python that calls them; docs/speed.md, run 17). Inductor fuses the small ops into
a few C++ loops, and its C++ wrapper calls them and the matmuls with no Python in between.
One graph a step, not one a layer: dynamo's own work per call (guards, the compiled region's
entry) costs ~0.15-0.2 ms, which per layer is as much as the fusion saves.

    model = compile_model(build(ckpt, int4=True), notify=print)    # the exact path, compiled

The exact path stays exact. Its attention (engine/invariant.py's row_attention) reads the mask
to choose each row's keys, which a graph cannot trace, so it enters the graph as an opaque
custom op: the graph calls it, eagerly, with the q, K and V it computed. The rest of the graph
must round a row alike in the one-row graph and the k-row graph, which inductor fuses apart:
by default it computes a fused chain of bf16 ops in fp32 and rounds once, at the chain's end,
so two fusions round apart; `emulate_precision_casts` rounds after every op, as eager does.
Then a k-row forward's rows get the compiled one-row step's bits, and every decoder prints the
compiled plain's tokens (tests/test_compiled.py; on SmolLM2, `docs/compile.md`). Those may
differ from eager plain's: inductor's reductions (RMSNorm's mean) sum in another order.

What runs eager, in every decoder alike: a forward after fewer than 2 cached slots (a prompt,
and the step after a one-token prompt: dynamo specializes the counts 0 and 1, each would be a
graph of its own); and what only some decoders send, which is then not held to the compiled
plain's tokens: early exits (start/stop: speculative's self-draft, contrastive's amateur) and
frozen rows (lookahead's trim_layers).

Never a traceback, never a wrong answer: where no compiler works, compiling fails, or a
cached artifact will not load, `notify` gets one line and the model runs eager. A model that
falls back mid-run (a shape the warm-up missed) says so: its later tokens may then differ
from a compiled plain run's.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.fx.experimental._config
from torch import Tensor

from engine.invariant import row_attention
from engine.kvcache import KVCache
from engine.llama import Llama, causal_mask, rope

# cpp_wrapper: the graph's kernels are called from C++, not from generated Python;
# emulate_precision_casts: bf16 rounded after every op, so fusions do not move a row's bits
OPTIONS = {"cpp_wrapper": True, "emulate_precision_casts": True}
FIRST = 2   # forwards after fewer cached slots run eager (see the module docstring)


# subtle: the ops are defined with torch.library.Library, not torch.library.custom_op, whose
# wrapper costs ~20 us more a call (31 against 11 us here), 60 calls a step
OPS = torch.library.Library("engine_tools", "DEF")
OPS.define("row_attention(Tensor q, Tensor k, Tensor v, SymInt S, Tensor? mask) -> Tensor")
OPS.define("store_kv(Tensor(a!) k_cache, Tensor(b!) v_cache, int layer, SymInt n, Tensor k, Tensor v) -> ()")


def opaque_row_attention(q: Tensor, k: Tensor, v: Tensor, S: int, mask: Tensor | None) -> Tensor:
    """row_attention over the first S slots of k, v, as one op a graph calls but does not trace
    (its choices read the mask's values). A one-row mask that sees every key is plain's step,
    which row_attention takes without a mask: the same call, so the same bits."""
    if mask is not None and q.shape[2] == 1 and bool(mask.all()):
        mask = None
    return row_attention(q, k.narrow(2, 0, S), v.narrow(2, 0, S), attn_mask=mask, enable_gqa=True).contiguous()


def store_kv(k_cache: Tensor, v_cache: Tensor, layer: int, n: int, k: Tensor, v: Tensor) -> None:
    """Layer `layer`'s new K/V (B, Hkv, T, D) into the cache's slots [n, n + T), in place."""
    k_cache[layer].narrow(2, n, k.shape[2]).copy_(k)
    v_cache[layer].narrow(2, n, v.shape[2]).copy_(v)


OPS.impl("row_attention", opaque_row_attention, "CompositeExplicitAutograd")
OPS.impl("store_kv", store_kv, "CompositeExplicitAutograd")
torch.library.register_fake("engine_tools::row_attention", lambda q, k, v, S, mask: q.new_empty(q.shape), lib=OPS)
torch.library.register_fake("engine_tools::store_kv", lambda k_cache, v_cache, layer, n, k, v: None, lib=OPS)


def attend(q: Tensor, k: Tensor, v: Tensor, attn_mask: Tensor | None = None, enable_gqa: bool = True) -> Tensor:
    """The exact path's attention through the op: over k, v's first S keys, S = the mask's
    width (the compiled stack hands it whole buffers and a mask always) or all of them."""
    S = attn_mask.shape[1] if attn_mask is not None else k.shape[2]
    # subtle: the op's output is contiguous, and the graph assumes what its fake says; a
    # transposed q (a view of the qkv projection) would give the fake other strides
    return torch.ops.engine_tools.row_attention(q.contiguous(), k, v, S, attn_mask)


class Slots:
    """The cache as the compiled stack sees it: the whole (L, B, Hkv, capacity, D) buffers and the
    committed count n; append writes layer i's slots [n, n + T) and returns its whole buffers,
    of which the attention reads the mask's width."""

    def __init__(self, k: Tensor, v: Tensor, n: int):
        self.k, self.v, self.n = k, v, n

    def append(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        # subtle: the graph neither writes nor views the buffers' slots itself. A traced write
        # is functional: the graph copies its whole input back, each layer (a step 1.6x
        # eager's at 600 slots); and a view of the first n + T slots is contiguous only when it
        # fills the buffer, which dynamo guards on (a graph apart for a step that fills the
        # cache). So the write is an op that mutates in place, and the read is the attention op's
        torch.ops.engine_tools.store_kv(self.k, self.v, layer, self.n, k, v)
        return self.k[layer], self.v[layer]                            # (B, Hkv, capacity, D)


class CompiledStack:
    """Llama.blocks for one model: the whole stack through one compiled function where it can,
    eager elsewhere (see the module docstring), and eager for good once a call has failed."""

    def __init__(self, model: Llama, notify: Callable[[str], None]):
        # its blocks' attention must be `attend`: the stack hands it whole buffers (Slots)
        self.model, self.notify, self.stance = model, notify, "default"

        def stack(x: Tensor, cos: Tensor, sin: Tensor, k: Tensor, v: Tensor, n: int, mask: Tensor) -> Tensor:
            slots = Slots(k, v, n)
            for i, block in enumerate(model.layers):
                x = block(x, None, cos, sin, slots, i, mask)                 # (B, T, C)
            return x

        self.fn: Callable | None = torch.compile(stack, dynamic=True, options=OPTIONS)

    def __call__(self, x: Tensor, positions: Tensor, cache=None, mask: Tensor | None = None,
                 start: int = 0, stop: int | None = None, keep: Tensor | None = None,
                 trim_layers: int = 0) -> Tensor:
        m, T = self.model, x.shape[1]
        n = cache.length if cache is not None else 0
        if self.fn is None or cache is None or n < FIRST or start or stop not in (None, m.config.n_layers) \
                or trim_layers:
            return Llama.blocks(m, x, positions, cache, mask, start, stop, keep, trim_layers)
        if n + T > cache.capacity:  # KVCache.append's check, made before the compiled call
            raise ValueError(f"KV cache full: {n} + {T} slots > capacity {cache.capacity}")
        if mask is None:  # one row too: the mask's width tells the attention how many keys
            mask = causal_mask(n, T, x.device)                               # (T, S)
        if mask.shape != (T, n + T):
            raise ValueError(f"mask is {tuple(mask.shape)}, expected {(T, n + T)}")
        c = m.config
        cos, sin = rope(positions, c.head_dim, c.rope_theta, x.dtype, c.rope_scaling)   # (T, D) each
        # subtle: a tensor made outside inference mode (a caller's mask) has other dispatch
        # keys than one made inside (the causal mask), and dynamo would compile it a graph apart
        mask = mask if mask.is_inference() else mask.clone()
        try:
            # subtle: a recompile would be a new graph, whose kernels may round a row apart
            # from the warmed-up ones' (and costs minutes mid-run); it is refused instead
            with torch.compiler.set_stance(self.stance):
                return self.fn(x, cos, sin, cache.k, cache.v, n, mask)
        except Exception as e:  # noqa: BLE001 -- a compiler failure must leave eager working
            if self.stance == "default":
                raise  # warming up: compile_model tells the cause and restores the model
            self.fn = None
            self.notify(f"compile: a forward of {T} rows after {n} slots needs a new graph "
                        f"({type(e).__name__}); eager from here on, so later tokens may "
                        "differ from a compiled plain run's")
            return Llama.blocks(m, x, positions, cache, mask, start, stop, keep, trim_layers)


def compile_model(model: Llama, notify: Callable[[str], None]) -> Llama:
    """Give `model` a CompiledStack for its blocks and the exact attention through the opaque
    op (`attend`; a model built without it gets it too: the stack hands the attention whole
    buffers), compile the two graphs up front (`warm_up`: one row, k rows under a mask), and
    return it; on any failure, one notice through `notify` and the model as it was. Call it
    last, after prepack: the graphs depend on the kernels the blocks hold."""
    before = [block.attention.attend for block in model.layers]
    try:
        for block in model.layers:
            block.attention.attend = attend
        # an instance attribute: Llama.forward's self.blocks(...) finds it before the method
        model.blocks = stack = CompiledStack(model, notify)
        # subtle: past dynamo's recompile limit (8 graphs a function, counted over every model
        # compiled in this process) a frame silently runs eager; here that must be an error.
        # And no duck shapes: with them the per-block form's warm-up of T = 3 rows shared a symbol
        # with SmolLM2's Hkv = 3, and every other row count needed a new graph
        with torch._dynamo.config.patch(recompile_limit=64, fail_on_recompile_limit_hit=True), \
                torch.fx.experimental._config.patch(use_duck_shape=False):
            warm_up(model)
    except Exception as e:  # noqa: BLE001 -- no compiler, a compile error, a bad cached artifact
        model.__dict__.pop("blocks", None)
        for block, kernel in zip(model.layers, before):
            block.attention.attend = kernel
        notify(f"compile: {type(e).__name__}: {first_line(e)}; running eager")
        return model
    stack.stance = "fail_on_recompile"
    return model


def warm_up(model: Llama) -> None:
    """Compile the two graphs every decoder reaches after its prompt: one row (plain), and k
    rows under a mask (lookahead's tree, lookup's and speculative's chains)."""
    P = 3
    cache = KVCache.for_model(model, 2 * P + 2)
    tokens = torch.zeros(1, P, dtype=torch.long, device=model.tok_embeddings.weight.device)
    model(tokens, torch.arange(P), cache)                                     # the prompt: eager
    model(tokens[:, :1], torch.tensor([P]), cache)                            # one row
    mask = torch.ones(P, cache.length + P, dtype=torch.bool).tril(cache.length)   # (T, S)
    model(tokens, torch.arange(P + 1, 2 * P + 1), cache, mask=mask)           # k rows, masked


def first_line(e: Exception) -> str:
    """The cause in one line: inductor's messages run on with advice on TORCH_LOGS."""
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    lines = [line for line in lines if not line.startswith("backend=")]   # "backend=... raised:"
    return lines[0][:200] if lines else "no message"
