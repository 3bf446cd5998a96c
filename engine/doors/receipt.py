"""A parity receipt: after a run, the same prompt through that path's plain decoder, and where
the two part (`--receipt`). On an exact path it reads "identical"; where it does not (CUDA's
bf16, default fp32 at a near-tie, a kernel that rounds rows apart), it names the first token
where they part and plain's top-2 logit gap there: how near a tie the split was.

    receipt(model, prompt, got, plain(model, prompt, ...)) -> {"identical": True, "tokens": n}
"""
from __future__ import annotations

import torch

from typing import Iterable

from engine.decoders import DECODERS
from engine.generate import Step, generate, plain
from engine.llama import Llama
from engine.sampling import Random, Sampler


def reference(decoder: str, model: Llama, second: tuple, prompt: list[int], knobs: dict, sampler: Sampler,
              seed: int, max_new_tokens: int) -> Iterable[Step]:
    """The steps a run of `decoder` is held to, on its model, prompt, sampler and seed, for both
    front doors: its own one-row loop where the registry names one (contrastive without
    --speculative), else plain's."""
    own = DECODERS[decoder].own_loop
    if own is not None:
        return DECODERS[decoder].decode(model, *second, prompt, sampler=sampler, rng=Random(seed),
                                        max_new_tokens=max_new_tokens, **{**knobs, **own})
    return plain(model, prompt, sampler=sampler, rng=Random(seed), max_new_tokens=max_new_tokens)


def receipt(model: Llama, prompt: list[int], got: list[int], reference: Iterable[Step], eos_ids=()) -> dict:
    """The reference decoder's tokens (plain's, on the run's prompt, sampler and seed) against
    `got` (the run's, EOS included): {"identical"}, or the first new token where they part, both
    tokens there, and the top-2 logit gap of `model` there (one forward of the prompt and the
    tokens both agreed on: how near a tie the split was)."""
    want = list(generate(reference, max_new_tokens=len(got), eos_ids=eos_ids))
    i = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), None)
    if i is None and len(got) == len(want):
        return {"identical": True, "tokens": len(got)}
    i = min(len(got), len(want)) if i is None else i          # one ended (EOS) where the other did not
    ids = prompt + want[:i]
    device = model.tok_embeddings.weight.device
    logits = model(torch.tensor([ids], device=device), torch.arange(len(ids), device=device), keep=[-1])[0, -1]
    top = logits.float().topk(2).values.tolist()                                         # (2,)
    return {"identical": False, "index": i, "position": len(prompt) + i, "agreed": want[:i],
            "plain": want[i] if i < len(want) else None, "got": got[i] if i < len(got) else None,
            "gap": top[0] - top[1]}


def line(r: dict, show=str) -> str:
    """The receipt in one line for stderr; `show` spells a token."""
    if r["identical"]:
        return f"receipt: identical to plain on this path ({r['tokens']} tokens)"
    return (f"receipt: parts from plain at new token {r['index']} (position {r['position']}): plain "
            f"{show(r['plain'])}, this run {show(r['got'])}; plain's top-2 logit gap there {r['gap']:.3g}")
