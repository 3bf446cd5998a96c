"""The quality report: python -m tools.quality [--max-new-tokens 96] [--out bench-out]

Does contrastive decoding (Li et al. 2022, arXiv 2210.15097) do what its paper says on our
model: less repetition than greedy, lower expert perplexity than nucleus sampling? Each
decoder config answers a fixed set of chat-templated prompts (chat, story, code) on the real
checkpoint, and each output is scored by
    distinct-n    |unique n-grams| / |n-grams|                      (n = 2, 3; higher = more varied)
    repeat-4      share of 4-grams already seen earlier in the output (lower = less looping)
    entropy-2     Shannon entropy of the bigram distribution, bits   (higher = more varied)
    perplexity    exp(mean NLL of the output under the full expert at temperature 1 | prompt)
Metrics count the generated tokens without the final EOS; perplexity scores the EOS too,
since stopping is a choice the decoder made. Averages are plain means over outputs.
Writes quality.md (also to stdout), quality.json and quality.png under --out.
"""
from __future__ import annotations

import argparse
import io
import json
import math
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import torch

from engine.decoders import DECODERS
from engine.draft import EarlyExit
from engine.generate import generate
from engine.llama import Llama
from tools.cli import Parser, first, at_most, out_dir, write_atomic
from tools.machine import describe, machine
from engine.sampling import Random, Sampler

# short on purpose: the 135M model's answers wander off or stop early on long asks
PROMPTS = {
    "chat": ["What are some good ways to relax after a long day at work?",
             "Explain why the sky is blue to a ten year old.",
             "What should I pack for a weekend camping trip?"],
    "story": ["Write a short story about a lighthouse keeper who finds a message in a bottle.",
              "Tell me a story about a dragon who is afraid of the dark.",
              "Write a short story that begins: The train was already an hour late when"],
    "code": ["Write a Python function that checks whether a number is prime.",
             "Write a Python function that returns the n-th Fibonacci number.",
             "Write a Python class for a stack with push, pop and peek methods."],
}


@dataclass(frozen=True)
class Config:
    name: str
    sampler: Sampler
    amateur: int | None = None                 # None = plain; L = early-exit contrastive amateur
    knobs: dict = field(default_factory=dict)  # alpha, beta, form for contrastive.decode
    sampled: bool = False                      # run once per seed, not once


def configs() -> list[Config]:
    cd = [Config(f"CD L={L} a=0.1 b={b}", Sampler(), L, dict(alpha=0.1, beta=b, form="logit"))
          for L in (8, 16, 24) for b in (0.5, 1.0)]
    return [Config("greedy", Sampler()),
            Config("nucleus p=0.95 T=1", Sampler(temperature=1.0, top_p=0.95), sampled=True),
            *cd,
            Config("CD ratio L=8 a=0.1", Sampler(), 8, dict(alpha=0.1, form="ratio"))]


# --------------------------------------------------------------------------- metrics

def ngrams(tokens: list[int], n: int) -> list[tuple[int, ...]]:
    return [tuple(tokens[i:i + n]) for i in range(len(tokens) - n + 1)]


def distinct_n(tokens: list[int], n: int) -> float:
    """|unique n-grams| / |n-grams|; 0 when the output is shorter than n."""
    grams = ngrams(tokens, n)
    return len(set(grams)) / len(grams) if grams else 0.0


def repeat_rate(tokens: list[int], n: int = 4) -> float:
    """Share of the n-grams (by start position) that occurred at an earlier start; 0 if none."""
    grams, seen, repeats = ngrams(tokens, n), set(), 0
    for g in grams:
        repeats += g in seen
        seen.add(g)
    return repeats / len(grams) if grams else 0.0


def ngram_entropy(tokens: list[int], n: int = 2) -> float:
    """H = -sum_g c_g/N log2(c_g/N) over the n-gram counts c_g, N = sum c_g; in bits."""
    counts = Counter(ngrams(tokens, n))
    N = sum(counts.values())
    return -sum(c / N * math.log2(c / N) for c in counts.values()) if N else 0.0


