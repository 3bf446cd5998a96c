"""The pair against an outside oracle: the engine's fp32 plain decoding of each Qwen2.5-Coder
GGUF (converted by `make pair`) against HF transformers' greedy `generate` reading the same GGUF
itself (`gguf_file=`, so our converter is not part of the oracle), prompt by prompt.

    python -m tools.oracle [--problems 8] [--max-new-tokens 64] [--out bench-out/pair]

Prompts: the pair bench's (tools/bench_pair.py): HumanEval's first N problems and the bench's
chat prompts. Each model is loaded once by each side, one side at a time (the 1.5B is 7 GB in
fp32). A row is one model; a cell counts the prompts whose tokens agree to the last one, up to
EOS or the token budget. Out: oracle.md and oracle.json in --out, the machine named.
"""
from __future__ import annotations

import gc
import json
import sys
from pathlib import Path

import torch

from engine.generate import generate, plain
from engine.load.tokenizer import Tokenizer
from engine.load.weights import load_model
from engine.sampling import Random, Sampler
from tools.bench import progress
from tools.bench_pair import prompts
from tools.cli import Parser, at_most, first, one_line, out_dir, write_atomic
from tools.machine import describe, machine
from tools.pair import DRAFT, TARGET


def ours(checkpoint: Path, prompts_: list[list[int]], n: int, eos) -> list[list[int]]:
    model = load_model(checkpoint)                                        # fp32, the eager forward
    out = []
    for i, p in enumerate(prompts_):
        progress(f"engine fp32 plain, {checkpoint.name} [{i + 1}/{len(prompts_)}]")
        steps = plain(model, p, sampler=Sampler(), rng=Random(0), max_new_tokens=n)
        out.append(list(generate(steps, max_new_tokens=n, eos_ids=eos)))
    return out


def theirs(checkpoint: Path, prompts_: list[list[int]], n: int) -> tuple[str, list[list[int]]]:
    try:
        import transformers
    except ImportError:
        raise ValueError("HF transformers is not installed here (pip install -r requirements-test.txt)") from None
    gguf = checkpoint.parent / f"{checkpoint.name}.gguf"
    progress(f"HF transformers {transformers.__version__} reading {gguf}")
    hf = transformers.AutoModelForCausalLM.from_pretrained(checkpoint.parent, gguf_file=gguf.name, dtype=torch.float32)
    out = []
    with torch.no_grad():
        for i, p in enumerate(prompts_):
            progress(f"HF generate, {checkpoint.name} [{i + 1}/{len(prompts_)}]")
            # HF stops at the config's EOS ids, as `generate` above does at the tokenizer's
            out.append(hf.generate(torch.tensor([p]), max_new_tokens=n, do_sample=False)[0, len(p):].tolist())
    return transformers.__version__, out


def table(result: dict) -> str:
    lines = [f"fp32 plain against HF transformers {result['transformers']} greedy `generate` on the same GGUF, "
             f"{result['max_new_tokens']} new tokens at most; prompts: HumanEval's first {result['problems']} "
             f"problems and {result['chat_prompts']} chat prompts.", f"Machine: {describe(result['machine'])}.", "",
             "| model | prompts with identical tokens | tokens compared | first differing position |", "|---|---|---|---|"]
    for name, r in result["models"].items():
        where = ", ".join(f"prompt {i}: token {k}" for i, k in r["first_difference"].items()) or "-"
        lines.append(f"| {name} | {r['identical']} of {r['prompts']} | {r['tokens']} | {where} |")
    return "\n".join(lines) + "\n"


def parse_args(argv):
    p = Parser(prog="python -m tools.oracle", description=first(__doc__))
    p.add_argument("--problems", type=int, default=8, help="HumanEval problems (code prompts), from the first")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--models", type=Path, nargs="+", default=[DRAFT, TARGET], help="converted checkpoints, each beside its GGUF")
    p.add_argument("--out", type=Path, default=Path("bench-out/pair"))
    args = p.parse_args(argv)
    at_most(p, args, {"problems": 164, "max_new_tokens": 1024})
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)

    def work():
        for ckpt in args.models:
            if not (ckpt / "config.json").is_file() or not (ckpt.parent / f"{ckpt.name}.gguf").is_file():
                raise ValueError(f"{ckpt}: no checkpoint with its GGUF beside it there (make pair)")
        out = out_dir(args.out)
        tok = Tokenizer.load(args.models[0])
        by_cat = prompts(tok, args.problems)
        all_ = [p for ps in by_cat.values() for p in ps]
        result = {"machine": machine(), "max_new_tokens": args.max_new_tokens, "problems": args.problems,
                  "chat_prompts": len(by_cat["chat"]), "models": {}}
        for ckpt in args.models:
            mine = ours(ckpt, all_, args.max_new_tokens, Tokenizer.load(ckpt).eos_ids)
            gc.collect()                                                  # one fp32 model in memory at a time
            result["transformers"], hf = theirs(ckpt, all_, args.max_new_tokens)
            gc.collect()
            diff = {i: next((k for k, (a, b) in enumerate(zip(m, h)) if a != b), min(len(m), len(h)))
                    for i, (m, h) in enumerate(zip(mine, hf)) if m != h}
            result["models"][ckpt.name] = {"prompts": len(all_), "identical": len(all_) - len(diff),
                                           "tokens": sum(map(len, mine)), "first_difference": diff,
                                           "ours": mine, "hf": hf}
        write_atomic(out / "oracle.json", (json.dumps(result, indent=1) + "\n").encode())
        write_atomic(out / "oracle.md", table(result).encode())
        print(table(result), end="")
    return one_line(work)


if __name__ == "__main__":
    sys.exit(main())
