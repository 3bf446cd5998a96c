"""Contrastive decoding's claim, measured: pass@1 on HumanEval, greedy plain against greedy
contrastive decoding, Qwen2.5-Coder-1.5B the expert and the 0.5B the amateur (`make pair`).

    python -m tools.humaneval [--problems 164] [--skip 0] [--max-new-tokens 384] [--out bench-out/humaneval]

O'Brien & Lewis (2023, arXiv 2309.09117) report that contrastive decoding (alpha 0.1, beta 0.5)
raises greedy pass@1 on HumanEval. Each problem's prompt goes to the instruct model in its chat
template (bench_pair.ASK); the program is the answer's first Python code block (with the
prompt's imports ahead of it), or the prompt and the answer where the block lacks the function;
the problem's tests then run on it in a sandbox. pass@1 of greedy decoding is the share of
problems whose one program passes.

Greedy plain runs as speculative decoding with the 0.5B drafting, greedy contrastive as its
speculative form (the amateur drafts, --speculative): both print exactly the tokens of their
one-row loops (tests/test_proofs.py and the exact sweeps), sooner.

The sandbox: a child `python -I` in a scratch folder of its own, an empty environment, stdin
closed, a wall-clock limit, a CPU-time limit and an address-space cap; where `unshare` can make a
network namespace (root on Linux), none but loopback. Generated code is untrusted: run this on a
machine you do not mind it touching. Progress on stderr; results in humaneval.md and .json (each
answer's text beside its verdict), written again after each problem (a run cut short keeps the
problems it finished). --skip N starts after the first N, so the 164 can go in pieces.
"""
from __future__ import annotations

import json
import os
import re
import resource
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from engine.decoders import DECODERS
from engine.doors.session import compile_second
from engine.fast.paths import build
from engine.load.weights import second_checkpoint
from engine.fast.aot import compile_step
from engine.generate import generate
from engine.load.tokenizer import Tokenizer
from engine.sampling import Random, Sampler
from tools.bench_pair import ASK, human_eval
from tools.cli import Parser, at_most, first, out_dir, write_atomic
from tools.machine import describe, machine
from tools.pair import DRAFT, TARGET

SECONDS, MEMORY = 10, 2 << 30            # per program: wall clock (and CPU time), address space
BLOCK = re.compile(r"```(?:python|py)?\n(.*?)```", re.S)


def program(problem: dict, answer: str) -> str:
    """The program to test: the answer's first code block, after the prompt's imports, where
    that block defines the entry point; else the prompt with the answer (or its block) as the body."""
    found = BLOCK.search(answer)
    code = found[1] if found else answer
    imports = "".join(line + "\n" for line in problem["prompt"].splitlines()
                      if line.startswith(("import ", "from ")))
    if re.search(rf"^def {re.escape(problem['entry_point'])}\s*\(", code, re.M):
        return imports + code
    return problem["prompt"] + code


def limits() -> None:   # in the child, before exec
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY, MEMORY))
    resource.setrlimit(resource.RLIMIT_CPU, (SECONDS, SECONDS))
    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))
    os.setsid()


def passes(problem: dict, code: str) -> tuple[bool, str]:
    """(passed, why not) for `code` against the problem's tests, run sandboxed."""
    test = f"{code}\n\n{problem['test']}\n\ncheck({problem['entry_point']})\n"
    with tempfile.TemporaryDirectory(prefix="humaneval-") as scratch:
        (Path(scratch) / "program.py").write_text(test)
        cmd = [sys.executable, "-I", "program.py"]
        if shutil.which("unshare") and os.geteuid() == 0:
            cmd = ["unshare", "--net", "--"] + cmd       # no network but loopback
        try:
            r = subprocess.run(cmd, cwd=scratch, env={}, stdin=subprocess.DEVNULL, capture_output=True,
                               timeout=SECONDS, preexec_fn=limits)
        except subprocess.TimeoutExpired:
            return False, f"no answer within {SECONDS} s"
    err = r.stderr.decode(errors="replace").strip().splitlines()
    return r.returncode == 0, "" if r.returncode == 0 else (err[-1][:160] if err else f"exit {r.returncode}")