@torch.inference_mode()
def perplexity(model: Llama, prompt: list[int], output: list[int]) -> float:
    """exp(-1/n sum_i log p(output_i | prompt, output_<i)), temperature 1, one forward."""
    if not prompt or not output:
        raise ValueError("perplexity needs a non-empty prompt and output")
    device = model.tok_embeddings.weight.device
    tokens = torch.tensor([prompt + output], device=device)                 # (1, T)
    # row t predicts token t+1: rows len(prompt)-1 .. T-2 predict the output
    rows = torch.arange(len(prompt) - 1, tokens.shape[1] - 1, device=device)
    logits = model(tokens, torch.arange(tokens.shape[1], device=device), keep=rows)[0]  # (n, V)
    logp = logits.double().log_softmax(-1)                                  # (n, V)
    nll = -logp.gather(-1, tokens[0, len(prompt):, None]).mean()
    return math.exp(nll.item())


def score(model: Llama, prompt: list[int], output: list[int], eos_ids) -> dict:
    text = output[:-1] if output and output[-1] in eos_ids else output
    return {"n_tokens": len(output), "distinct_2": distinct_n(text, 2),
            "distinct_3": distinct_n(text, 3), "repeat_4": repeat_rate(text, 4),
            "entropy_2": ngram_entropy(text, 2), "perplexity": perplexity(model, prompt, output)}


METRICS = ["distinct_2", "distinct_3", "repeat_4", "entropy_2", "perplexity", "n_tokens"]


# --------------------------------------------------------------------------- running

def decode_one(model: Llama, cfg: Config, prompt: list[int], seed: int, max_new_tokens: int,
               eos_ids) -> list[int]:
    common = dict(sampler=cfg.sampler, rng=Random(seed), max_new_tokens=max_new_tokens)
    if cfg.amateur is None:
        steps = DECODERS["plain"].decode(model, prompt, **common)
    else:
        steps = DECODERS["contrastive"].decode(model, EarlyExit(cfg.amateur), prompt, **common, **cfg.knobs)
    return list(generate(steps, max_new_tokens=max_new_tokens, eos_ids=eos_ids))


def jobs(cfgs: list[Config], prompts: dict[str, list[list[int]]], seeds: list[int]):
    for cfg in cfgs:
        for category, ps in prompts.items():
            for i, prompt in enumerate(ps):
                for seed in (seeds if cfg.sampled else seeds[:1]):
                    yield cfg, category, i, prompt, seed


def evaluate(model: Llama, cfgs: list[Config], prompts: dict[str, list[list[int]]], *,
             seeds: list[int], max_new_tokens: int, eos_ids=(), progress=None) -> list[dict]:
    """One record per (config, prompt, seed): the output tokens and their metrics."""
    records = []
    for cfg, category, i, prompt, seed in jobs(cfgs, prompts, seeds):
        out = decode_one(model, cfg, prompt, seed, max_new_tokens, set(eos_ids))
        records.append({"config": cfg.name, "category": category, "prompt": i, "seed": seed,
                        "tokens": out, **score(model, prompt, out, set(eos_ids))})
        if progress is not None:
            progress.update(1)
    return records


def summarize(records: list[dict]) -> dict[str, dict[str, dict[str, float]]]:
    """config -> category (and "all") -> metric -> mean over its outputs."""
    groups: dict[tuple[str, str], list[dict]] = {}
    for r in records:
        for category in (r["category"], "all"):
            groups.setdefault((r["config"], category), []).append(r)
    out: dict[str, dict[str, dict[str, float]]] = {}
    for (cfg, category), rs in groups.items():
        out.setdefault(cfg, {})[category] = {m: sum(r[m] for r in rs) / len(rs) for m in METRICS}
        out[cfg][category]["n_outputs"] = len(rs)
    return out


