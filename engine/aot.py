"""The 4-bit step compiled ahead of time (AOTInductor): `--compile`, opt-in, CPU and --int4 only.

A one-row int4 step spends about half its time between its kernels: norms, RoPE, casts and
the Python that calls them (docs/compile.md). AOTInductor compiles the whole layer stack, for
any row count and cache size, into a shared library that later runs load in seconds. It is
built on first use (a minute or two: gcc) and kept in ~/.cache/engine/ beside the cost table,
named by everything its code and weights depend on (`key`).

    model = compile_step(build(ckpt, int4=True, dtype=torch.bfloat16), notify=print)
    model = compile_step(..., splits=[20])    # and a self-draft of 20 layers, on graphs of their own

It is exact as the eager exact path is. Its attention is row_attention, which reads the mask's
values to choose each row's keys, so the graph calls it as an opaque op; and inductor rounds
bf16 after every op (`emulate_precision_casts`), so a k-row forward's rows get the compiled
one-row step's bits. Every decoder then prints the compiled plain's tokens, which may differ
from eager plain's: inductor sums RMSNorm's mean in another order.

An early exit (a self-draft, an amateur) runs its layers [0, L) and the target's [L, n) on
graphs of their own (`splits`). Runs eager, in every decoder alike: the prompt (no cached
slots). And what only some decoders send: frozen rows (--trim-layers), an early exit without
its graphs, rows past the graph's bounds. Each such forward that reaches the head is counted
in `Compiled.eager`; where the count is not 0 the CLI does not claim plain's tokens.

Never a traceback, never a wrong answer: no compiler, a failed build, an artifact that will not
load or was built for another key is one notice, and the model runs eager. A new step is first
loaded and run in a child process (`trial`): a library that crashes its process cannot be
caught, and one did (SIGSEGV loading a fresh step, torch 2.11 on an Intel Xeon: docs/compile.md).
"""
from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import Callable

import torch
from torch import Tensor, nn

from engine.cost import cache_home, model_key
from engine.invariant import row_attention
from engine.kvcache import KVCache
from engine.llama import Llama, causal_mask, rope
from engine.packed import Int4Linear

MOST_ROWS, MOST_SLOTS = 1024, 1 << 20   # the graph's bounds: rows a forward, cache slots
OPTIONS = {"emulate_precision_casts": True}   # bf16 rounded after every op, as eager does

# the graph's opaque op, one a layer: the layer's K/V write (in place: a traced write is
# functional, and the graph would copy the whole cache back every layer), then its exact attention
OPS = torch.library.Library("engine_aot", "DEF")
OPS.define("attend(Tensor q, Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, int layer, Tensor n, "
           "Tensor mask) -> Tensor")


def attend(q: Tensor, k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, layer: int, n: Tensor,
           mask: Tensor) -> Tensor:
    """Layer `layer`'s new K/V (B, Hkv, T, D) into slots [n, n + T) of the (L, B, Hkv, capacity, D)
    buffers, then row_attention of q (B, H, T, D) over the first S = mask.shape[1] slots."""
    keys, values = k_cache[layer], v_cache[layer]                     # (B, Hkv, capacity, D)
    keys.narrow(2, int(n), k.shape[2]).copy_(k)
    values.narrow(2, int(n), v.shape[2]).copy_(v)
    S = mask.shape[1]
    # subtle: plain's one-row step calls it without a mask; the same call gives the same bits
    plain = q.shape[2] == 1 and bool(mask.numpy().all())         # NumPy: 1 us, torch's all(): ~8
    return row_attention(q, keys.narrow(2, 0, S), values.narrow(2, 0, S), None if plain else mask).contiguous()


OPS.impl("attend", attend, "CompositeExplicitAutograd")
torch.library.register_fake("engine_aot::attend", lambda q, k, v, kc, vc, layer, n, mask: q.new_empty(q.shape), lib=OPS)


class Slots:
    """The cache as the graph sees it (KVCache.append's part): whole buffers and the count n."""

    def __init__(self, k: Tensor, v: Tensor, n: Tensor):
        self.k, self.v, self.n = k, v, n

    def append(self, layer: int, k: Tensor, v: Tensor) -> tuple[Slots, Slots]:
        # subtle: nothing is written yet: the layer's attention (graph_attend) hands its op the new
        # K/V with its query, one call out of the graph a layer, where two cost ~0.3 ms a step
        self.new = layer, k, v
        return self, self


def graph_attend(q: Tensor, k: Slots, v: Slots, attn_mask: Tensor, enable_gqa: bool = True) -> Tensor:
    """Attention.attend while the stack is exported: the opaque op, given what `Slots.append` kept."""
    layer, new_k, new_v = k.new
    # subtle: the op's fake output is contiguous, so its input must be (q is a view of qkv)
    return torch.ops.engine_aot.attend(q.contiguous(), new_k, new_v, k.k, k.v, layer, k.n, attn_mask)


