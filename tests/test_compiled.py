"""The opt-in compiled layer stack (engine/compiled.py): a kernel swap that must keep the exact
4-bit path exact (each row of a k-row forward carries a one-row forward's bits), and that,
where it cannot compile, says so once and leaves the eager model working.

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
from engine import compiled, lookahead, lookup, packed
from engine.generate import plain
from engine.kvcache import KVCache
from engine.llama import Block, Llama, LlamaConfig

ROOT = Path(__file__).resolve().parents[1]
needs_bf16 = pytest.mark.skipif(not packed.can_prepack(torch.zeros(1, dtype=torch.bfloat16)),
                                reason="no oneDNN bf16 on this CPU: the exact 4-bit path does not exist")
V = 64


def exact_int4():
    """The exact 4-bit path on a tiny model: int4 layers, bf16 head padded to two rows,
    invariant_attention (what --int4 --batch-invariant builds). Hkv = 3 as SmolLM2's, which
    the warm-up's 3 rows must not be confused with (see the row-count test)."""
    cfg = LlamaConfig(dim=96, n_layers=2, n_heads=6, n_kv_heads=3, hidden_dim=64, vocab_size=V)
    model = Llama(cfg).float().requires_grad_(False)
    g = torch.Generator().manual_seed(0)
    for name, p in sorted(model.named_parameters()):
        p.data = 1 + 0.1 * torch.randn(p.shape, generator=g) if name.endswith("norm.weight") else \
            torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5
    model.tok_embeddings.weight.data *= 96 ** 0.5 / 4
    return packed.prepack(packed.quantize_int4(model), batch_invariant=True)


@pytest.fixture(scope="module")
def fast():
    notes = []
    model = compiled.compile_model(exact_int4(), notes.append)
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


def k_row_forward(model, prompt, nxt, junk: int = 3):
    """The same rows verified in one forward, lookahead-style: `junk` window rows first (other
    slots, one shared position, each seeing only itself), then `nxt` as a causal chain that
    sees the cache and itself, never the junk."""
    cache = KVCache.for_model(model, 40)
    model(prompt, torch.arange(prompt.shape[1]), cache)
    P, K = cache.length, nxt.shape[1]
    T = junk + K
    tokens = torch.cat([torch.randint(0, V, (1, junk), generator=torch.Generator().manual_seed(9)), nxt], 1)
    positions = torch.cat([torch.full((junk,), P), torch.arange(P, P + K)])
    mask = torch.zeros(T, P + T, dtype=torch.bool)                       # (T, S)
    mask[:, :P] = True
    mask[torch.arange(T), P + torch.arange(T)] = True
    mask[junk:, P + junk:] = torch.ones(K, K, dtype=torch.bool).tril()
    return model(tokens, positions, cache, mask=mask)[0, junk:]          # (K, V)


PROMPT = torch.tensor([prompt_for(1, 6, V)])
NEXT = torch.tensor([prompt_for(2, 5, V)])


@needs_bf16
def test_compiled_k_row_rows_carry_one_row_bits(fast):
    # Why: "every decoder prints plain's tokens" on the exact path needs a verified row to get
    # plain's bits, though compiled as another graph (T >= 2, masked, junk keys beside its own)
    # than plain's one-row graph.
    model, notes = fast
    assert torch.equal(k_row_forward(model, PROMPT, NEXT), one_row_steps(model, PROMPT, NEXT))
    assert notes == []


@needs_bf16
def test_mixing_compiled_one_row_and_eager_k_rows_is_caught(fast):
    # the broken variant: compile only the one-row step and verify k rows eager. Inductor's
    # fused norms and RoPE round apart from eager's, so the property above must fail for it
    model, _ = fast
    eager = exact_int4()
    assert torch.equal(k_row_forward(eager, PROMPT, NEXT), one_row_steps(eager, PROMPT, NEXT))
    assert not torch.equal(k_row_forward(eager, PROMPT, NEXT), one_row_steps(model, PROMPT, NEXT))


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
    a, b = one_row_steps(model, PROMPT, NEXT), one_row_steps(exact_int4(), PROMPT, NEXT)
    assert (a - b).abs().max() < 0.05 * b.abs().max()


@needs_bf16
@pytest.mark.parametrize("decoder, knobs", [
    (lookahead.decode, dict(window=3, ngram=4, guesses=3)),
    (lookup.decode, dict(lookup_ngram=2, lookup_tokens=4)),
])
def test_decoders_print_plain_tokens_when_compiled(fast, decoder, knobs):
    # Why: the promise itself, end to end, on the graphs warm_up compiled (a refused
    # recompile would show as a notice)
    model, notes = fast
    prompt = prompt_for(3, 8, V) * 2       # repeats, so that lookup and the pool find n-grams
    assert run(decoder, model, prompt, 24, **knobs) == run(plain, model, prompt, 24)
    assert notes == []


def test_a_compile_error_leaves_the_eager_model_with_one_notice(monkeypatch):
    # Why: --compile is opt-in speed; a compiler that fails must cost a line, not the run
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
    # Why: a machine with no C++ compiler (or a VM image without one) must still run --compile
    # runs, eager; a fresh inductor cache so that no earlier artifact hides the missing compiler
    script = (
        "import json, torch, sys; sys.path[:0] = ['tests', '.']\n"
        "from conftest import tiny_llama\n"
        "from engine import compiled\n"
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