def markdown(summary: dict, max_new_tokens: int) -> str:
    lines = [f"All prompts (9 prompts, nucleus over every seed; max {max_new_tokens} new tokens):",
             "",
             "| config | distinct-2 | distinct-3 | repeat-4 | entropy-2 (bits) | expert PPL | tokens |",
             "|---|---|---|---|---|---|---|"]
    for cfg, cats in summary.items():
        a = cats["all"]
        lines.append(f"| {cfg} | {a['distinct_2']:.3f} | {a['distinct_3']:.3f} | {a['repeat_4']:.3f}"
                     f" | {a['entropy_2']:.2f} | {a['perplexity']:.2f} | {a['n_tokens']:.1f} |")
    categories = [c for c in next(iter(summary.values())) if c != "all"]
    lines += ["", "Per category (repeat-4 / expert PPL / distinct-2):", "",
              "| config | " + " | ".join(categories) + " |",
              "|---|" + "---|" * len(categories)]
    for cfg, cats in summary.items():
        cells = [f"{cats[c]['repeat_4']:.3f} / {cats[c]['perplexity']:.2f} / {cats[c]['distinct_2']:.3f}"
                 for c in categories]
        lines.append(f"| {cfg} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------- output

def plot(summary: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 5))
    for cfg, cats in summary.items():
        x, y = cats["all"]["repeat_4"], cats["all"]["perplexity"]
        color = "tab:blue" if cfg.startswith("CD") else "tab:red"
        ax.scatter([x], [y], color=color)
        ax.annotate(cfg, (x, y), textcoords="offset points", xytext=(4, 4), fontsize=8)
    ax.set_xlabel("repeated 4-gram rate (lower = less looping)")
    ax.set_ylabel("expert perplexity of the output (lower = more expert-like)")
    ax.set_title("SmolLM2-135M-Instruct: decoders, mean over 9 prompts")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=120)
    plt.close(fig)
    write_atomic(path, buf.getvalue())


def parser() -> argparse.ArgumentParser:
    p = Parser(prog="python -m tools.quality", description=first(__doc__))
    p.add_argument("--max-new-tokens", type=int, default=96, help="token budget per output")
    p.add_argument("--out", default="bench-out", help="directory for quality.{md,json,png}")
    p.add_argument("--seeds", type=int, default=3, help="seeds per prompt for nucleus sampling")
    p.add_argument("--checkpoint", help="HF-format checkpoint dir (default: SmolLM2-135M-Instruct)")
    return p


def main(argv: list[str] | None = None) -> int:
    p = parser()
    args = p.parse_args(argv)
    at_most(p, args, {"seeds": 1000})   # each seed is a full pass over the sampled configs
    from tqdm import tqdm
    from engine.load.tokenizer import Tokenizer
    from engine.load.config import load_config
    from engine.load.weights import default_checkpoint, load_model
    try:
        if args.checkpoint == "":
            raise ValueError("--checkpoint '' names no checkpoint")
        ckpt = default_checkpoint() if args.checkpoint is None else args.checkpoint
        tok = Tokenizer.load(ckpt)            # first: it names a missing checkpoint directory
        context = load_config(ckpt).max_seq_len
        if not 1 <= args.max_new_tokens <= context:
            raise ValueError(f"--max-new-tokens must be in [1, {context}] (the model's context), "
                             f"got {args.max_new_tokens}")
        out = out_dir(Path(args.out))         # last: nothing is made before the checks pass
        model = load_model(ckpt)
    except (ValueError, OSError, KeyError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    torch.set_num_threads(1)  # a shared machine; the report measures text, not speed
    prompts = {c: [tok.encode(tok.render_chat([{"role": "user", "content": p}])) for p in ps]
               for c, ps in PROMPTS.items()}
    cfgs, seeds = configs(), list(range(args.seeds))
    with tqdm(total=sum(1 for _ in jobs(cfgs, prompts, seeds)), file=sys.stderr,
              desc="quality") as bar:
        records = evaluate(model, cfgs, prompts, seeds=seeds, max_new_tokens=args.max_new_tokens,
                           eos_ids=tok.eos_ids, progress=bar)
    for r in records:
        r["text"] = tok.decode([x for x in r["tokens"] if x not in tok.eos_ids])
    summary = summarize(records)
    where = machine()
    table = f"Machine: {describe(where)}\n\n" + markdown(summary, args.max_new_tokens)
    write_atomic(out / "quality.md", table.encode())
    write_atomic(out / "quality.json", json.dumps(
        {"machine": where, "max_new_tokens": args.max_new_tokens, "seeds": seeds, "prompts": PROMPTS,
         "summary": summary, "records": records}, indent=1).encode())
    plot(summary, out / "quality.png")
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
