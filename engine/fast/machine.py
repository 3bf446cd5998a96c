"""What this machine is, as the engine's choices read it: torch's CPU kernel dispatch, whether
bf16 attention has native kernels here, the memory still free, and what a model holds in memory
(oneDNN's packed layouts included). The one module of the engine that reads CPU flags, /proc or
oneDNN layouts; it imports nothing of the engine, so the core may ask it (kvcache.py, llama.py).
"""
from __future__ import annotations

import os

import torch


# subtle: read once, at import, as torch reads ATEN_CPU_CAPABILITY once
ATEN_CAPABILITY = torch.backends.cpu.get_cpu_capability()
# bf16 attention only where ATen's bf16 kernels are AVX-512's and the CPU has AMX tiles
BF16_ATTENTION = ATEN_CAPABILITY == "AVX512" and getattr(torch.cpu, "_is_amx_tile_supported", bool)()


def attention_dtype(dtype: torch.dtype, device) -> torch.dtype:
    """The dtype a model's K/V are kept and attended in: its own, but fp32 for bf16 on a CPU
    without AMX or not under the AVX512 dispatch. There SDPA's bf16 one-row kernel is slow:
    3.7x fp32's time at 150 keys and 6.7x at 1,000 under AVX2 (docs/archive/speed-log.md), 4.5x
    at 100 and 8.6x at 1,000 on an AVX-512 EPYC with avx512_bf16 but no AMX; on an
    AMX Xeon bf16 is the faster. fp32 K/V cost twice the memory and three small casts a layer."""
    if dtype != torch.bfloat16 or BF16_ATTENTION:                # the hot path: one test a layer
        return dtype
    return torch.float32 if torch.device(device if device is not None else "cpu").type == "cpu" else dtype


def available_bytes(device) -> int | None:
    """Memory a new allocation on `device` can still get; None when the platform cannot say.

    CPU: MemAvailable from /proc/meminfo (what Linux can hand out without swapping), else
    free pages from sysconf. CUDA: the driver's free bytes. Used to refuse a request before
    allocating it, never as a promise that smaller ones fit.
    """
    device = torch.device(device if device is not None else "cpu")
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    if device.type != "cpu":
        return None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def check_memory(nbytes: int, what: str, device) -> None:
    """ValueError naming `what` when `nbytes` exceed the memory `device` has free."""
    free = available_bytes(device)
    if free is not None and nbytes > free:
        raise ValueError(f"{what} needs {nbytes / 2**30:.3g} GiB, more than the "
                         f"{free / 2**30:.3g} GiB free on {torch.device(device or 'cpu')}")


def resident_bytes(model: torch.nn.Module) -> int:
    """Bytes a model holds: its parameters and buffers, and oneDNN's packed copies (opaque
    tensors, sized here as the dense weights they hold)."""
    tensors = [*model.parameters(), *model.buffers()]
    packed = [m for m in model.modules() if hasattr(m, "packed") and not isinstance(m.packed, torch.nn.Parameter)
              and m.packed.layout == torch._mkldnn]
    return sum(t.numel() * t.element_size() for t in tensors) \
        + sum(m.out_features * m.in_features * m.packed.element_size() for m in packed)
