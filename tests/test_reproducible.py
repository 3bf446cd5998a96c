"""Same seed, same draws and same tokens in a fresh process, whatever its hash seed.

Why it matters: `Random(seed)` promises draws fixed by (seed, stream, position) across runs,
platforms and processes; a source keyed through Python's `hash()` of a str would pass every
in-process test and change with PYTHONHASHSEED, so the check runs in child processes with two
different hash seeds. The broken variant below is exactly that source, and it fails.
"""
import functools
import json
import os
import random
import subprocess
import sys

from engine.sampling import Random

CHILD = """
import json, sys, torch
sys.path[:0] = ['.', 'tests']
torch.set_num_threads(1)
from engine.generate import generate, plain
from engine.sampling import Sampler
from tools.prove import tiny_llama
import test_reproducible as here
model, out = tiny_llama(3, 16, 2), {}
for source in ('Random', 'HashKeyed'):
    rng = getattr(here, source)(7)
    draws = [rng.uniform(s, t) for s in ('token', 'draft', 'accept') for t in (0, 1, 10**6)]
    run = plain(model, [1, 2, 3], sampler=Sampler(0.9, top_k=8), rng=rng, max_new_tokens=8)
    out[source] = [draws, list(generate(run, max_new_tokens=8))]
print(json.dumps(out))
"""


class HashKeyed(Random):
    """Broken: keys the stream through hash(), which PYTHONHASHSEED salts for str."""

    def uniform(self, stream, position):
        return random.Random(hash((self.seed, stream, position))).random()


@functools.lru_cache(maxsize=None)
def children() -> dict:
    """PYTHONHASHSEED -> {source: [uniform draws, 8 plain-sampled tokens]}, two processes at once."""
    procs = {h: subprocess.Popen([sys.executable, "-c", CHILD], stdout=subprocess.PIPE, text=True,
                                 env={**os.environ, "PYTHONHASHSEED": h}) for h in ("1", "2")}
    return {h: json.loads(p.communicate()[0]) for h, p in procs.items()}


def child(hash_seed: str) -> dict:
    return children()[hash_seed]


def test_same_seed_gives_the_same_draws_and_tokens_across_processes_and_hash_seeds():
    a, b = child("1")["Random"], child("2")["Random"]
    assert a == b and len(a[1]) == 8
    assert a[0][0] == Random(7).uniform("token", 0)     # and the same as in this process


def test_a_hash_keyed_source_fails_the_cross_process_check():
    assert child("1")["HashKeyed"] != child("2")["HashKeyed"]
