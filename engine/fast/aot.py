"""The 4-bit step compiled ahead of time (AOTInductor): `--compile`, opt-in, CPU and --int4 only.

A one-row int4 step spends about half its time between its kernels: norms, RoPE, casts and
the Python that calls them (docs/compile.md). AOTInductor compiles the whole layer stack, for
any row count and cache size, into a shared library that later runs load in seconds. It is
built on first use (a minute or two: gcc) and kept in ~/.cache/engine/ beside the cost table,
named by everything its code and weights depend on (`key`).

    model = compile_step(build(ckpt, int4=True, dtype=torch.bfloat16), notify=print)
    model = compile_step(..., splits=[20])    # and a self-draft of 20 layers, on graphs of their own

It is exact as the eager exact path is, by its own attention (`graph_attend`): each row over
its own keys in slot order, summed the same way for any row count, so a k-row forward's rows get
the compiled one-row step's bits (inductor also rounds bf16 after every op, as eager does).
Every decoder then prints the compiled plain's tokens, which may differ from eager plain's:
inductor sums RMSNorm's mean, and attention, in another order. The graph only reads the cache;
each forward's new K/V come back out and go in with one write (`Compiled`), so no Python runs
between its kernels (an opaque attention op called from the graph cost ~16 us a layer: docs/compile.md).

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

import contextlib
import hashlib
import os
import signal
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path
from typing import Callable

import numpy as np
import torch
from torch import Tensor, nn

from engine.fast.artifacts import cache_home, model_key, sweep
from engine.fast.invariant import row_attention
from engine.fast.packed import Int4Linear
from engine.kvcache import KVCache
from engine.llama import Llama, causal_mask, rope

GRAPH_ROWS, GRAPH_SLOTS = 1024, 1 << 20   # the graph's bounds: rows a forward, cache slots
OPTIONS = {"emulate_precision_casts": True,   # bf16 rounded after every op, as eager does
           # a value read twice with 4+ reads (RoPE's q and k) is stored, not recomputed per key:
           # then the cached and the new keys' scores are one and the same reduction (see below)
           "realize_reads_threshold": 3,
           # indices are clamped by construction; a bounds check on each key's load cost ~40%
           "assert_indirect_indexing": False,
           # no weights in the library: the step reads the model's own (shares_weights)
           "aot_inductor.package_constants_in_so": False}
VERSION = "aot 4"   # of the graph: in every key, so a new one is built and priced anew
KEY_BLOCK = 64   # a row's keys are summed in whole blocks of this many (masked places weigh 0)


class Slots:
    """The cache as the graph sees it (KVCache.append's part): read-only buffers, the new rows'
    visible keys (`new_keys`), and each layer's new K/V, handed back for one write after."""

    def __init__(self, k: Tensor, v: Tensor, which: Tensor, count: Tensor):
        self.k, self.v, self.which, self.count, self.made = k, v, which, count, []

    def append(self, layer: int, k: Tensor, v: Tensor) -> tuple[Slots, Slots]:
        self.layer, self.new = layer, (k, v)
        self.made.append((k, v))
        return self, self


def graph_attend(q: Tensor, k: Slots, v: Slots, attn_mask: Tensor, enable_gqa: bool = True) -> Tensor:
    """Attention.attend while the stack is exported: each row of q (B, H, T, D) over its keys in
    slot order, the n cached ones then the new ones its mask row shows (k.which, k.count), fp32:

        s_j = (q / sqrt(D)) . K_j,    y = sum_j e^(s_j - max s) V_j / sum_j e^(s_j - max s)

    Those are exactly the keys plain's one-row step had for the row's token (its cache then held
    the accepted rows before it, in order); so a row gets the one-row step's bits if each sum runs
    alike for alike keys, and inductor writes one kernel for every row count. Three traps:
    - a cached key's score and a new key's are two reductions; they must be the same code
      (OPTIONS' realize_reads_threshold stores q and k, else k's RoPE is recomputed inside one);
    - sums over j go by vectors with a tail apart, so j runs to a multiple of KEY_BLOCK, the
      extra places masked: e^-inf is exactly 0 and adds nothing, and no row has a tail;
    - max, exp and the division are per element; sum_j e V runs j in order per element of D.
    tests/test_aot.py holds a k-row forward's rows to one-row forwards bit for bit."""
    s, (new_k, new_v) = k, k.new
    B, H, T, D = q.shape
    Hkv = new_k.shape[1]
    n = attn_mask.shape[1] - T                                        # cached slots
    S = (n + T + KEY_BLOCK - 1) // KEY_BLOCK * KEY_BLOCK              # places, padded
    j = torch.arange(S, device=q.device)                              # (S,)
    cached, slot = j < n, j.clamp(max=n - 1)
    place = s.which.gather(1, (j - n).clamp(0, T - 1).expand(T, S))   # (T, S): new key at place j
    seen = cached | ((j - n) < s.count[:, None])                      # (T, S)
    qg = (q.float() * D ** -0.5).view(B, Hkv, H // Hkv, T, 1, D)     # each kv head serves H/Hkv
    old = (qg * s.k[s.layer][:, :, None, None, slot].float()).sum(-1)   # (B, Hkv, H/Hkv, T, S)
    new = (qg * new_k.float()[:, :, None, None]).sum(-1)              # (B, Hkv, H/Hkv, T, T)
    scores = torch.where(cached, old, new.gather(-1, place.expand(B, Hkv, H // Hkv, T, S)))
    scores = scores.masked_fill(~seen, float("-inf"))
    e = torch.exp(scores - scores.amax(-1, keepdim=True))            # masked places: exactly 0
    values = torch.where(cached[:, None], s.v[s.layer][:, :, None, slot], new_v[:, :, place])   # (B, Hkv, T, S, D)
    y = (e[..., None] * values.float()[:, :, None]).sum(-2) / e.sum(-1, keepdim=True)   # (B, Hkv, H/Hkv, T, D)
    return y.view(B, H, T, D).to(q.dtype)


def new_keys(mask: Tensor, n: int) -> tuple[Tensor, Tensor] | None:
    """For each row of a (T, n + T) mask: the new keys it sees, in slot order (T, T), and how many
    (T,); None where a row does not see every cached slot (the graph assumes it does)."""
    visible = mask.cpu().numpy()
    if not visible[:, :n].all():
        return None
    mine = visible[:, n:]                                             # (T, T)
    order = np.argsort(~mine, axis=1, kind="stable")                  # its keys first, in order
    return torch.from_numpy(order.astype(np.int64)), torch.from_numpy(mine.sum(1).astype(np.int64))


class Stack(nn.Module):
    """Layers [start, stop) as one function of tensors: what is exported and compiled."""

    def __init__(self, model: Llama, start: int, stop: int):
        super().__init__()
        self.layers, self.start = model.layers[start:stop], start

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, k: Tensor, v: Tensor, mask: Tensor,
                which: Tensor, count: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        slots = Slots(k, v, which, count)
        for i, block in enumerate(self.layers, self.start):
            x = block(x, None, cos, sin, slots, i, mask)                # (B, T, C)
        made_k, made_v = zip(*slots.made)
        return x, torch.stack(made_k), torch.stack(made_v)             # and (layers, B, Hkv, T, D) twice

    def groups(self) -> list[int]:                                     # each 4-bit matmul's group size
        return [m.group for m in self.modules() if isinstance(m, Int4Linear)]


class Compiled:
    """Llama.blocks through a compiled range of layers where there is one, eager elsewhere."""

    def __init__(self, model: Llama, runners: dict[tuple[int, int], Callable], notify: Callable[[str], None]):
        self.model, self.runners, self.notify = model, runners, notify   # (start, stop) -> runner
        self.version = VERSION   # in every kept price's key (artifacts.model_key): a new graph is priced anew
        self.eager = 0     # forwards after a prompt that ran eager and reach the head
        self.chains: dict[int, tuple[Tensor, Tensor]] = {}   # T -> its rows' keys (chain)

    def __call__(self, x: Tensor, positions: Tensor, cache=None, mask: Tensor | None = None,
                 start: int = 0, stop: int | None = None, keep: Tensor | None = None,
                 trim_layers: int = 0) -> Tensor:
        m, T = self.model, x.shape[1]
        n, last = (cache.length if cache is not None else 0), m.config.n_layers
        runner = None if trim_layers else self.runners.get((start, last if stop is None else stop))
        if runner is None or n == 0 or T > GRAPH_ROWS or cache.capacity > GRAPH_SLOTS:
            self.eager += n > 0 and stop in (None, last)    # an early exit's own logits are drafts
            return Llama.blocks(m, x, positions, cache, mask, start, stop, keep, trim_layers)
        if n + T > cache.capacity:   # KVCache.append's check, made before the compiled call
            raise ValueError(f"KV cache full: {n} + {T} slots > capacity {cache.capacity}")
        # a causal chain (plain's step, a copy) has known keys: nothing to read back from a mask
        rows = self.chain(T) if mask is None else None
        mask = causal_mask(n, T, x.device) if mask is None else mask      # (T, S): S tells the keys
        if mask.shape != (T, n + T):
            raise ValueError(f"mask is {tuple(mask.shape)}, expected {(T, n + T)}")
        rows = rows or new_keys(mask, n)
        if rows is None:              # a row that does not see every cached slot: eager
            self.eager += stop in (None, last)
            return Llama.blocks(m, x, positions, cache, mask, start, stop, keep, trim_layers)
        c = m.config
        cos, sin = rope(positions, c.head_dim, c.rope_theta, x.dtype, c.rope_scaling)   # (T, D) each
        try:
            x, k, v = runner(x, cos, sin, cache.k, cache.v, mask.contiguous(), *rows)   # strides as built
        except Exception as e:  # noqa: BLE001 -- a failing library must leave eager working
            self.runners = {}
            self.notify(f"compile: the compiled step failed ({type(e).__name__}: {first_line(e)}); "
                        "eager from here on, so later tokens may differ from a compiled plain run's")
            return self(x, positions, cache, mask, start, stop, keep, trim_layers)
        layers = slice(start, last if stop is None else stop)
        cache.k[layers].narrow(3, n, T).copy_(k)     # every layer's new K/V in one write
        cache.v[layers].narrow(3, n, T).copy_(v)
        return x

    def chain(self, T: int) -> tuple[Tensor, Tensor]:
        """new_keys of a causal chain of T rows (row t sees new keys 0..t), made once per T.
        subtle: read back from the mask each step, a two-row copy cost ~1.24x a plain step, not
        the 1.15-1.18x its forward costs: NumPy and small ops in the caches a forward has swept."""
        if T not in self.chains:
            self.chains[T] = new_keys(causal_mask(0, T), 0)
        return self.chains[T]


def compiled(model: Llama) -> Compiled | None:
    """The model's compiled stack, if compile_step set one (the seam Llama.blocks, as an instance
    attribute that shadows the method), else None: the one place that looks."""
    blocks = model.__dict__.get("blocks")
    return blocks if isinstance(blocks, Compiled) else None


def compile_step(model: Llama, notify: Callable[[str], None], folder=None, splits=()) -> Llama:
    """`model` with its layer stack compiled (each built once into `folder`, default
    ~/.cache/engine, then loaded), in place; for each L of `splits` also layers [0, L) and
    [L, n), an early exit's two halves (a self-draft, an amateur). On any failure one notice
    through `notify` and the model as it was."""
    n, have = model.config.n_layers, compiled(model)
    ranges = [(0, n)] + [r for L in splits if 0 < L < n for r in ((0, L), (L, n))]
    runners = dict(have.runners) if have is not None else {}   # compiled before: add to them
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")   # export's deprecation chatter: the notice says what matters
            check(model)
            ident = key(model)
            runners |= {r: shares_weights(load(model, *r, ident, folder, notify), model, *r)
                        for r in dict.fromkeys(ranges) if r not in runners}
    except Exception as e:  # noqa: BLE001 -- no compiler, a failed build, a bad artifact
        notify(f"compile: {type(e).__name__}: {first_line(e)}; running eager")
        return model
    # an instance attribute: Llama.forward's self.blocks(...) finds it before the method
    model.blocks = Compiled(model, runners, notify)
    return model


def shares_weights(runner: Runner, model: Llama, start: int, stop: int) -> Runner:
    """`runner` reading `model`'s own layer weights: its package holds none (OPTIONS), and the key
    holds their hash. subtle: a copy in the package was slow (on a Zen 5 EPYC the 1.5B's 4-bit
    matmuls took 2.4x as long on it as on the model's tensors: a compiled step 58 ms, eager 32,
    on the model's 29), and loaded, it stayed resident (a compiled 1.5B: 3.0 GB, eager 1.5)."""
    stack = Stack(model, start, stop)
    runner.give(constants(runner.loader.get_constant_fqns(), stack.state_dict(), stack.groups()))
    return runner


def constants(names: list[str], named: dict[str, Tensor], groups: list[int]) -> dict[str, Tensor]:
    """What the graph reads, by its names: the stack's parameters and buffers, and one int64 scalar
    per 4-bit matmul, its group size (`constantN`: the lowering of torch's 4-bit matmul adds it).
    A graph that names anything else is refused: the step would read values no one gave it."""
    made = [k for k in names if k not in named]
    if len(made) != len(groups) or len(set(groups)) > 1:
        raise ValueError(f"the step reads {len(made)} tensors the model does not name, "
                         f"expected one group size for each of its {len(groups)} 4-bit matmuls")
    return {k: named[k].detach() if k in named else torch.tensor(groups[0], dtype=torch.int64) for k in names}


def check(model: Llama) -> None:
    """Only the exact 4-bit CPU step is compiled: another path's graph would not keep its rows alike."""
    w = model.tok_embeddings.weight
    if w.device.type != "cpu" or not isinstance(model.layers[0].feed_forward.w13, Int4Linear):
        raise ValueError("it compiles the 4-bit step on a CPU (--int4) only")
    if model.layers[0].attention.attend is not row_attention:
        raise ValueError("it compiles the exact path only (not with --no-batch-invariant)")


def load(model: Llama, start: int, stop: int, ident: str, folder, notify: Callable[[str], None]) -> Callable:
    """Layers [start, stop) of `model` (whose key(model) is `ident`), compiled: read back, or
    built and kept first. A kept file that does not load (cut short, a disk that filled) or
    was built for another model or machine (copied by hand) is built anew, once, with a notice."""
    k = f"{start}-{stop}|{ident}"
    folder = cache_home() / "engine" if folder is None else folder
    path = folder / f"step-{hashlib.sha256(k.encode()).hexdigest()[:16]}.pt2"
    if path.is_file():
        try:
            return read(path, k)
        except Exception as e:  # noqa: BLE001 -- the loader's own error is the check
            notify(f"{path} {first_line(e) if isinstance(e, ValueError) else 'does not load'}: building it anew")
            path.unlink(missing_ok=True)
    # no working compiler: say so now, not after a minute of export and code generation
    from torch._inductor.cpp_builder import get_cpp_compiler
    get_cpp_compiler()                          # InvalidCxxCompiler, naming what it tried
    t0 = time.perf_counter()
    notify(f"compiling layers {start}-{stop - 1} of the 4-bit step, once on this machine (minutes)")
    with progress(f"layers {start}-{stop - 1}") as stage:
        build_package(model, start, stop, path, k, stage)
    notify(f"compiled them into {path} in {time.perf_counter() - t0:.0f} s; later runs load it "
           "(delete it to build anew)")
    return read(path, k)


def read(path: Path, k: str) -> Callable:
    """The step kept at `path`, if it was built under key `k`."""
    runner = Runner(path)
    if runner.loader.get_metadata().get("engine_key") != k:   # a file put there by hand, or a collision
        raise ValueError("was built for another model or machine")
    return runner


class Runner:
    """A kept step, run by torch's C++ package loader alone: tensors in, tensors out.

    subtle: torch._inductor.aoti_load_package wraps this loader, but importing its module
    imports inductor and dynamo (~1.4 s of a ~3.7 s start), and it names this CPU's vector ISA by
    building a probe library per ISA with gcc (~1.2 s more) only to warn on a mismatch, which
    the key rules out (it holds the CPU and dispatch); its warnings went to the user raw too."""

    def __init__(self, path: Path):
        self.loader = torch._C._aoti.AOTIModelPackageLoader(str(path), "model", False, 1, -1)

    def __call__(self, *tensors: Tensor) -> list[Tensor]:
        return self.loader.boxed_run(list(tensors))     # Stack's inputs and outputs, flat, in order

    def give(self, constants: dict[str, Tensor]) -> None:
        """The graph's weights, all or an error, read in place (user-managed: held here, never copied)."""
        self.constants = constants
        self.loader.load_constants(constants, False, True, True)   # active buffer, full, user-managed


STAGES = ("export", "compile (gcc)", "trial load")


@contextlib.contextmanager
def progress(what: str):
    """A bar on a terminal's stderr through the build's STAGES, its clock ticking each second
    (the compile stage is one call of a minute or more); a pipe gets nothing, as before."""
    from tqdm import tqdm
    tty = False
    with contextlib.suppress(OSError, ValueError, AttributeError):   # a closed or missing stderr
        tty = sys.stderr.isatty()
    bar = tqdm(total=len(STAGES), desc=what, file=sys.stderr, disable=not tty,
               bar_format="{desc}: {bar:12} {n}/{total} {postfix} [{elapsed}]", leave=False)
    done = threading.Event()
    ticker = threading.Thread(target=lambda: [bar.refresh() for _ in iter(lambda: done.wait(1), True)], daemon=True)
    ticker.start()

    def stage(name: str) -> None:
        bar.update(STAGES.index(name) - bar.n)
        bar.set_postfix_str(name)
    try:
        yield stage
    finally:
        done.set()
        ticker.join()
        bar.close()


def build_package(model: Llama, start: int, stop: int, path, k: str,
                  stage: Callable[[str], None] = lambda name: None) -> None:
    """Export layers [start, stop) with dynamic rows and slots, compile them, keep them at `path` (a
    temporary file first, then renamed: a killed build leaves no half artifact)."""
    from torch.export import Dim
    c, before = model.config, [b.attention.attend for b in model.layers]
    T, n, capacity = 7, 11, 29     # a sample; none may equal a fixed size (H, Hkv, D), or export ties them
    x = torch.zeros(1, T, c.dim, dtype=model.tok_embeddings.weight.dtype)
    cos, sin = rope(torch.arange(n, n + T), c.head_dim, c.rope_theta, x.dtype, c.rope_scaling)
    kv = KVCache.for_model(model, capacity).k                           # (L, 1, Hkv, capacity, D)
    rows, slots = Dim("rows", min=1, max=GRAPH_ROWS), Dim("slots", min=2, max=GRAPH_SLOTS)
    cap = Dim("capacity", min=2, max=GRAPH_SLOTS)
    shapes = {"x": {1: rows}, "cos": {0: rows}, "sin": {0: rows}, "k": {3: cap}, "v": {3: cap},
              "mask": {0: rows, 1: slots}, "which": {0: rows, 1: rows}, "count": {0: rows}}
    path.parent.mkdir(parents=True, exist_ok=True)
    sweep(path.parent)                                        # what killed builds left behind
    tmp = path.with_name(f".{path.stem}.{os.getpid()}.pt2")   # the packager wants .pt2
    try:
        for b in model.layers:
            b.attention.attend = graph_attend
        mask = causal_mask(n, T)
        args = (x, cos, sin, kv, kv.clone(), mask, *new_keys(mask, n))
        stage("export")
        program = torch.export.export(Stack(model, start, stop), args, dynamic_shapes=shapes, strict=False)
        stage("compile (gcc)")
        torch._inductor.aoti_compile_and_package(
            program, package_path=str(tmp), inductor_configs={**OPTIONS, "aot_inductor.metadata": {"engine_key": k}})
        stage("trial load")
        trial(tmp, args, Stack(model, start, stop))
        os.replace(tmp, path)
    finally:
        for b, kernel in zip(model.layers, before):
            b.attention.attend = kernel
        tmp.unlink(missing_ok=True)


# a fresh process, as a later run's: load the step, run it once on the sample (trial_run)
TRIAL = "import sys; from engine.fast.aot import trial_run; trial_run(*sys.argv[1:])"


def trial_run(path: str, sample: str) -> None:
    """The trial's child: the step at `path` run on the sample's inputs, with zeros for weights."""
    runner, (args, shapes, sizes) = Runner(Path(path)), torch.load(sample)
    zeros = {k: torch.zeros(t.shape, dtype=t.dtype) for k, t in shapes.items()}
    runner.give(constants(runner.loader.get_constant_fqns(), zeros, sizes))
    runner(*args)


def trial(path: Path, args: tuple, stack: Stack) -> None:
    """Load the step at `path` and run it on `args` (and zeros for `stack`'s weights) in a child
    process; raise if it fails, so a step that crashes (a signal) is never kept, nor loaded here."""
    sample = path.with_suffix(".args")                           # weights' shapes, not a GB of them:
    torch.save((args, {k: t.to("meta") for k, t in stack.state_dict().items()}, stack.groups()), sample)
    root = str(Path(__file__).resolve().parents[2])              # where `engine` imports from
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
    """What the compiled code depends on (engine.fast.artifacts.model_key: machine, torch, dtype, kernels,
    shapes) and the weights it runs on (a hash of the layers' tensors)."""
    h = hashlib.sha256()
    for name, t in model.layers.state_dict().items():
        h.update(name.encode())
        h.update(t.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    eager = model_key(model).split("|compiled ", 1)[0]   # the same whether compiled before or not
    return f"{VERSION}|{KEY_BLOCK}|{OPTIONS}|{GRAPH_ROWS}|{GRAPH_SLOTS}|{eager}|{h.hexdigest()}"


def first_line(e: Exception) -> str:
    """The cause in one line: inductor's messages run on with advice on TORCH_LOGS."""
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    return lines[0][:200] if lines else "no message"
