"""The opt-in compiled layer stack (tools/compiled.py): a kernel swap that keeps the model's
answer (to its rounding), compiles every graph a decoder reaches up front, leaves the exact path
eager, and, where it cannot compile, says so once and leaves the eager model working.

Compiling costs seconds (about 30 s for the tiny model with an empty inductor cache, 10 s
with a warm one), so one compiled model serves the module.
"""
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import prompt_for, run, tiny_llama
from engine import lookahead, packed
from tools import compiled
from engine.generate import plain
from engine.kvcache import KVCache
from engine.llama import Block, Llama, LlamaConfig

ROOT = Path(__file__).resolve().parents[1]
needs_bf16 = pytest.mark.skipif(not packed.can_prepack(torch.zeros(1, dtype=torch.bfloat16)),
                                reason="no oneDNN bf16 on this CPU: the 4-bit path's head stays nn.Linear")
V = 64


def int4(batch_invariant: bool = False):
    """A tiny 4-bit model as --int4 builds it (int4 layers, bf16 head); Hkv = 3 as SmolLM2's,
    which the warm-up's 3 rows must not be confused with (see the row-count test)."""
    cfg = LlamaConfig(dim=96, n_layers=2, n_heads=6, n_kv_heads=3, hidden_dim=64, vocab_size=V)
    model = Llama(cfg).float().requires_grad_(False)
    g = torch.Generator().manual_seed(0)
    for name, p in sorted(model.named_parameters()):
        p.data = 1 + 0.1 * torch.randn(p.shape, generator=g) if name.endswith("norm.weight") else \
            torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5
    model.tok_embeddings.weight.data *= 96 ** 0.5 / 4
    return packed.prepack(packed.quantize_int4(model), batch_invariant=batch_invariant)


@pytest.fixture(scope="module")
def fast():
    notes = []
    model = compiled.compile_model(int4(), notes.append)
    if notes:
        pytest.skip(f"no compiler here: {notes[0]}")
    assert isinstance(model.layers[0], compiled.CompiledBlock)
    return model, notes


def one_row_steps(model, prompt, nxt):
    """Plain's logits: the prompt, then each of `nxt` alone (T = 1, no mask)."""
    cache = KVCache.for_model(model, 40)
    model(prompt, torch.arange(prompt.shape[1]), cache)
    P = cache.length
    return torch.cat([model(nxt[:, t:t + 1], torch.tensor([P + t]), cache)[0] for t in range(nxt.shape[1])])


PROMPT = torch.tensor([prompt_for(1, 6, V)])
NEXT = torch.tensor([prompt_for(2, 5, V)])


@needs_bf16
def test_any_row_count_runs_on_the_warmed_up_graphs(fast):
    # Why: a decoder sends 1..~40 rows a step, and prompts of any length; each must run on a
    # graph warm_up compiled, not recompile (seconds, and refused). Caught broken variant:
    # duck shapes, which tied the warm-up's 3 rows to Hkv = 3 and so compiled T = 3 only
    model, notes = fast
    for T in (2, 3, 4, 7, 12, 29):
        cache = KVCache.for_model(model, 2 * T + 1)
        model(torch.zeros(1, T, dtype=torch.long), torch.arange(T), cache)              # prompt
        model(torch.zeros(1, T, dtype=torch.long), torch.arange(T, 2 * T), cache)       # k rows
        model(torch.zeros(1, 1, dtype=torch.long), torch.tensor([2 * T]), cache)        # one row
    assert notes == []


@needs_bf16
def test_compiled_logits_follow_eager(fast):
    # Why: compiling is a kernel swap, never a model change: the same logits to bf16 rounding
    model, _ = fast
    a, b = one_row_steps(model, PROMPT, NEXT), one_row_steps(int4(), PROMPT, NEXT)
    assert (a - b).abs().max() < 0.05 * b.abs().max()


@needs_bf16
def test_a_compiled_lookahead_runs_on_the_warmed_up_graphs(fast):
    # Why: lookahead's tree masks and window rows are the shapes a decoder sends beyond plain's;
    # they must run compiled, with no refused recompile (the answer is the compiled model's,
    # not an exact path: its tokens are not held to plain's)
    model, notes = fast
    prompt = prompt_for(3, 8, V) * 2
    assert len(run(lookahead.decode, model, prompt, 24, window=3, ngram=4, guesses=3)) == 24
    assert notes == []


