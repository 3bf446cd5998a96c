"""HF transformers' assisted generation end to end, certified black-box (tools/prove.py).

Where tests/test_prove_hf.py feeds `_speculative_sampling` explicit p and q, this drives the
whole `generate(assistant_model=..., do_sample=True)` path, which also computes the candidate
and target logits and applies the logits processors to them: two tiny random HF Llamas
(vocabulary 4, target 3 layers, assistant 1 layer), two new tokens, 2 drafts per step. The target
law of the two tokens is computed from the target's own full forwards, softmax(logits / t).
One generate() per sample (batch 1 is all assisted generation takes), ~10 ms each.

    python -m tools.prove_hf --samples 20000 [--temperature 0.8] [--json]
"""
from __future__ import annotations

import json
import sys
import warnings
from dataclasses import asdict

import torch

from tools.cli import Parser, first
from tools.prove import certify_samples, table

V, PROMPT = 4, [1, 3, 0]


def tiny_hf_llama(seed: int, layers: int):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      bos_token_id=None, eos_token_id=None, pad_token_id=None)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():   # HF's init (std 0.02) gives a near-uniform law; sharpen the logits
        model.lm_head.weight.mul_(10)
    return model


def target_law(target, t: float) -> dict:
    law = {}
    with torch.no_grad():
        p0 = torch.softmax(target(torch.tensor([PROMPT])).logits[0, -1].double() / t, -1)
        for a in range(V):
            p1 = torch.softmax(target(torch.tensor([PROMPT + [a]])).logits[0, -1].double() / t, -1)
            for b in range(V):
                law[a, b] = float(p0[a] * p1[b])
    return law


def main(argv=None) -> int:
    ap = Parser(prog="python -m tools.prove_hf", description=first(__doc__, "\n\n"))
    ap.add_argument("--samples", type=int, default=20_000)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    if a.samples < 1 or not a.temperature > 0:
        print("error: need --samples >= 1 and --temperature > 0", file=sys.stderr)
        return 2
    try:
        from transformers import GenerationConfig, __version__
        from transformers.utils import logging
    except ImportError:
        print("error: transformers is not installed (pip install -r requirements-test.txt)", file=sys.stderr)
        return 2
    logging.set_verbosity_error()
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    target, assistant = tiny_hf_llama(5, 3), tiny_hf_llama(6, 1)
    gc = GenerationConfig(do_sample=True, temperature=a.temperature, top_k=0, top_p=1.0, max_new_tokens=2,
                          min_new_tokens=2, num_assistant_tokens=2, num_assistant_tokens_schedule="constant",
                          assistant_confidence_threshold=0.0, pad_token_id=0, eos_token_id=None)
    torch.manual_seed(a.seed)
    rows, prompt = [], torch.tensor([PROMPT])
    # subtle: without an explicit mask generate() infers one from pad_token_id, masking the
    # prompt's token 0, and then samples another law than target_law's (our first run failed so)
    mask = torch.ones_like(prompt)
    with torch.no_grad():
        for _ in range(a.samples):
            out = target.generate(prompt, attention_mask=mask, assistant_model=assistant, generation_config=gc)
            rows.append(out[0, len(PROMPT):].tolist())
    v = certify_samples(f"HF {__version__} generate(assistant_model=..., do_sample=True)", torch.tensor(rows),
                        target_law(target, a.temperature), V)
    print(json.dumps([asdict(v)], indent=1) if a.json else table([v]))
    return 0 if v.passed else 1


if __name__ == "__main__":
    sys.exit(main())
