"""What a decode step costs under each of torch's attention kernels (SDPA backends), on a GPU.

    python -m tools.cuda_attention [--device cuda] [--steps 48] [--rounds 2] [--out DIR]

A random SmolLM2-135M-shaped model decodes greedily, the cache growing one key per step as in a
real run, once per backend set and dtype, in interleaved rounds. The engine's own set is
engine.llama.CUDA_ATTENTION; "all four" is what torch picks unaided. A kernel planned per shape
(cuDNN's) keeps its plans for the process, so every run here starts after a prompt of its own
length and meets key lengths no earlier run met, as a real run does. A fixed key length
(tools.bench --forward-cost) would hide such a kernel. Writes DIR/attention.json and
DIR/profile.txt (torch.profiler's top ops of a few bf16 steps under torch's own choice).
"""
from __future__ import annotations

import itertools
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.nn.attention import SDPBackend as B, sdpa_kernel

import engine.llama
from engine.kvcache import KVCache
from tools.bench import progress, random_model, sync
from tools.cli import Parser, write_atomic
from tools.machine import machine

ENGINE = engine.llama.CUDA_ATTENTION
SETS = {"all four (torch's choice)": [B.CUDNN_ATTENTION, B.FLASH_ATTENTION, B.EFFICIENT_ATTENTION, B.MATH],
        "engine (CUDA_ATTENTION)": ENGINE,
        "cudnn": [B.CUDNN_ATTENTION], "flash": [B.FLASH_ATTENTION], "efficient": [B.EFFICIENT_ATTENTION],
        "math": [B.MATH]}


def step_ms(model, kernels, steps: int, prompt: int = 100) -> float:
    """Median ms of one greedy one-row step, keys growing from prompt + 1 to prompt + steps,
    the steps under `kernels` (the prompt under the engine's own set)."""
    dev = model.tok_embeddings.weight.device
    cache = KVCache.for_model(model, prompt + steps + 1)
    tokens = torch.randint(0, model.config.vocab_size, (1, prompt), device=dev)   # (1, prompt)
    t = model(tokens, torch.arange(prompt, device=dev), cache)[:, -1].argmax(-1, keepdim=True)  # (1, 1)
    # subtle: the model reads the module's CUDA_ATTENTION at each forward; set it for the steps
    # alone and put the engine's back whatever happens, or the rest of the process runs on ours
    engine.llama.CUDA_ATTENTION, ms = kernels, []
    try:
        for i in range(steps):
            sync(dev)
            t0 = time.perf_counter()
            logits = model(t, torch.tensor([prompt + i], device=dev), cache)    # (1, 1, V)
            t = logits[:, -1].argmax(-1, keepdim=True)                          # (1, 1)
            t.item()                                                            # a decoder reads it
            ms.append((time.perf_counter() - t0) * 1e3)
    finally:
        engine.llama.CUDA_ATTENTION = ENGINE
    return statistics.median(ms)


def chosen(model, kernels) -> str:
    """The backend torch picks for a one-row step after 150 keys under `kernels`."""
    c, dev, dt = model.config, model.tok_embeddings.weight.device, model.tok_embeddings.weight.dtype
    q = torch.randn(1, c.n_heads, 1, c.head_dim, device=dev, dtype=dt)          # (B, H, 1, D)
    k = torch.randn(1, c.n_kv_heads, 150, c.head_dim, device=dev, dtype=dt)     # (B, Hkv, S, D)
    try:
        with sdpa_kernel(kernels):
            n = torch._fused_sdp_choice(q, k, k, attn_mask=None, dropout_p=0.0, is_causal=False, enable_gqa=True)
    except RuntimeError:
        return "none"
    return {int(b.value): b.name for b in (B.MATH, B.FLASH_ATTENTION, B.EFFICIENT_ATTENTION,
                                            B.CUDNN_ATTENTION)}.get(n, f"code {n}")


def profile(device: str, prompt: int, steps: int = 8) -> str:
    """torch.profiler's top ops of a few bf16 steps under torch's own choice of kernel."""
    model = random_model(device=device, dtype=torch.bfloat16)
    step_ms(model, SETS["all four (torch's choice)"], 4, prompt=32)            # warm-up, other lengths
    with torch.profiler.profile() as prof:
        step_ms(model, SETS["all four (torch's choice)"], steps, prompt)
    ops = prof.key_averages()
    return "\n\n".join(ops.table(sort_by=key, row_limit=15) for key in
                       ("self_cpu_time_total", "self_device_time_total"))


def main(argv=None) -> None:
    p = Parser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--steps", type=int, default=48)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--out", type=Path, default=Path("bench-out"))
    args = p.parse_args(argv)
    result = {"machine": machine(args.device), "command": " ".join(["python -m tools.cuda_attention", *sys.argv[1:]]),
              "steps": args.steps, "rounds": args.rounds, "ms_per_step": {}}
    prompts = itertools.count(100, args.steps + 1)       # each run's key lengths are new to the process
    for dtype in (torch.bfloat16, torch.float32):
        model = random_model(device=args.device, dtype=dtype)
        rows = {}
        for r in range(args.rounds):
            for name, kernels in SETS.items():
                if isinstance(rows.get(name), str):
                    continue
                progress(f"{dtype} round {r + 1}/{args.rounds}: {name}")
                try:
                    rows.setdefault(name, []).append(round(step_ms(model, kernels, args.steps, next(prompts)), 3))
                except RuntimeError as e:     # a backend that cannot take this dtype or shape
                    rows[name] = f"cannot run: {str(e).splitlines()[0][:120]}"
        for name, kernels in SETS.items():
            if isinstance(rows[name], list):
                rows[name] = {"ms": rows[name], "backend": chosen(model, kernels)}
            print(f"{str(dtype):15} {name:28} {rows[name]}", flush=True)
        result["ms_per_step"][str(dtype)] = rows
    args.out.mkdir(parents=True, exist_ok=True)
    write_atomic(args.out / "profile.txt", profile(args.device, next(prompts), 8).encode())
    write_atomic(args.out / "attention.json", json.dumps(result, indent=1).encode())
    print(f"written: {args.out}/attention.json")


if __name__ == "__main__":
    main()
