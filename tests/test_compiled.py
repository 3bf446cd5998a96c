"""The opt-in compiled layer stack (tools/compiled.py): one graph a step, on the exact path; a
k-row forward's rows get the compiled one-row step's bits, so every decoder prints the compiled
plain's tokens; every graph a decoder reaches is compiled up front; and where it cannot
compile, it says so once and leaves the eager model working.

Compiling costs seconds (about 25 s for the tiny model with an empty inductor cache), so one
compiled model serves the module.
"""
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import prompt_for, run, tiny_llama
from engine import lookahead, lookup, packed
from engine.generate import plain
from engine.invariant import row_attention
from engine.kvcache import KVCache
from engine.llama import Llama, LlamaConfig
from tools import compiled

ROOT = Path(__file__).resolve().parents[1]
needs_bf16 = pytest.mark.skipif(not packed.can_prepack(torch.zeros(1, dtype=torch.bfloat16)),
                                reason="no oneDNN bf16 on this CPU: the 4-bit path's head stays nn.Linear")
V = 64


def int4(batch_invariant: bool = True):
    """A tiny 4-bit model as --int4 builds it (int4 layers, bf16 head, the exact path by
    default); Hkv = 3 as SmolLM2's, which the warm-up's 3 rows must not be confused with, and
    3 layers: with 2, inductor's fusions happened to round the two graphs alike anyway."""
    cfg = LlamaConfig(dim=96, n_layers=3, n_heads=6, n_kv_heads=3, hidden_dim=64, vocab_size=V)
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
    assert isinstance(model.blocks, compiled.CompiledStack)
    return model, notes


PROMPT = torch.tensor([prompt_for(1, 6, V)])
NEXT = torch.tensor([prompt_for(2, 5, V)])


def one_row_steps(model, prompt=PROMPT, nxt=NEXT):
    """Plain's logits: the prompt, then each of `nxt` alone (T = 1, no mask)."""
    cache = KVCache.for_model(model, 40)
    model(prompt, torch.arange(prompt.shape[1]), cache)
    P = cache.length
    return torch.cat([model(nxt[:, t:t + 1], torch.tensor([P + t]), cache)[0] for t in range(nxt.shape[1])])


@needs_bf16
def test_any_row_count_runs_on_the_warmed_up_graphs(fast):
    # Why: a decoder sends 1..~40 rows a step after prompts of any length, up to a step that
    # fills its cache; each must run on a graph warm_up compiled, not recompile (minutes on
    # SmolLM2, and refused). Caught broken variants: a warm-up without the k-row graph; the
    # cache written through a view of its first slots (a step that fills the cache was a new graph)
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
    a, b = one_row_steps(model), one_row_steps(int4())
    assert (a - b).abs().max() < 0.05 * b.abs().max()


@needs_bf16
def test_k_rows_get_the_compiled_one_row_steps_bits(fast):
    # Why: a decoder verifies k rows in one forward and must keep the tokens plain draws one
    # row at a time, so each row (a chain's, a tree's) must round as the one-row graph rounds it.
    # Caught broken variant: OPTIONS without emulate_precision_casts (the two graphs fuse the
    # residual adds apart, and inductor rounds a fused chain once, at its end)
    model, notes = fast
    one = one_row_steps(model)                                                 # (5, V)
    cache = KVCache.for_model(model, 40)
    model(PROMPT, torch.arange(6), cache)
    assert torch.equal(model(NEXT, torch.arange(6, 11), cache)[0], one)       # a chain of 5 rows
    cache.truncate(6)
    mask = torch.ones(3, 9, dtype=torch.bool)                                  # a tree: rows 1, 2 both follow row 0
    mask[:, 6:] = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)
    tree = model(torch.tensor([[NEXT[0, 0], NEXT[0, 1], 7]]), torch.tensor([6, 7, 7]), cache, mask=mask)[0]
    assert torch.equal(tree[:2], one[:2])
    cache.truncate(6)
    model(NEXT[:, :1], torch.tensor([6]), cache)
    assert torch.equal(tree[2], model(torch.tensor([[7]]), torch.tensor([7]), cache)[0, 0])
    assert notes == []


