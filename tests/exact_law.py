"""The exact-law harness lives in tools/exact_law.py (the certification tool uses it too);
this adds what only the tests need: the plain sampler's law on a Llama, from cache-free forwards."""
from __future__ import annotations

import torch

from engine.llama import Llama
from engine.sampling import Sampler
from tools.exact_law import Enumerator, decoder_law, max_gap, reference_law  # noqa: F401 (re-exported)


def llama_next_probs(model: Llama, prompt: list[int], sampler: Sampler):
    """The plain sampler's law at each prefix, from a full forward without any cache."""
    def next_probs(prefix):
        tokens = torch.tensor([prompt + list(prefix)])
        return sampler.probs(model(tokens, torch.arange(tokens.shape[1]))[0, -1])
    return next_probs
