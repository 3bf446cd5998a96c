"""The machine a figure was measured on: CPU model, the ISA flags that change kernels and
rounding, threads, torch and its kernel dispatch. Every JSON and table the tools write carries
it, because a speed (or an int4 answer) is true of one machine."""
from __future__ import annotations

import os

import torch

from engine.fast.artifacts import cpu_name, cpuinfo, kernel_env

FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_fp16", "avx512_vnni", "amx_tile", "amx_bf16")
# kernel_env(): a figure taken under `make test`'s second dispatch (or OMP_NUM_THREADS) must say
# so, or it reads as this CPU's own


def machine(device: str = "cpu") -> dict:
    flags = set(cpuinfo("flags").split())             # none where it is not Linux
    info = {"cpu": cpu_name(), "isa": [f for f in FLAGS if f in flags], "cores": os.cpu_count(),
            "threads": torch.get_num_threads(), "torch": torch.__version__,
            "dispatch": torch.backends.cpu.get_cpu_capability(),
            "onednn_bf16": bool(torch.backends.mkldnn.is_available()
                                and torch.ops.mkldnn._is_mkldnn_bf16_supported()),
            "device": device, "env": kernel_env()}
    if str(device).startswith("cuda") and torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(torch.device(device))
    return info


def describe(m: dict) -> str:
    """One line for a table's header."""
    gpu = f", {m['gpu']}" if "gpu" in m else ""
    env = "".join(f", {k}={v}" for k, v in m.get("env", {}).items())
    return (f"{m['cpu']} ({', '.join(m['isa']) or 'no AVX2'}; dispatch {m['dispatch']}), "
            f"{m['threads']} threads of {m['cores']} cores, torch {m['torch']}, {m['device']}{gpu}{env}")
