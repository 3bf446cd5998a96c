"""What a CUDA-graph-captured one-row step would buy on this GPU (a probe, not a feature).

A random SmolLM2-135M-shaped model (tools.bench.random_model); the cache holds S tokens; one
token is sent (no keep: T = 1), the cache length reset after each step, so every replay is the
same step. Eager: the engine's forward as plain runs it. Captured: the same call recorded once
with torch.cuda.graph and replayed. Prints ms a step and whether the logits are the same bits.
"""
import sys, time
import torch
sys.path.insert(0, ".")
from tools.bench import random_model
from engine.kvcache import KVCache

def timed(f, n=100):
    for _ in range(5):
        f()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        f()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / n * 1e3

for dtype in (torch.float32, torch.bfloat16):
    m = random_model(device="cuda", dtype=dtype)
    for S in (200, 1000):
        c = KVCache.for_model(m, S + 8)
        with torch.inference_mode():
            m(torch.zeros(1, S, dtype=torch.long, device="cuda"), torch.arange(S, device="cuda"), c)
            x, pos = torch.ones(1, 1, dtype=torch.long, device="cuda"), torch.tensor([S], device="cuda")
            def step():
                c.length = S
                return m(x, pos, c)
            eager = timed(step)
            ref = step().clone()
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                for _ in range(3):
                    step()
            torch.cuda.current_stream().wait_stream(s)
            g = torch.cuda.CUDAGraph()
            try:
                c.length = S
                with torch.cuda.graph(g):
                    out = m(x, pos, c)
            except Exception as e:
                print(f"{dtype} S={S}: eager {eager:.2f} ms; capture failed: {type(e).__name__}: {str(e)[:300]}")
                continue
            replay = timed(g.replay)
            g.replay(); torch.cuda.synchronize()
            print(f"{dtype} S={S}: eager {eager:.2f} ms a step, captured {replay:.3f} ms "
                  f"({eager / replay:.1f}x); same logits bits: {torch.equal(out, ref)}")
