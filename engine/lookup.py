"""Prompt lookup decoding: guess that the text repeats itself, and let one forward check.

Saxena 2023, "Prompt Lookup Decoding" (github.com/apoorvumang/prompt-lookup-decoding); HF
transformers calls it `prompt_lookup_num_tokens`, llama.cpp `lookup`. Summaries, code edits
and chat answers copy whole stretches of their prompt, so the tokens that followed an earlier
occurrence of the last few tokens are a free draft: no draft model, no extra state.

This file is docs/adding-a-decoder.md's worked example: a `decode` generator yielding one Step
per target forward, one entry in engine/decoders.py whose knobs become the CLI's flags
(--lookup-ngram, --lookup-tokens), and tests/test_lookup.py. The drafts are checked with
`verify_match`, so the output is plain decoding's, greedy or sampled with the same seed.
A policy (engine/adapt/policy.py, CopyLength; the CLI's default) cuts each guess to the length that
pays for its rows, as lookahead's copy arm does, so a text that does not repeat decodes at
plain's pace.
But: a linear scan for the match (llama.cpp keeps an n-gram map), one guess per step.
"""
from __future__ import annotations

from typing import Iterator

import torch

from engine.generate import Step
from engine.kvcache import KVCache
from engine.llama import Llama
from engine.sampling import Random, Sampler, verify_match


def find(text: list[int], ngram: int, k: int) -> tuple[list[int], int, int]:
    """(guess, n, start): the k tokens after the latest earlier occurrence of text's last n
    tokens, n tried from `ngram` down to 1; ([], 0, -1) when nothing matches.

    Example: text=[5, 6, 7, 9, 5, 6], ngram=2, k=3 -> ([7, 9, 5], 2, 0).
    """
    last, best, at = len(text) - 1, 0, -1
    # subtle: a match of any n ends at an earlier copy of the last token, so one pass over those
    # (latest first, each grown backwards to at most `ngram`) finds the longest and latest
    ends = [j for j, t in enumerate(text[:-1]) if t == text[-1]] if ngram >= 1 else []
    for j in reversed(ends):
        n = 1
        while n < ngram and n <= j and text[j - n] == text[last - n]:
            n += 1
        if n > best:
            best, at = n, j + 1 - n
            if n == ngram:
                break
    return (text[at + best:at + best + k], best, at) if best else ([], 0, -1)


def check(config, second=None, lookup_ngram: int = 3, lookup_tokens: int = 8, **_) -> None:
    """decode()'s knobs, or a ValueError; the front doors call it before any weight is loaded."""
    if not all(type(v) is int for v in (lookup_ngram, lookup_tokens)) or lookup_ngram < 1 or lookup_tokens < 0:
        raise ValueError(f"need integers lookup_ngram >= 1, lookup_tokens >= 0; got {lookup_ngram!r}, {lookup_tokens!r}")


def decode(model: Llama, prompt: list[int], *, sampler: Sampler, rng: Random, max_new_tokens: int,
           lookup_ngram: int = 3, lookup_tokens: int = 8, policy=None, trace: bool = False) -> Iterator[Step]:
    """Prompt lookup decoding (Saxena 2023), one yield per forward; greedy or sampled, exact.

        text <- prompt
        loop:
            g <- the K tokens after the latest earlier match of text[-n:], n = N..1, at most
                 the tokens left - 1 ([] if none, and on the prompt's step, which is plain's)
            policy: g <- g[:K], K = policy.length(...) (K = 0: a plain step)
            logits <- model(text[-1] + g), causal, rows after the cache        # 1 + len(g) rows
            y <- verify_match(logits[0], logits[1:], g)   # plain's draws; keeps g's agreeing prefix
            cache <- drop the rows of the rejected guesses;  text += y;  yield y
    """
    check(model.config, lookup_ngram=lookup_ngram, lookup_tokens=lookup_tokens)
    if not prompt:
        raise ValueError("lookup needs a prompt of at least one token")
    K = min(lookup_tokens, max_new_tokens)                # a guess never runs past the budget
    cache = KVCache.for_model(model, len(prompt) + max_new_tokens + K, scratch=K)
    device = model.tok_embeddings.weight.device
    text, end = list(prompt), len(prompt) + max_new_tokens
    while True:
        n = len(text)                                     # position of the first new token
        room = min(K, max(end - n - 1, 0))
        # the prompt's step is plain's: the prompt alone (engine/generate.py)
        full, m, start = find(text, lookup_ngram, K) if cache.length else ([], 0, -1)
        guess = full[:policy.length(text, full, m, room=room) if policy else room]
        feed = text[cache.length:] + guess                # the prompt at first, then the last token
        positions = torch.arange(cache.length, cache.length + len(feed), device=device)
        logits = model(torch.tensor([feed], device=device), positions, cache,
                       keep=list(range(-len(guess) - 1, 0)))[0]                # (1 + len(g), V)
        cand = torch.tensor([guess], dtype=torch.long).view(1, len(guess))     # (1, len(g))
        out, _ = verify_match(logits[0], logits[None, 1:], cand, sampler, rng, n)
        cache.truncate(n + len(out) - 1)                  # keep the accepted guesses; y[-1] is fed next
        text += out
        info = {"kind": "lookup", "position": n, "ngram": m, "source": start, "guess": guess, "found": len(full),
                "room": room, "policy": policy is not None, "first": n == len(prompt), "accepted": len(out) - 1,
                "next": out[-1]} if trace else None
        yield Step(out, drafted=len(guess), accepted=len(out) - 1, trace=info,
                   arm=("copy" if guess else "plain") if policy else "")