class Stack(nn.Module):
    """Layers [start, stop) as one function of tensors: what is exported and compiled."""

    def __init__(self, model: Llama, start: int, stop: int):
        super().__init__()
        self.layers, self.start = model.layers[start:stop], start

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, k: Tensor, v: Tensor, n: Tensor,
                mask: Tensor) -> Tensor:
        slots = Slots(k, v, n)
        for i, block in enumerate(self.layers, self.start):
            x = block(x, None, cos, sin, slots, i, mask)                # (B, T, C)
        return x


class Compiled:
    """Llama.blocks through a compiled range of layers where there is one, eager elsewhere."""

    def __init__(self, model: Llama, runners: dict[tuple[int, int], Callable], notify: Callable[[str], None]):
        self.model, self.runners, self.notify = model, runners, notify   # (start, stop) -> runner
        self.eager = 0     # forwards after a prompt that ran eager and reach the head

    def __call__(self, x: Tensor, positions: Tensor, cache=None, mask: Tensor | None = None,
                 start: int = 0, stop: int | None = None, keep: Tensor | None = None,
                 trim_layers: int = 0) -> Tensor:
        m, T = self.model, x.shape[1]
        n, last = (cache.length if cache is not None else 0), m.config.n_layers
        runner = None if trim_layers else self.runners.get((start, last if stop is None else stop))
        if runner is None or n == 0 or T > MOST_ROWS or cache.capacity > MOST_SLOTS:
            self.eager += n > 0 and stop in (None, last)    # an early exit's own logits are drafts
            return Llama.blocks(m, x, positions, cache, mask, start, stop, keep, trim_layers)
        if n + T > cache.capacity:   # KVCache.append's check, made before the compiled call
            raise ValueError(f"KV cache full: {n} + {T} slots > capacity {cache.capacity}")
        mask = causal_mask(n, T, x.device) if mask is None else mask      # (T, S): S tells the keys
        if mask.shape != (T, n + T):
            raise ValueError(f"mask is {tuple(mask.shape)}, expected {(T, n + T)}")
        c = m.config
        cos, sin = rope(positions, c.head_dim, c.rope_theta, x.dtype, c.rope_scaling)   # (T, D) each
        try:
            return runner(x, cos, sin, cache.k, cache.v, torch.tensor(n), mask)
        except Exception as e:  # noqa: BLE001 -- a failing library must leave eager working
            self.runners = {}
            self.notify(f"compile: the compiled step failed ({type(e).__name__}: {first_line(e)}); "
                        "eager from here on, so later tokens may differ from a compiled plain run's")
            return self(x, positions, cache, mask, start, stop, keep, trim_layers)


def compile_step(model: Llama, notify: Callable[[str], None], folder=None, splits=()) -> Llama:
    """`model` with its layer stack compiled (each built once into `folder`, default
    ~/.cache/engine, then loaded), in place; for each L of `splits` also layers [0, L) and
    [L, n), an early exit's two halves (a self-draft, an amateur). On any failure one notice
    through `notify` and the model as it was."""
    n, have = model.config.n_layers, model.__dict__.get("blocks")
    ranges = [(0, n)] + [r for L in splits if 0 < L < n for r in ((0, L), (L, n))]
    runners = dict(have.runners) if isinstance(have, Compiled) else {}   # compiled before: add to them
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")   # export's deprecation chatter: the notice says what matters
            check(model)
            ident = key(model)
            runners |= {r: load(model, *r, ident, folder, notify) for r in dict.fromkeys(ranges) if r not in runners}
    except Exception as e:  # noqa: BLE001 -- no compiler, a failed build, a bad artifact
        notify(f"compile: {type(e).__name__}: {first_line(e)}; running eager")
        return model
    # an instance attribute: Llama.forward's self.blocks(...) finds it before the method
    model.blocks = Compiled(model, runners, notify)
    return model


def check(model: Llama) -> None:
    """Only the exact 4-bit CPU step is compiled: another path's graph would not keep its rows alike."""
    w = model.tok_embeddings.weight
    if w.device.type != "cpu" or not isinstance(model.layers[0].feed_forward.w13, Int4Linear):
        raise ValueError("it compiles the 4-bit step on a CPU (--int4) only")
    if model.layers[0].attention.attend is not row_attention:
        raise ValueError("it compiles the exact path only (not with --no-batch-invariant)")


