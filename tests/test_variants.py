"""Bring your own Llama: the config variants HF's Llama reads, each saved by transformers itself
as a tiny random checkpoint, load here to HF's logits and greedy tokens, and every decoder
prints plain's tokens on them; what the engine cannot run is refused by name.

The checkpoints are tiny (2 layers, C=64, V=128, fp32) and built once per module, so the whole
file runs in seconds. transformers is a test extra (requirements-test.txt); without it the file
skips.
"""
import dataclasses
import json
import math

import pytest
import torch

from conftest import run
from engine import llama, weights
from engine.decoders import DECODERS
from engine.generate import plain
from engine.llama import frequencies, rope
from engine.weights import load_config, load_model

transformers = pytest.importorskip("transformers")

V, C, PROMPT, NEW = 128, 64, [5, 17, 99, 3, 64, 12, 7, 88, 41, 2], 24
LLAMA3 = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
# name -> HF config keywords. llama3's original context (64) is tiny so that the prompt's
# positions reach all three of its frequency bands (kept, blended, divided by factor).
VARIANTS = {
    "default": {},
    "llama3": {"rope_parameters": LLAMA3},
    "linear": {"rope_parameters": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}},
    "dynamic": {"rope_parameters": {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0},
                "max_position_embeddings": 96},
}


def hf_model(name: str, seed: int = 0):
    """A random HF LlamaForCausalLM of variant `name`, weights drawn from `seed`."""
    torch.manual_seed(seed)
    kw = dict(vocab_size=V, hidden_size=C, intermediate_size=96, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
              bos_token_id=None, eos_token_id=None, pad_token_id=None) | VARIANTS[name]
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**kw)).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():   # HF's init (std 0.02) makes attention near-uniform and RoPE nearly
        for n, p in sorted(model.named_parameters()):   # invisible: draw every weight at 1/sqrt(fan_in)
            if n.endswith("norm.weight"):
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
            elif n.endswith("bias"):
                p.copy_(0.5 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
    return model


def saved(model, path, edit=None):
    """model.save_pretrained(path), then config.json passed through `edit` (a dict -> None)."""
    model.save_pretrained(path)
    if edit is not None:
        cfg = json.loads((path / "config.json").read_text())
        edit(cfg)
        (path / "config.json").write_text(json.dumps(cfg))
    return path


def old_spelling(cfg):
    # transformers 4's spelling of the same RoPE: rope_scaling + a top-level rope_theta
    p = cfg.pop("rope_parameters")
    cfg["rope_theta"] = p.pop("rope_theta")
    cfg["rope_scaling"] = p if p["rope_type"] != "default" else None


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """name -> (the HF model, its saved directory), plus 'llama3 old spelling'."""
    root, out = tmp_path_factory.mktemp("variants"), {}
    for name in VARIANTS:
        model = hf_model(name)
        out[name] = model, saved(model, root / name)
    model = out["llama3"][0]
    out["llama3 old spelling"] = model, saved(model, root / "llama3-old", old_spelling)
    return out


def hf_logits(model, tokens):
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits                   # (1, T, V)


def hf_greedy(model, prompt, n):
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False,
                             pad_token_id=0, eos_token_id=None)
    return out[0, len(prompt):].tolist()


# --------------------------------------------------------------------------- RoPE tables

@pytest.mark.parametrize("name", VARIANTS)
def test_rope_tables_have_hf_bits(checkpoints, name):
    # Why: a table one ulp off moves every logit by rounding; equal bits leave only the
    # matmuls' summation order between us and HF
    hf, path = checkpoints[name]
    cfg = load_config(path)
    rotary = hf.model.rotary_emb
    assert torch.equal(frequencies(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, torch.float32),
                       rotary.inv_freq)
    positions = torch.arange(cfg.max_seq_len)
    cos, sin = rope(positions, cfg.head_dim, cfg.rope_theta, torch.float32, cfg.rope_scaling)
    hf_cos, hf_sin = rotary(torch.zeros(1, dtype=torch.float32), positions[None])
    assert torch.equal(cos, hf_cos[0]) and torch.equal(sin, hf_sin[0])


def test_llama3_frequencies_follow_the_three_bands():
    # the rule written out by hand for D=16, theta=500000, n0=64, low 1, high 4, factor 8
    from engine.llama import RopeScaling
    s = RopeScaling("llama3", 8.0, 1.0, 4.0, 64)
    f = [500000.0 ** (-2 * i / 16) for i in range(8)]
    got = frequencies(16, 500000.0, s, torch.float64)
    for i, fi in enumerate(f):
        w = 2 * math.pi / fi
        if w < 64 / 4:
            want = fi
        elif w > 64 / 1:
            want = fi / 8
        else:
            a = (64 / w - 1) / (4 - 1)
            want = (1 - a) * fi / 8 + a * fi
        assert math.isclose(got[i].item(), want, rel_tol=1e-12), i
    assert got[0] == f[0] and 0 < got[1] < f[1] and got[7] == pytest.approx(f[7] / 8)


# --------------------------------------------------------------------------- against HF

