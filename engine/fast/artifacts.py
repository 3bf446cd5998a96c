"""What this machine keeps on disk for the fast paths, and under which key.

    cache_home() / "engine"     where: ~/.cache/engine, or $XDG_CACHE_HOME/engine
    model_key(model)            what a kept price, probe or compiled step depends on: the CPU,
                                torch, its kernel dispatch, dtypes, kernels and model shape

A reader learning the algorithms can skip this folder (engine/fast/).
"""
from __future__ import annotations

import contextlib
import functools
import os
import platform
from pathlib import Path

import torch

from engine.fast.machine import attention_dtype
from engine.llama import Llama

# variables that choose kernels or threads: torch's dispatch, OpenMP's threads, and oneDNN's
# (under either of its prefixes) and MKL's (tools/machine.py reports them with every figure)
KERNEL_ENV = ("ATEN_CPU_CAPABILITY", "OMP_NUM_THREADS")
KERNEL_ENV_PREFIXES = ("ONEDNN_", "DNNL_", "MKL_", "TORCH_MKLDNN")


def kernel_env() -> dict[str, str]:
    """The variables set here that choose kernels or threads (KERNEL_ENV and its prefixes)."""
    return {k: v for k, v in sorted(os.environ.items()) if k in KERNEL_ENV or k.startswith(KERNEL_ENV_PREFIXES)}


def model_key(model: Llama) -> str:
    """What a measured price depends on: the machine, torch, dtype, kernels, K/V dtype and model
    shape (and a compiled stack, engine/fast/aot.py, where there is one)."""
    w, layer = model.tok_embeddings.weight, model.layers[0]
    version = getattr(model.blocks, "version", None)   # a compiled stack's (fast.aot.Compiled), else none
    compiled = f"|compiled {version}" if version else ""
    return "|".join(map(str, (cpu_name(), torch.backends.cpu.get_cpu_capability(), torch.get_num_threads(),
                              torch.__version__, device_name(w.device), w.dtype, attention_dtype(w.dtype, w.device),
                              type(layer.feed_forward.w13).__name__, type(model.packed_head).__name__,
                              layer.attention.attend.__name__,
                              model.config))) + compiled


def device_name(device: torch.device) -> str:
    """The device as a price depends on it: a GPU by its name too, so one host's tables for two
    GPUs are kept apart (a CPU's name and ISA are in the key already)."""
    return f"{device} {torch.cuda.get_device_name(device)}" if device.type == "cuda" else str(device)


def cache_home() -> Path:
    """$XDG_CACHE_HOME if it is an absolute path, else ~/.cache. The XDG spec says to ignore a
    relative one: it would leave a cache in whatever directory the command ran from."""
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    return Path(xdg) if os.path.isabs(xdg) else Path.home() / ".cache"


def cpu_name() -> str:
    return cpuinfo("model name") or platform.processor() or platform.machine()


@functools.lru_cache(maxsize=None)   # fixed for the process; model_key asks on every price and probe
def cpuinfo(field: str) -> str:
    """A field of /proc/cpuinfo's first CPU ("model name", "flags"); '' where there is none."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.partition(":")[0].strip() == field:
                return line.partition(":")[2].strip()
    return ""


@functools.cache
def unwritable(folder: Path) -> str | None:
    """Why `folder` takes no new file (permission denied, a read-only file system, ...), or None:
    probed once per process by making one, so every keeper (prices, prepared weights, compiled
    steps) skips it alike and a front door says so in one note."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe = folder / f".probe.{os.getpid()}"
        probe.touch()
        probe.unlink()
        return None
    except OSError as e:
        return e.strerror or type(e).__name__


def sweep(folder: Path) -> list[Path]:
    """Remove the temporary files (`.NAME.PID`, `.NAME.PID.pt2`) that runs killed midway left in
    `folder`: those whose PID is no live process. What a live run is writing stays."""
    gone = []
    with contextlib.suppress(OSError):
        for f in folder.glob(".*"):
            pids = [int(p) for p in f.name.split(".") if p.isdigit()]
            if pids and f.is_file() and not alive(pids[-1]):
                with contextlib.suppress(OSError):
                    f.unlink()
                    gone.append(f)
    return gone


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:        # another user's process, say: it exists
        return True
    return True