@needs_bf16
def test_every_decoder_prints_the_compiled_plains_tokens(fast):
    # Why: the compiled exact path is a path of its own: its plain may differ from eager plain's
    # tokens, but lookahead's trees and windows and lookup's copies must print its plain's,
    # on its warmed-up graphs (no notice). Caught broken variants: the op taking every k-row
    # forward for a causal chain (a tree's rows then see other branches' keys); a warm-up
    # without the k-row graph
    model, notes = fast
    prompt = prompt_for(3, 8, V) * 2
    want = run(plain, model, prompt, 24)
    assert run(lookahead.decode, model, prompt, 24, window=3, ngram=4, guesses=3) == want
    assert run(lookup.decode, model, prompt, 24, lookup_tokens=6) == want
    assert notes == []


def test_the_exact_path_enters_the_graph_as_one_opaque_op(monkeypatch):
    # Why: row_attention reads the mask's values to choose each row's keys, which dynamo cannot
    # trace; the graph must call it through the custom op, every layer, and a model whose
    # compile failed must get row_attention back. Caught broken variants: compile_model leaving
    # attend as it was, or not restoring it on failure
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: fn)                # "compiles" to itself
    got = compiled.compile_model(int4(), print)
    assert all(b.attention.attend is compiled.attend for b in got.layers)
    calls = []
    monkeypatch.setattr(compiled, "row_attention", lambda *a, **k: calls.append(1) or row_attention(*a, **k))
    one_row_steps(got)
    assert len(calls) == 6 * len(got.layers)                                  # the prompt, then 5 steps
    def broken(fn, **kw):
        def call(*a, **k):
            raise RuntimeError("inductor: C++ compile failed")
        return call
    monkeypatch.setattr(torch, "compile", broken)
    notes = []
    back = compiled.compile_model(int4(), notes.append)
    assert len(notes) == 1 and all(b.attention.attend is row_attention for b in back.layers)
    assert "blocks" not in back.__dict__


def test_a_compile_error_leaves_the_eager_model_with_one_notice(monkeypatch):
    # Why: compiling is opt-in speed (make bench COMPILE=1); a compiler that fails must cost a line, not the run
    def broken(fn, **kw):
        def call(*a, **k):
            raise RuntimeError("inductor: C++ compile failed\nmore detail")
        return call
    monkeypatch.setattr(torch, "compile", broken)
    model, notes = tiny_llama(0), []
    want = one_row_steps(model, PROMPT % 16, NEXT % 16)
    got = compiled.compile_model(model, notes.append)
    assert notes == ["compile: RuntimeError: inductor: C++ compile failed; running eager"]
    assert "blocks" not in got.__dict__
    assert torch.equal(one_row_steps(got, PROMPT % 16, NEXT % 16), want)


def test_a_refused_recompile_runs_eager_from_there_with_one_notice(monkeypatch):
    # Why: a shape warm_up missed would recompile mid-run (minutes, and a graph that may round
    # apart); it is refused, said once, and the forward still answers
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
    assert notes == [] and len(calls) == 2                                  # one row, k rows
    got = one_row_steps(compiled_model, PROMPT % 16, NEXT % 16)
    assert len(notes) == 1 and "eager from here on" in notes[0]
    assert torch.equal(got, one_row_steps(tiny_llama(0), PROMPT % 16, NEXT % 16))


def test_without_a_compiler_one_notice_and_the_eager_answer(tmp_path):
    # Why: a machine with no C++ compiler (or a VM image without one) must still run COMPILE=1
    # runs, eager; a fresh inductor cache so that no earlier artifact hides the missing compiler
    script = (
        "import json, torch, sys; sys.path[:0] = ['tests', '.']\n"
        "from conftest import tiny_llama\n"
        "from test_compiled import one_row_steps, PROMPT, NEXT\n"
        "from tools import compiled\n"
        "m, notes = tiny_llama(0), []\n"
        "want = one_row_steps(m, PROMPT % 16, NEXT % 16)\n"
        "m = compiled.compile_model(m, notes.append)\n"
        "got = one_row_steps(m, PROMPT % 16, NEXT % 16)\n"
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