def load(model: Llama, start: int, stop: int, ident: str, folder, notify: Callable[[str], None]) -> Callable:
    """Layers [start, stop) of `model` (whose key(model) is `ident`), compiled: read back, or
    built and kept first."""
    k = f"{start}-{stop}|{ident}"
    folder = cache_home() / "engine" if folder is None else folder
    path = folder / f"step-{hashlib.sha256(k.encode()).hexdigest()[:16]}.pt2"
    if not path.is_file():
        # no working compiler: say so now, not after a minute of export and code generation
        from torch._inductor.cpp_builder import get_cpp_compiler
        get_cpp_compiler()                          # InvalidCxxCompiler, naming what it tried
        t0 = time.perf_counter()
        notify(f"compiling layers {start}-{stop - 1} of the 4-bit step, once on this machine (minutes)")
        build(model, start, stop, path, k)
        notify(f"compiled them into {path} in {time.perf_counter() - t0:.0f} s; later runs load it "
               "(delete it to build anew)")
    runner = torch._inductor.aoti_load_package(str(path))
    if runner.get_metadata().get("engine_key") != k:   # a file put there by hand, or a collision
        raise ValueError(f"{path} was built for another model or machine (delete it to build anew)")
    return runner


def build(model: Llama, start: int, stop: int, path, k: str) -> None:
    """Export layers [start, stop) with dynamic rows and slots, compile them, keep them at `path` (a
    temporary file first, then renamed: a killed build leaves no half artifact)."""
    from torch.export import Dim
    c, before = model.config, [b.attention.attend for b in model.layers]
    T, n, capacity = 7, 11, 29     # a sample; none may equal a fixed size (H, Hkv, D), or export ties them
    x = torch.zeros(1, T, c.dim, dtype=model.tok_embeddings.weight.dtype)
    cos, sin = rope(torch.arange(n, n + T), c.head_dim, c.rope_theta, x.dtype, c.rope_scaling)
    kv = KVCache.for_model(model, capacity).k                           # (L, 1, Hkv, capacity, D)
    rows, slots = Dim("rows", min=1, max=MOST_ROWS), Dim("slots", min=2, max=MOST_SLOTS)
    cap = Dim("capacity", min=2, max=MOST_SLOTS)
    shapes = {"x": {1: rows}, "cos": {0: rows}, "sin": {0: rows}, "k": {3: cap}, "v": {3: cap},
              "n": None, "mask": {0: rows, 1: slots}}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.stem}.{os.getpid()}.pt2")   # the packager wants .pt2
    try:
        for b in model.layers:
            b.attention.attend = graph_attend
        args = (x, cos, sin, kv, kv.clone(), torch.tensor(n), causal_mask(n, T))
        program = torch.export.export(Stack(model, start, stop), args, dynamic_shapes=shapes, strict=False)
        torch._inductor.aoti_compile_and_package(
            program, package_path=str(tmp), inductor_configs={**OPTIONS, "aot_inductor.metadata": {"engine_key": k}})
        trial(tmp, args)
        os.replace(tmp, path)
    finally:
        for b, kernel in zip(model.layers, before):
            b.attention.attend = kernel
        tmp.unlink(missing_ok=True)


# a fresh process, as a later run's: import the ops, load the step, run it once on the sample
TRIAL = ("import sys, torch, engine.aot; "
         "torch._inductor.aoti_load_package(sys.argv[1])(*torch.load(sys.argv[2]))")


def trial(path: Path, args: tuple) -> None:
    """Load the step at `path` and run it on `args` in a child process; raise if the child fails,
    so a step that crashes (a signal, not an exception) is never kept, nor loaded here."""
    sample = path.with_suffix(".args")
    torch.save(args, sample)
    root = str(Path(__file__).resolve().parents[1])              # where `engine` imports from
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (root, os.environ.get("PYTHONPATH"))))}
    try:
        r = subprocess.run([sys.executable, "-c", TRIAL, str(path), str(sample)], env=env,
                           capture_output=True, text=True, timeout=600)
    finally:
        sample.unlink(missing_ok=True)
    if r.returncode < 0:
        raise RuntimeError(f"the compiled step crashed a trial process ({signal.Signals(-r.returncode).name})")
    if r.returncode:
        why = [line for line in r.stderr.splitlines() if line.strip()] or ["no message"]
        raise RuntimeError(f"the compiled step failed in a trial process: {why[-1].strip()[:200]}")


def key(model: Llama) -> str:
    """What the compiled code depends on (engine.cost.model_key: machine, torch, dtype, kernels,
    shapes) and the weights it holds (a hash of the layers' tensors)."""
    h = hashlib.sha256()
    for name, t in model.layers.state_dict().items():
        h.update(name.encode())
        h.update(t.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    eager = model_key(model).removesuffix("|compiled")   # the same whether compiled before or not
    return f"aot 2|{OPTIONS}|{MOST_ROWS}|{MOST_SLOTS}|{eager}|{h.hexdigest()}"


def first_line(e: Exception) -> str:
    """The cause in one line: inductor's messages run on with advice on TORCH_LOGS."""
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    return lines[0][:200] if lines else "no message"