@needs_bf16
def test_the_exact_path_stays_eager_with_one_notice_and_stays_exact():
    # Why: the exact path's attention chooses its blocks from the mask's data, which a graph
    # cannot; compiling it must cost one line, and every decoder still prints plain's tokens
    notes = []
    model = compiled.compile_model(int4(batch_invariant=True), notes.append)
    assert len(notes) == 1 and "runs eager" in notes[0]
    assert all(type(b) is Block for b in model.layers)
    prompt = prompt_for(3, 8, V) * 2
    assert run(lookahead.decode, model, prompt, 24, window=3, ngram=4, guesses=3) == run(plain, model, prompt, 24)


def test_a_compile_error_leaves_the_eager_model_with_one_notice(monkeypatch):
    # Why: compiling is opt-in speed (make bench COMPILE=1); a compiler that fails must cost a line, not the run
    def broken(fn, **kw):
        def call(*a, **k):
            raise RuntimeError("inductor: C++ compile failed\nmore detail")
        return call
    monkeypatch.setattr(torch, "compile", broken)
    model, notes = tiny_llama(0), []
    want = model(PROMPT % 16, torch.arange(6))
    got = compiled.compile_model(model, notes.append)
    assert notes == ["compile: RuntimeError: inductor: C++ compile failed; running eager"]
    assert all(type(b) is Block for b in got.layers)
    assert torch.equal(got(PROMPT % 16, torch.arange(6), KVCache.for_model(got, 8)), want)


def test_a_refused_recompile_runs_eager_from_there_with_one_notice(monkeypatch):
    # Why: a shape warm_up missed would recompile mid-run (seconds, and a graph that may round
    # apart); it is refused, said once for all layers, and the forward still answers
    calls, warm = [], []
    def fake(fn, **kw):           # "compiles" the warm-up's graphs, refuses any call after
        def call(*a, **k):
            if warm:
                raise RuntimeError("Detected recompile when torch.compile stance is 'fail_on_recompile'")
            calls.append(1)
            return fn(*a, **k)
        return call
    monkeypatch.setattr(torch, "compile", fake)
    notes = []
    compiled_model = compiled.compile_model(tiny_llama(0), notes.append)
    warm.append(True)
    assert notes == [] and calls
    cache = KVCache.for_model(compiled_model, 8)
    got = compiled_model(PROMPT % 16, torch.arange(6), cache)
    assert len(notes) == 1 and "eager from here on" in notes[0]
    assert torch.equal(got, tiny_llama(0)(PROMPT % 16, torch.arange(6), KVCache.for_model(compiled_model, 8)))


def test_without_a_compiler_one_notice_and_the_eager_answer(tmp_path):
    # Why: a machine with no C++ compiler (or a VM image without one) must still run COMPILE=1
    # runs, eager; a fresh inductor cache so that no earlier artifact hides the missing compiler
    script = (
        "import json, torch, sys; sys.path[:0] = ['tests', '.']\n"
        "from conftest import tiny_llama\n"
        "from tools import compiled\n"
        "from engine.kvcache import KVCache\n"
        "m, notes = tiny_llama(0), []\n"
        "x = torch.arange(6)[None] % 16\n"
        "want = m(x, torch.arange(6), KVCache.for_model(m, 8))\n"
        "m = compiled.compile_model(m, notes.append)\n"
        "got = m(x, torch.arange(6), KVCache.for_model(m, 8))\n"
        "print(json.dumps({'notes': notes, 'equal': torch.equal(got, want)}))\n")
    env = {"PATH": "/usr/bin:/bin", "CC": "/nonexistent", "CXX": "/nonexistent",
           "TORCHINDUCTOR_CACHE_DIR": str(tmp_path), "HOME": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    said = json.loads(out.stdout.strip().splitlines()[-1])
    assert said["equal"] and len(said["notes"]) == 1, said
    assert "No working C++ compiler" in said["notes"][0] and said["notes"][0].endswith("running eager")
    assert "Traceback" not in out.stderr
