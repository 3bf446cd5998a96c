"""Which path a run takes, and whether it is exact: the model loaded as a path asks (`build`:
fp32, bf16, 4 bits; packed, batch-invariant), the fastest exact path where the flags leave it
open (`default_path`), and the one test of exactness every claim reads (`on_exact_path`).

    model = build(checkpoint, dtype=torch.bfloat16, int4=True)   # the default path on a CPU
    on_exact_path(model)   # every decoder prints its plain's tokens here, bit for bit
"""
from __future__ import annotations

import sys
from typing import Callable, NamedTuple

import torch

from engine.fast.aot import compiled
from engine.fast.invariant import row_attention, rows_round_alike
from engine.fast.machine import ATEN_CAPABILITY
from engine.fast.packed import exact_by_default, packs, prepack
from engine.fast.prepared import int4_model
from engine.llama import Llama, LlamaConfig
from engine.load.weights import load_model


def build(checkpoint, *, dtype: torch.dtype = torch.float32, device: str = "cpu", int4: bool = False,
          packed: bool = True, batch_invariant: bool | None = None, draft: bool = False,
          notify: Callable[[str], None] = lambda m: print(f"note: {m}", file=sys.stderr)) -> Llama:
    """The model as the CLI loads it: on `device` (cpu, cuda[:N]) in `dtype`; int4: --int4, the
    layer weights in 4-bit groups with bf16 activations (CPU; `dtype` is then bf16's); packed:
    the oneDNN matmuls (--no-prepack: False); batch_invariant: --batch-invariant (CPU or CUDA),
    every decoder's tokens plain's bit for bit (fp32, bf16, int4); None, as the CLI: on where
    it costs a one-row step nothing, bf16 and int4 on a CPU (packed.exact_by_default); notify:
    where a kept 4-bit file was bad and is prepared anew (engine/fast/prepared.py); draft: a
    speculative draft, whose 4-bit LM head may be 4-bit too (packed.quantize_int4's head_bits)."""
    device = check_device(device)
    if batch_invariant and not packed:   # as the CLI refuses --batch-invariant --no-prepack
        raise ValueError("batch_invariant sets the packed path's kernels: it has no effect with packed=False")
    if int4:   # quantized from the fp32 weights (Q4_1 grids come back exactly), kept on disk
        if torch.device(device).type != "cpu":
            raise ValueError(f"int4 quantizes a float32 CPU model, got one on {device}")
        model = int4_model(checkpoint, notify, head_bits=4 if draft else 8)
    else:
        model = load_model(checkpoint, device, dtype)
    if not packed:
        return model
    return prepack(model, exact_by_default(model) if batch_invariant is None else batch_invariant)


class RunPath(NamedTuple):
    """Which path a run takes: the flags it was given, the unasked ones filled in (`default_path`)."""
    dtype: str                   # a key of load.weights.DTYPES
    int4: bool
    batch_invariant: bool | None
    why: str = ""                # why the default is not the 4-bit path here ('' when asked for)

    @property
    def name(self) -> str:
        """The path in a few words, for the stats line: "int4 bf16", "fp32 batch-invariant", ..."""
        short = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16", "float64": "fp64"}[self.dtype]
        return ("int4 " if self.int4 else "") + short + (" batch-invariant" if self.batch_invariant and not self.int4
                                                       and short != "bf16" else "")


def path_name(path: "RunPath", model: Llama) -> str:
    """The path a loaded model runs on, as the stats line and Engine.path name it."""
    return path.name + (" compiled" if compiled(model) is not None else "")


def default_path(config: LlamaConfig, device: str = "cpu", dtype: str | None = None, int4: bool | None = None,
                 batch_invariant: bool | None = None, packed: bool = True) -> RunPath:
    """The path asked for, or where the flags leave it open the fastest one that is exact here:
    --int4 --dtype bfloat16 on a CPU whose kernels have SIMD, for a model whose projections
    pack in 4-bit groups (exact against its own plain where the kernel probe agrees); else
    fp32 with --batch-invariant (exact on a CPU and on CUDA; HF's tokens, but for a near-tie).
    --int4 alone means bf16 activations; a --dtype alone means that dtype, not 4 bits."""
    if dtype is None and int4 is None:
        why = (f"a model on {torch.device(device).type}" if torch.device(device).type != "cpu" else
               "no SIMD in torch's kernel dispatch" if ATEN_CAPABILITY == "DEFAULT" else
               "" if packs_int4(config) else "projections that do not pack in 4-bit groups of 32")
        if not why:
            return RunPath("bfloat16", True, batch_invariant)
        exact = packed and torch.device(device).type in ("cpu", "cuda")   # where its kernels are
        return RunPath("float32", False, exact if batch_invariant is None else batch_invariant, why)
    int4 = bool(int4)
    return RunPath(dtype or ("bfloat16" if int4 else "float32"), int4, batch_invariant)


def packs_int4(c: LlamaConfig) -> bool:
    """Whether every layer projection of a model so shaped takes torch's 4-bit kernel (packed.packs)."""
    q, kv = c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim
    shapes = [(q + 2 * kv, c.dim), (c.dim, q), (2 * c.hidden_dim, c.dim), (c.dim, c.hidden_dim)]
    return all(packs(torch.empty(o, i, device="meta")) for o, i in shapes)


def check_device(name, what: str = "device") -> torch.device:
    """`name` as torch understands it, on a device that exists here; else one ValueError."""
    try:
        d = torch.device(name)
    except (RuntimeError, ValueError, TypeError) as e:
        raise ValueError(f"{what} {name!r}: not a device ({str(e).splitlines()[0]})") from None
    if d.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"{what} {name}: CUDA is not available here")
    if d.type == "cuda" and d.index is not None and d.index >= torch.cuda.device_count():
        raise ValueError(f"{what} {name}: there are {torch.cuda.device_count()} CUDA devices")
    return d


def check_compile(int4: bool, batch_invariant: bool | None, flag: str, four_bit: str, inexact: str) -> None:
    """The CLI's and the API's one rule for compiling: only the exact 4-bit step is compiled
    (engine/fast/aot.py), so `flag` needs `four_bit` and refuses `inexact`; else a ValueError."""
    if not int4 or batch_invariant is False:
        raise ValueError(f"{flag} compiles the exact 4-bit step: pass {four_bit} (and not {inexact})")


def on_exact_path(model: Llama, probe: Callable[[Llama], bool] = rows_round_alike) -> bool:
    """Whether every decoder on `model` prints its plain's tokens bit for bit: each row of a
    forward rounds as it would alone (invariant.row_attention, and matmuls that keep rows
    apart), as this machine's kernels agree (`probe`: invariant.rows_round_alike, or the doors'
    adapt.cost.probed, its answer kept per machine), and, compiled, no forward that decides
    tokens ran eager since the prompt's."""
    return model.layers[0].attention.attend is row_attention and probe(model) \
        and not getattr(compiled(model), "eager", 0)
