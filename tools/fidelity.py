"""How far an inexact mode is from fp32: python -m tools.fidelity [--tokens 64] [--out bench-out]

fp32 is the engine's reference (near-exact, exact with --batch-invariant); `--int4` (4-bit layers, bf16 activations) and bf16 trade
exactness for speed, and their rounding differs from one CPU to the next, so no test may pin
their text. This report measures them instead, teacher-forced on a fixed corpus: each shipped
bench prompt (bench/prompts.json, chat-templated) followed by fp32's own greedy continuation.
One forward of each whole sequence per mode; at every continuation position t, with y_t the
fp32 token there and p, m the fp32 and mode laws (temperature 1):

    agreement     argmax m_t == argmax p_t                  share of positions (top-1)
    KL            sum_x p_t(x) log(p_t(x) / m_t(x))         nats, mean over positions
    perplexity    exp(mean_t -log m_t(y_t))                 beside fp32's own, exp(mean -log p_t(y_t))

Writes fidelity.md and fidelity.json (with the machine) under --out; tests/test_fidelity.py
holds the thresholds every CPU must meet.
"""
from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import torch

from engine.decoders import DECODERS
from engine.fast.packed import prepack, quantize_int4
from engine.generate import generate
from engine.llama import Llama
from engine.sampling import Random, Sampler
from tools.cli import Parser, first, out_dir, write_atomic
from tools.machine import describe, machine

PROMPTS = Path(__file__).resolve().parent.parent / "bench" / "prompts.json"


def corpus(model: Llama, prompts: list[list[int]], tokens: int) -> list[tuple[list[int], list[int]]]:
    """(prompt, fp32 greedy continuation) pairs; the continuation runs to EOS-free `tokens`."""
    out = []
    for prompt in prompts:
        steps = DECODERS["plain"].decode(model, prompt, sampler=Sampler(), rng=Random(0), max_new_tokens=tokens)
        out.append((prompt, list(generate(steps, max_new_tokens=tokens))))
    return out


@torch.inference_mode()
def log_probs(model: Llama, prompt: list[int], continuation: list[int]) -> torch.Tensor:
    """(len(continuation), V) float64 log-laws of each continuation token, teacher-forced."""
    seq = torch.tensor([prompt + continuation[:-1]])                      # (1, T)
    logits = model(seq, torch.arange(seq.shape[1]))[0, len(prompt) - 1:]  # (len(cont), V)
    return torch.log_softmax(logits.double(), -1)


def fidelity(reference: Llama, mode: Llama, pairs: list[tuple[list[int], list[int]]]) -> dict:
    agree = kl = nll_ref = nll_mode = n = 0.0
    for prompt, cont in pairs:
        lp, lm = log_probs(reference, prompt, cont), log_probs(mode, prompt, cont)   # (t, V) each
        y = torch.tensor(cont)
        agree += (lp.argmax(-1) == lm.argmax(-1)).sum().item()
        kl += (lp.exp() * (lp - lm)).sum(-1).clamp(min=0).sum().item()
        nll_ref -= lp[torch.arange(len(y)), y].sum().item()
        nll_mode -= lm[torch.arange(len(y)), y].sum().item()
        n += len(cont)
    return {"positions": int(n), "agreement": agree / n, "kl": kl / n,
            "perplexity": math.exp(nll_mode / n), "fp32_perplexity": math.exp(nll_ref / n)}


def modes(checkpoint: Path) -> dict[str, Llama]:
    """The inexact modes the CLI offers, as it builds them: --int4 (4-bit layers, bf16) and bf16,
    each with its default exact kernels, and --int4 without them (--no-batch-invariant)."""
    from engine.load.weights import load_model
    return {"int4 (4-bit layers, bf16)": prepack(quantize_int4(load_model(checkpoint)), batch_invariant=True),
            "int4 --no-batch-invariant": prepack(quantize_int4(load_model(checkpoint))),
            "bf16": prepack(load_model(checkpoint, dtype=torch.bfloat16), batch_invariant=True)}


def prompts(checkpoint: Path) -> list[list[int]]:
    from engine.load.tokenizer import Tokenizer
    tok = Tokenizer.load(checkpoint)
    texts = [t for ts in json.loads(PROMPTS.read_text()).values() for t in ts]
    return [tok.encode(tok.render_chat([{"role": "user", "content": t}])) for t in texts]


def markdown(result: dict) -> str:
    rows = ["| mode | top-1 agreement | mean KL (nats) | perplexity | fp32 perplexity |",
            "|---|---|---|---|---|"]
    for name, r in result["modes"].items():
        rows.append(f"| {name} | {r['agreement']:.3f} | {r['kl']:.4f} | {r['perplexity']:.3f} | "
                    f"{r['fp32_perplexity']:.3f} |")
    return (f"Machine: {describe(result['machine'])}\n\n{result['positions']} teacher-forced positions "
            f"({result['prompts']} prompts x {result['tokens']} fp32 greedy tokens)\n\n" + "\n".join(rows) + "\n")


def main(argv: list[str] | None = None) -> int:
    from engine.load.weights import DEFAULT_CHECKPOINT, load_model
    p = Parser(prog="python -m tools.fidelity", description=first(__doc__))
    p.add_argument("--checkpoint", type=Path, default=DEFAULT_CHECKPOINT)
    p.add_argument("--tokens", type=int, default=64, help="fp32 continuation per prompt")
    p.add_argument("--out", type=Path, default=Path("bench-out"))
    args = p.parse_args(argv)
    if not 1 <= args.tokens <= 1024:
        p.error("--tokens must be in [1, 1024]")
    try:
        reference = prepack(load_model(args.checkpoint))
        out = out_dir(args.out)
        pairs = corpus(reference, prompts(args.checkpoint), args.tokens)
        result = {"machine": machine(), "command": "python -m tools.fidelity " + " ".join(argv or sys.argv[1:]),
                  "prompts": len(pairs), "tokens": args.tokens, "positions": sum(len(c) for _, c in pairs),
                  "modes": {name: fidelity(reference, m, pairs) for name, m in modes(args.checkpoint).items()}}
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    table = markdown(result)
    write_atomic(out / "fidelity.md", table.encode())
    write_atomic(out / "fidelity.json", json.dumps(result, indent=1).encode())
    print(table + f"written: {out}/fidelity.md, fidelity.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