def main(argv: list[str] | None = None) -> int:
    p = Parser(prog="python -m tools.humaneval", description=first(__doc__))
    p.add_argument("--problems", type=int, default=164, help="HumanEval problems, from the first after --skip")
    p.add_argument("--skip", type=int, default=0, help="start after this many problems")
    p.add_argument("--max-new-tokens", type=int, default=384)
    p.add_argument("--alpha", type=float, default=0.1)
    p.add_argument("--beta", type=float, default=0.5)
    p.add_argument("--out", type=Path, default=Path("bench-out/humaneval"))
    args = p.parse_args(argv)
    at_most(p, args, {"problems": 164, "max_new_tokens": 2048})
    if args.problems < 1 or args.max_new_tokens < 1:
        p.error("--problems and --max-new-tokens must be >= 1")
    if not 0 <= args.skip <= 163:
        p.error(f"--skip must be in [0, 163], got {args.skip}")
    try:
        out = out_dir(args.out)
        problems = human_eval(args.skip + args.problems)[args.skip:]
        for ckpt in (TARGET, DRAFT):
            if not (ckpt / "config.json").is_file():
                raise ValueError(f"{ckpt}: no checkpoint there (make pair)")
        tok = Tokenizer.load(TARGET)
        model = compile_step(build(TARGET, dtype=torch.bfloat16, int4=True), lambda m: print(m, file=sys.stderr))
        draft = second_checkpoint(TARGET, DRAFT, lambda c: build(c, dtype=torch.bfloat16, int4=True, draft=True))
        amateur = second_checkpoint(TARGET, DRAFT, lambda c: build(c, dtype=torch.bfloat16, int4=True))
        for m in (draft, amateur):
            compile_second(model, m, lambda line: print(line, file=sys.stderr))
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    runs = {"plain": ("speculative", draft, {"num_draft": 3}),
            "contrastive": ("contrastive", amateur, {"alpha": args.alpha, "beta": args.beta,
                                                     "speculative": True, "num_draft": 3})}
    rows, t0 = [], time.perf_counter()
    for i, prob in enumerate(problems):
        prompt = tok.encode_chat([{"role": "user", "content": ASK.format(prob["prompt"])}])
        row = {"task_id": prob["task_id"]}
        for name, (decoder, second, knobs) in runs.items():
            steps = DECODERS[decoder].decode(model, second, prompt, sampler=Sampler(), rng=Random(0),
                                             max_new_tokens=args.max_new_tokens, **knobs)
            ids = [x for x in generate(steps, max_new_tokens=args.max_new_tokens, eos_ids=tok.eos_ids)
                   if x not in tok.eos_ids]
            answer = tok.decode(ids)
            ok, why = passes(prob, program(prob, answer))
            row[name] = {"passed": ok, "why": why, "tokens": len(ids), "answer": answer}   # kept, to audit a verdict
        rows.append(row)
        score = {n: sum(r[n]["passed"] for r in rows) for n in runs}
        print(f"[{i + 1}/{len(problems)}] {prob['task_id']}: plain {'pass' if row['plain']['passed'] else 'fail'}, "
              f"contrastive {'pass' if row['contrastive']['passed'] else 'fail'} | so far plain {score['plain']}, "
              f"contrastive {score['contrastive']} ({time.perf_counter() - t0:.0f} s)", file=sys.stderr, flush=True)
        text = report(rows, args, argv, out)
    print(text, end="")
    return 0


def report(rows: list[dict], args, argv, out: Path) -> str:
    """humaneval.json and humaneval.md for the problems done so far; the markdown's text."""
    runs = list(rows[0])[1:]
    result = {"machine": machine(), "command": "python -m tools.humaneval " + shlex.join(sys.argv[1:] if argv is None else argv),
              "problems": len(rows), "skip": args.skip, "alpha": args.alpha, "beta": args.beta,
              "max_new_tokens": args.max_new_tokens,
              "pass@1": {n: sum(r[n]["passed"] for r in rows) / len(rows) for n in runs}, "rows": rows}
    text = (f"HumanEval pass@1, greedy, Qwen2.5-Coder-1.5B-Instruct (4-bit path, compiled), {len(rows)} problems "
            f"({rows[0]['task_id']} to {rows[-1]['task_id']} of 164), up to {args.max_new_tokens} new tokens. "
            f"Machine: {describe(result['machine'])}.\n\n"
            "| decoding | passed | pass@1 |\n|---|---|---|\n"
            + "".join(f"| {n}{' (amateur: the 0.5B, alpha %g, beta %g)' % (args.alpha, args.beta) if n == 'contrastive' else ''} "
                      f"| {sum(r[n]['passed'] for r in rows)} | {result['pass@1'][n]:.3f} |\n" for n in runs)
            + "\nOnly one passed: " + ", ".join(f"{r['task_id']} ({'plain' if r['plain']['passed'] else 'contrastive'})"
                                              for r in rows if r["plain"]["passed"] != r["contrastive"]["passed"]) + "\n")
    write_atomic(out / "humaneval.json", (json.dumps(result, indent=1) + "\n").encode())
    write_atomic(out / "humaneval.md", text.encode())
    return text


if __name__ == "__main__":
    sys.exit(main())