# fp32 logits: the RoPE tables and norms have HF's bits, but a stacked wqkv matmul and SDPA with
# grouped heads sum in another order than HF's three projections and repeated K/V; over two
# layers that leaves ~1e-6 relative. 1e-4 absolute on logits of size ~3 is that, with room;
# a wrong RoPE (the broken variants below) moves them by > 1e-1.
LOGIT_ATOL = 1e-4


@pytest.mark.parametrize("name", list(VARIANTS) + ["llama3 old spelling"])
def test_logits_equal_hf_within_fp32_rounding(checkpoints, name):
    hf, path = checkpoints[name]
    tokens = PROMPT * 6                                                # 60 positions
    ours = load_model(path)(torch.tensor([tokens]), torch.arange(len(tokens)))
    torch.testing.assert_close(ours, hf_logits(hf, tokens), atol=LOGIT_ATOL, rtol=0)


@pytest.mark.parametrize("name", list(VARIANTS) + ["llama3 old spelling"])
def test_greedy_tokens_equal_hf_generate(checkpoints, name):
    hf, path = checkpoints[name]
    ours = run(plain, load_model(path), PROMPT, NEW)
    assert ours == hf_greedy(hf, PROMPT, NEW)


def test_both_spellings_load_the_same_config(checkpoints):
    assert load_config(checkpoints["llama3"][1]) == load_config(checkpoints["llama3 old spelling"][1])


# --------------------------------------------------------------------------- broken variants

def ignore_rope_parameters(d, head_dim, context):
    # the loader as it was before transformers 5: rope_parameters unread, theta 10000, no scaling
    return ORIGINAL["rope_from_hf"]({k: v for k, v in d.items() if k != "rope_parameters"},
                                    head_dim, context)


def swap_low_high(head_dim, theta, scaling, work, device=None):
    if scaling is not None and scaling.kind == "llama3":
        scaling = dataclasses.replace(scaling, low_freq_factor=scaling.high_freq_factor,
                                      high_freq_factor=scaling.low_freq_factor)
    return ORIGINAL["frequencies"](head_dim, theta, scaling, work, device)


def scale_positions_up(head_dim, theta, scaling, work, device=None):
    f = ORIGINAL["frequencies"](head_dim, theta, scaling, work, device)
    return f * scaling.factor ** 2 if scaling is not None and scaling.kind == "linear" else f


ORIGINAL = {"rope_from_hf": weights.rope_from_hf, "frequencies": llama.frequencies}
MUTANTS = {   # name -> (module, function, fake, the variant it breaks)
    "rope_parameters ignored": (weights, "rope_from_hf", ignore_rope_parameters, "llama3"),
    "llama3 low/high swapped": (llama, "frequencies", swap_low_high, "llama3"),
    "linear multiplies by factor": (llama, "frequencies", scale_positions_up, "linear"),
}


@pytest.mark.parametrize("mutant", MUTANTS)
def test_hf_parity_catches_broken_variants(checkpoints, mutant, monkeypatch):
    # Why: a parity test that a wrong RoPE also passes proves nothing
    module, name, fake, variant = MUTANTS[mutant]
    monkeypatch.setattr(module, name, fake)
    with pytest.raises(AssertionError):
        test_logits_equal_hf_within_fp32_rounding(checkpoints, variant)
    with pytest.raises(AssertionError):
        test_greedy_tokens_equal_hf_generate(checkpoints, variant)


# --------------------------------------------------------------------------- refused by name

@pytest.mark.parametrize("edit, words", [
    (lambda c: c["rope_parameters"].update(rope_type="yarn"), "rope_type 'yarn' is not supported"),
    (lambda c: c["rope_parameters"].update(rope_type="longrope"), "rope_type 'longrope'"),
    (lambda c: c["rope_parameters"].update(mscale=1.0), "rope_parameters.mscale .* not read by rope_type 'llama3'"),
    (lambda c: c["rope_parameters"].pop("low_freq_factor"), "'llama3' needs low_freq_factor"),
    (lambda c: c["rope_parameters"].update(partial_rotary_factor=0.5), "partial_rotary_factor 0.5"),
    (lambda c: c["rope_parameters"].update(low_freq_factor=4.0), "low_freq_factor < high_freq_factor"),
    (lambda c: c.update(rope_theta=10000.0), r"rope_parameters.rope_theta is 500000.0, but rope_theta is 10000.0"),
    (lambda c: c.update(rope_scaling={"type": "linear", "factor": 2.0}), "rope_parameters.factor is 8.0, but rope_scaling.factor is 2.0"),
    (lambda c: c.update(rope_parameters=[1, 2]), "rope_parameters must be a JSON object"),
    (lambda c: c.update(hidden_act="gelu"), "hidden_act 'gelu'"),
    (lambda c: c.update(model_type="gemma"), "model_type 'gemma'"),
])
def test_unsupported_variants_are_refused_by_name(checkpoints, tmp_path, edit, words):
    # Why: a config key the engine skipped would load and print other tokens than HF, silently
    cfg = json.loads((checkpoints["llama3"][1] / "config.json").read_text())
    edit(cfg)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=words):
        load_config(tmp_path)
