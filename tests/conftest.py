"""Shared fixtures: seeded tiny float64 Llamas and the hypothesis profiles.

float64 so that a forward of T=1 and one of T=K+1 cannot flip a near-tie argmax: token
equality between decoders is then a property of the algorithms, not of rounding.
"""
import os
import re

import pytest
import torch
from hypothesis import settings

from engine.generate import generate
from engine.llama import Llama, LlamaConfig
from engine.sampling import Random, Sampler

# tiny float64 models: one thread avoids OpenMP barriers that dwarf the math itself
USER_THREADS = torch.get_num_threads()   # what a user's command runs with
torch.set_num_threads(1)

settings.register_profile("dev", max_examples=20, deadline=None)
settings.register_profile("ci", max_examples=40, deadline=None, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "dev"))

# `make test-cuda`: the decoders' property tests with every tiny model on a GPU (CI has none)
DEVICE = torch.device(os.environ.get("ENGINE_TEST_DEVICE", "cpu"))


def pytest_configure(config):
    if DEVICE.type == "cuda" and not torch.cuda.is_available():
        raise pytest.UsageError("ENGINE_TEST_DEVICE=cuda: no CUDA device here (make test-cuda needs a GPU)")


def int4_copy(target: Llama) -> Llama:
    """The target's weights in 4-bit groups (engine/fast/packed.py), as the CLI's --draft int4 builds
    its draft from the checkpoint: a float CPU model not yet prepacked."""
    import copy
    from engine.fast.packed import quantize_int4
    return quantize_int4(copy.deepcopy(target).float())


def tiny_llama(seed: int = 0, vocab: int = 16, n_layers: int = 2, tie: bool = False,
               scale: float = 1.0, hidden: int = 48, dim: int = 32, heads: int = 4,
               qkv_bias: bool = False) -> Llama:
    """A random float64 Llama (C=32, H=4, Hkv=2, F=48) whose every weight is drawn from `seed`;
    hidden=64 gives layer shapes that pack in 4-bit groups of 32 (conftest.int4_copy);
    qkv_bias: Qwen2's shape (biases on q, k, v), with `dim` and `heads` its size."""
    cfg = LlamaConfig(dim=dim, n_layers=n_layers, n_heads=heads, n_kv_heads=heads // 2, hidden_dim=hidden,
                      vocab_size=vocab, rope_theta=10000.0, tie_embeddings=tie, qkv_bias=qkv_bias)
    model = Llama(cfg).double()
    g = torch.Generator().manual_seed(seed)
    for name, p in sorted(model.named_parameters()):
        if name.endswith("norm.weight"):
            p.data = 1 + 0.1 * torch.randn(p.shape, generator=g, dtype=p.dtype)
        else:  # std 1/sqrt(fan_in), then `scale` sharpens or flattens the next-token law
            p.data = torch.randn(p.shape, generator=g, dtype=p.dtype) * scale / p.shape[-1] ** 0.5
    model.tok_embeddings.weight.data *= p.shape[-1] ** 0.5 / 4  # embeddings of norm ~ sqrt(C)/4
    return model.requires_grad_(False).to(DEVICE)


def run(decoder, model, prompt, n, *, sampler=Sampler(), seed=0, eos=(), stats=None, **knobs):
    """The tokens a decoder generates from `prompt`, greedy unless a sampler is given."""
    steps = decoder(model, prompt, sampler=sampler, rng=Random(seed), max_new_tokens=n, **knobs)
    return list(generate(steps, max_new_tokens=n, eos_ids=eos, stats=stats))


def prompt_for(seed: int, P: int, V: int) -> list[int]:
    """P random token ids below V, drawn from `seed`."""
    return torch.randint(0, V, (P,), generator=torch.Generator().manual_seed(seed)).tolist()


def unnamed_decoders(labels, but=()) -> list[str]:
    """The registry's decoders (engine/decoders.py) that no label names as a word, bar `but`:
    a list a new decoder must join fails on it until it is named there."""
    from engine.decoders import DECODERS
    return [d for d in DECODERS if d not in but and not any(re.search(rf"\b{d}\b", l) for l in labels)]


@pytest.fixture(scope="session", autouse=True)
def private_cache(tmp_path_factory):
    # the CLI measures this machine's forward costs once into $XDG_CACHE_HOME/engine; tests
    # (and the CLIs they start) measure into a folder of their own, never the user's home
    os.environ["XDG_CACHE_HOME"] = str(tmp_path_factory.mktemp("cache"))


@pytest.fixture(scope="module")
def user_threads():
    """The real checkpoint's tests run with a user's threads (torch's default), not the tiny
    models' one: its forwards are matmuls that split over threads, as on the command line."""
    torch.set_num_threads(USER_THREADS)
    yield
    torch.set_num_threads(1)


@pytest.fixture
def model():
    return tiny_llama(0)


def at_a_terminal(argv: list[str], env: dict, timeout: int = 300) -> tuple[int, str]:
    """Run argv with its stderr on a pseudo-terminal 100 columns wide (tqdm draws nothing at 0):
    (exit code, what the terminal showed)."""
    import contextlib
    import fcntl
    import pty
    import struct
    import subprocess
    import termios
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))
    r = subprocess.run(argv, stdout=subprocess.PIPE, stderr=slave, env=env, timeout=timeout)
    os.close(slave)
    seen = b""
    with contextlib.suppress(OSError):     # EIO once the child's end is closed and drained
        while chunk := os.read(master, 1 << 16):
            seen += chunk
    os.close(master)
    return r.returncode, seen.decode(errors="replace")

