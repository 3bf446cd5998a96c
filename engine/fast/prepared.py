"""The 4-bit model kept on disk ready to run: packed codes, scales, the Q8 head, bf16
embeddings and norms in one safetensors file per checkpoint and machine, mapped, not copied.

    model = int4_model(checkpoint, notify)   # read back, or quantized from fp32 once and kept

Reading the fp32 checkpoint and quantizing it took ~1.7 s of a ~4 s one-token run on 2 cores;
reading the kept file takes ~0.1 s. It lies in ~/.cache/engine/ beside the compiled steps,
named by what it depends on (`key`): the checkpoint's files (name, size, modification time),
this code's VERSION, torch and its kernel dispatch (which chooses the Q8 head, packed.Q8_HEAD).
A kept file that does not read (cut short, another format), or whose key is not this run's
(copied from another machine or model), is one notice and quantized anew; never used.
"""
from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Callable

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from engine.fast.artifacts import cache_home, sweep, unwritable
from engine.fast.packed import Q8_HEAD, Int4Linear, Q8Linear, quantize_int4, swap_projections
from engine.llama import Llama
from engine.load.config import load_config
from engine.load.weights import load_model

VERSION = "prepared 2"   # of the file's layout and of quantize_int4's rules: a change is a new file


def key(checkpoint: Path) -> str:
    """What the prepared weights depend on: the checkpoint's files as they are now, this code,
    torch, and the dispatch (an AVX512 one packs the head in 8 bits, another leaves it bf16)."""
    files = sorted(p for p in Path(checkpoint).iterdir() if p.is_file() and not p.name.startswith("."))
    stamp = [(p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in files]
    return f"{VERSION}|{torch.__version__}|{torch.backends.cpu.get_cpu_capability()}|{Q8_HEAD}|{stamp}"


def int4_model(checkpoint, notify: Callable[[str], None], folder: Path | None = None,
               head_bits: int = 8) -> Llama:
    """The checkpoint as packed.quantize_int4 makes it (CPU; head_bits as there), read from its
    kept file when there is a good one, else quantized and kept for the next run."""
    checkpoint = Path(checkpoint)
    load_config(checkpoint)          # a missing or malformed checkpoint: its own error, first
    k = key(checkpoint) + ("|head 4 bits" if head_bits == 4 else "")
    folder = cache_home() / "engine" if folder is None else folder
    path = folder / f"int4-{hashlib.sha256(f'{checkpoint.resolve()}|{k}'.encode()).hexdigest()[:16]}.safetensors"
    if path.is_file():
        try:
            return read(path, checkpoint, k, head_bits)
        except ValueError as e:
            notify(f"{path} {e}: preparing the 4-bit weights anew")
            path.unlink(missing_ok=True)
    model = quantize_int4(load_model(checkpoint, "cpu", torch.float32), head_bits)
    save(model, path, k, notify)
    return model


def save(model: Llama, path: Path, k: str, notify: Callable[[str], None] = lambda m: None) -> None:
    """Write the model's tensors aside, then rename: a killed run leaves no half file (and the
    next run's sweep takes its temporary), and two runs at once both leave a whole one. Where
    the cache cannot be written (permission, read-only, full), one notice: the run is right
    without the file, the next one prepares the weights again."""
    if unwritable(path.parent):   # the front doors said so, once
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        sweep(path.parent)
        tmp = path.with_name(f".{path.stem}.{os.getpid()}.safetensors")
        state = {name: t.contiguous() for name, t in model.state_dict().items()}
        try:
            save_file(state, str(tmp), metadata={"engine_key": k})
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)
    except (OSError, SafetensorError) as e:   # subtle: safetensors reports EACCES as its own error
        why = getattr(e, "strerror", None) or str(e).splitlines()[0][:120]
        notify(f"cannot keep the prepared 4-bit weights in {path.parent} ({why}): this run goes on without "
               "them, the next prepares them again (set XDG_CACHE_HOME to a writable folder)")


def read(path: Path, checkpoint: Path, k: str, head_bits: int = 8) -> Llama:
    """The model from a kept file, if it was written under key `k`; else ValueError."""
    try:
        with safe_open(str(path), "pt") as f:
            if (f.metadata() or {}).get("engine_key") != k:
                raise ValueError("was prepared for another checkpoint or machine")
            # subtle: the tensors view the file's map: the weights are paged in as a step reads them
            state = {name: f.get_tensor(name) for name in f.keys()}
    except (SafetensorError, OSError) as e:
        raise ValueError(f"does not read ({str(e).splitlines()[0][:120]})") from None
    model = skeleton(checkpoint, None if "packed_head.packed" not in state else head_bits)
    try:
        model.load_state_dict(state, strict=True, assign=True)
    except RuntimeError as e:   # missing, unexpected or misshapen tensors
        raise ValueError(f"does not fit the model ({str(e).splitlines()[0][:120]})") from None
    return model.eval().requires_grad_(False)


def skeleton(checkpoint: Path, head_bits: int | None) -> Llama:
    """quantize_int4's model with nothing in it: every tensor on the meta device, to be assigned;
    head_bits: its packed head's (None: a bf16 head, left to prepack)."""
    config = load_config(checkpoint)
    with torch.device("meta"):
        model = Llama(config)
        swap_projections(model, lambda w, b: Int4Linear.empty(*w.shape, bias=b is not None))
        if head_bits is not None:
            empty = Int4Linear.empty if head_bits == 4 else Q8Linear.empty
            model.packed_head = empty(config.vocab_size, config.dim)
            if not config.tie_embeddings:
                del model.output
    return model
