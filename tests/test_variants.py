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
import shutil

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer as HFTokenizer, decoders, models, pre_tokenizers

from conftest import run
from engine import llama
from engine.decoders import DECODERS
from engine.doors.cli import main
from engine.draft import EarlyExit
from engine.fast.packed import prepack, quantize_int4
from engine.generate import generate, plain
from engine.kvcache import KVCache
from engine.llama import frequencies, rope
from engine.load import config, weights
from engine.load.config import load_config
from engine.load.tokenizer import Tokenizer
from engine.load.weights import load_model
from engine.sampling import Random, Sampler

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
    "head_dim 32 (H x D != C)": {"head_dim": 32},
    "biases": {"attention_bias": True, "mlp_bias": True},
    "tied": {"tie_word_embeddings": True},
    "mistral, no window": {"model_type": "mistral", "sliding_window": None},
    "mistral, window = context": {"model_type": "mistral", "sliding_window": 256},
    "mistral, window 40": {"model_type": "mistral", "sliding_window": 40},   # caps the context
    "qwen2": {"model_type": "qwen2"},            # biases on q, k, v (none on o), untied head
}


def hf_model(name: str, seed: int = 0):
    """A random HF LlamaForCausalLM of variant `name`, weights drawn from `seed`."""
    torch.manual_seed(seed)
    kw = dict(vocab_size=V, hidden_size=C, intermediate_size=96, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
              bos_token_id=None, eos_token_id=None, pad_token_id=None) | VARIANTS[name]
    kind = kw.pop("model_type", "llama")
    if kind == "mistral":
        model = transformers.MistralForCausalLM(transformers.MistralConfig(**kw))
    elif kind == "qwen2":
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**kw))
    else:
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**kw))
    model.eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():   # HF's init (std 0.02) makes attention near-uniform and RoPE nearly
        for n, p in sorted(model.named_parameters()):   # invisible: draw every weight at 1/sqrt(fan_in)
            if n.endswith("norm.weight"):
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
            elif n.endswith("bias"):                   # biases large enough to matter
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
def test_rope_tables_are_hfs_angles_correctly_rounded(checkpoints, name):
    # Why: HF's angles bit for bit, then cos and sin rounded once from float64 (llama.rope:
    # torch's own fp32 cos was seen ~2^-14 off in some processes); so within one ulp of HF's
    # fp32 tables, the rest of the gap to HF the matmuls' summation order
    hf, path = checkpoints[name]
    cfg = load_config(path)
    rotary = hf.model.rotary_emb
    assert torch.equal(frequencies(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, torch.float32),
                       rotary.inv_freq)
    positions = torch.arange(cfg.max_seq_len)
    cos, sin = rope(positions, cfg.head_dim, cfg.rope_theta, torch.float32, cfg.rope_scaling)
    hf_cos, hf_sin = rotary(torch.zeros(1, dtype=torch.float32), positions[None])
    angles = (positions.float()[:, None] * rotary.inv_freq[None, :]).double().numpy()   # HF's, (T, D/2)
    for ours, theirs, exact in ((cos, hf_cos[0], np.cos(angles)), (sin, hf_sin[0], np.sin(angles))):
        assert np.array_equal(ours.numpy(), np.concatenate([exact, exact], 1).astype(np.float32))
        gap = np.abs(ours.numpy() - theirs.numpy())
        assert (gap <= np.spacing(np.maximum(np.abs(ours.numpy()), np.abs(theirs.numpy())))).all()


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
    model = load_model(path)
    tokens = (PROMPT * 6)[:model.config.max_seq_len]                  # 60 positions, or the window
    ours = model(torch.tensor([tokens]), torch.arange(len(tokens)))
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


def stack_qkv_biases_backwards(name):
    parts = ORIGINAL["sources"](name)          # (v, k, q): the same 128 rows, in the wrong places
    return parts[::-1] if name.endswith("wqkv.bias") else parts


ORIGINAL = {"rope_from_hf": config.rope_from_hf, "frequencies": llama.frequencies,
            "sources": weights.sources}
MUTANTS = {   # name -> (module, function, fake, the variant it breaks)
    "rope_parameters ignored": (config, "rope_from_hf", ignore_rope_parameters, "llama3"),
    "llama3 low/high swapped": (llama, "frequencies", swap_low_high, "llama3"),
    "linear multiplies by factor": (llama, "frequencies", scale_positions_up, "linear"),
    "q/k/v biases stacked backwards": (weights, "sources", stack_qkv_biases_backwards, "biases"),
    "qwen2's biases stacked backwards": (weights, "sources", stack_qkv_biases_backwards, "qwen2"),
}


@pytest.mark.parametrize("mutant", MUTANTS)
def test_hf_parity_catches_broken_variants(checkpoints, mutant, monkeypatch):
    # Why: a parity test that a wrong RoPE or a misplaced bias also passes proves nothing
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
    (lambda c: c["rope_parameters"].update(rope_type=["llama3"]), r"rope_type \['llama3'\]"),
    (lambda c: c["rope_parameters"].update(mscale=1.0),
     "rope_parameters.mscale .* not read by rope_type 'llama3'"),
    (lambda c: c["rope_parameters"].pop("low_freq_factor"), "'llama3' needs low_freq_factor"),
    (lambda c: c["rope_parameters"].update(partial_rotary_factor=0.5), "partial_rotary_factor 0.5"),
    (lambda c: c["rope_parameters"].update(low_freq_factor=4.0), "low_freq_factor < high_freq_factor"),
    (lambda c: c.update(rope_theta=10000.0),       # a value given in both spellings must agree
     r"rope_parameters.rope_theta is 500000.0, but rope_theta is 10000.0"),
    (lambda c: c.update(rope_scaling={"type": "linear", "factor": 2.0}),
     "rope_parameters.factor is 8.0, but rope_scaling.factor is 2.0"),
    (lambda c: c.update(rope_parameters=[1, 2]), "rope_parameters must be a JSON object"),
    (lambda c: c.update(hidden_act="gelu"), "hidden_act 'gelu'"),
    (lambda c: c.update(quantization_config={"quant_method": "fp8"}), "quantization_config"),
    (lambda c: c.update(model_type="gemma"), "model_type 'gemma'"),
])
def test_unsupported_variants_are_refused_by_name(checkpoints, tmp_path, edit, words):
    # Why: a config key the engine skipped would load and print other tokens than HF, silently
    cfg = json.loads((checkpoints["llama3"][1] / "config.json").read_text())
    edit(cfg)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=words):
        load_config(tmp_path)


# --------------------------------------------------------------------------- every decoder

def decoded(name, model, prompt, n):
    """Greedy tokens of decoder `name` with its default knobs; a second model is the target's
    first layer (speculative's self-draft, contrastive's amateur at beta 0, where it is plain)."""
    d = DECODERS[name]
    second = () if d.second is None else (EarlyExit(1),)
    steps = d.decode(model, *second, prompt, sampler=Sampler(), rng=Random(0), max_new_tokens=n,
                     **({"beta": 0.0} if name == "contrastive" else {}))
    return list(generate(steps, max_new_tokens=n))


@pytest.mark.parametrize("decoder", [d for d in DECODERS if d != "plain"])
@pytest.mark.parametrize("name", VARIANTS)
def test_every_decoder_prints_plains_tokens_on_every_variant(checkpoints, name, decoder):
    # Why: the decoders verify k rows per forward, with their own masks and positions; each
    # variant's extra math (scaled RoPE, biases, a wide head) must not tell k rows from one.
    # float64, as in conftest: a k-row and a one-row forward then cannot flip a near tie.
    model = load_model(checkpoints[name][1], dtype=torch.float64)
    prompt = PROMPT + PROMPT[:4]                                       # a repeat for the copiers
    assert decoded(decoder, model, prompt, NEW) == decoded("plain", model, prompt, NEW)


# --------------------------------------------------------------------------- the sliding window

def test_a_sliding_window_below_the_context_caps_the_context(checkpoints):
    # Why: past the window HF's Mistral stops attending to the first keys and causal attention
    # does not, so the engine runs only where the two agree and refuses the rest
    hf, path = checkpoints["mistral, window 40"]
    cfg = load_config(path)
    assert (cfg.max_seq_len, cfg.sliding_window) == (40, 40)
    assert load_config(checkpoints["mistral, window = context"][1]).max_seq_len == 256
    model, tokens = load_model(path), PROMPT * 5                      # 50 positions
    ours = model(torch.tensor([tokens]), torch.arange(50))
    assert (ours[:, 40:] - hf_logits(hf, tokens)[:, 40:]).abs().max() > 1e-2   # the cap is needed
    with pytest.raises(ValueError, match=r"exceed the model's context \(40\)"):
        KVCache.for_model(model, 41, scratch=0)


# --------------------------------------------------------------------------- fast paths

@pytest.mark.parametrize("name", ["biases", "qwen2", "head_dim 32 (H x D != C)"])
def test_prepacked_and_int4_paths_run_the_variants(checkpoints, name):
    # prepack and int4 swap every projection, biased ones too (Qwen2's q, k, v): the bias is
    # added to the packed kernel's output, so no nn.Linear is left to run unpacked
    path = checkpoints[name][1]
    tokens = torch.tensor([PROMPT])
    want = load_model(path)(tokens, torch.arange(len(PROMPT)))
    packed = prepack(load_model(path))
    torch.testing.assert_close(packed(tokens, torch.arange(len(PROMPT))), want, atol=LOGIT_ATOL, rtol=0)
    int4 = quantize_int4(load_model(path))
    got = int4(tokens, torch.arange(len(PROMPT))).float()             # 4 bits of random weights:
    assert torch.cosine_similarity(got.flatten(), want.flatten(), 0) > 0.95   # near, not equal
    for m in (packed, int4):
        assert not [n for n, x in m.named_modules() if isinstance(x, torch.nn.Linear)]
    biased = [n for n, x in int4.named_modules() if getattr(x, "bias", None) is not None]
    assert len(biased) == (0 if name.startswith("head_dim") else 8 if name == "biases" else 2), biased   # 2 layers


def test_a_4bit_bias_is_used_and_every_row_rounds_alike(checkpoints):
    # Why: the exact 4-bit path promises a row's bits whatever the row count; Qwen2's biases,
    # added to the kernel's output, must keep that, and must be there at all (dropped, the
    # logits move)
    path = checkpoints["qwen2"][1]
    model = prepack(quantize_int4(load_model(path)), batch_invariant=True)
    x, T = torch.tensor([PROMPT]), len(PROMPT)
    full = model(x, torch.arange(T))                                  # (1, T, V)
    one = torch.cat([model(x[:, :t + 1], torch.arange(t + 1), keep=[t]) for t in range(T)], 1)
    assert torch.equal(full, one)
    for block in model.layers:
        block.attention.wqkv.bias = None
    assert (model(x, torch.arange(T)) - full).abs().max() > 1e-2


# --------------------------------------------------------------------------- the CLI

TEXT = "abcabcabdefdef"


def cli_checkpoint(checkpoints, name, tmp_path, edit=None):
    """A copy of variant `name` with a byte-level tokenizer (V=128 symbols, no merges) beside it."""
    d = shutil.copytree(checkpoints[name][1], tmp_path / "ckpt")
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())[:V]        # '!'..'~' and then some
    tok = HFTokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.save(str(d / "tokenizer.json"))
    if edit is not None:
        saved_cfg = json.loads((d / "config.json").read_text())
        edit(saved_cfg)
        (d / "config.json").write_text(json.dumps(saved_cfg))
    return d


def test_cli_prints_hf_greedy_tokens_for_a_transformers5_llama3_checkpoint(checkpoints, tmp_path, capsys):
    # the checkpoint that printed other tokens than HF before rope_parameters was read
    d = cli_checkpoint(checkpoints, "llama3", tmp_path)
    prompt = Tokenizer.load(d).encode(TEXT)
    argv = ["--checkpoint", str(d), "--raw", "--prompt", TEXT, "--decoder", "plain", "--dtype", "float32",
            "--temperature", "0", "--max-new-tokens", "16", "--json"]   # fp32: HF's tokens
    assert main(argv) == 0
    assert json.loads(capsys.readouterr().out)["tokens"] == hf_greedy(checkpoints["llama3"][0], prompt, 16)


@pytest.mark.parametrize("name, edit, argv, words", [
    ("llama3", lambda c: c["rope_parameters"].update(rope_type="yarn"), [], "rope_type 'yarn'"),
    ("llama3", lambda c: c.update(model_type="qwen3"), [], "model_type 'qwen3'"),
    ("qwen2", lambda c: c.update(use_sliding_window=True), [], "use_sliding_window"),
    ("mistral, window 40", None, ["--max-new-tokens", "40"], "sliding window"),
])
def test_cli_refuses_unsupported_variants_in_one_line(checkpoints, tmp_path, capsys, name, edit, argv, words):
    d = cli_checkpoint(checkpoints, name, tmp_path, edit)
    assert main(["--checkpoint", str(d), "--raw", "--prompt", TEXT, "--decoder", "plain"] + argv) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.startswith("error: ") and words in err and len(err.splitlines()) == 1, err


# --------------------------------------------------------------------------- the config

@pytest.mark.parametrize("name", VARIANTS)
def test_parameter_count_counts_every_variant_weight(checkpoints, name):
    # check_plausible refuses a checkpoint by this count before allocating: it must be exact
    model = load_model(checkpoints[name][1])
    assert weights.parameter_count(model.config) == sum(p.numel() for p in model.parameters())


def test_configs_stay_frozen_and_hashable(checkpoints):
    # decoders and caches key on the config; a mutable field would make it unhashable
    cfg = load_config(checkpoints["llama3"][1])
    assert hash(cfg) == hash(dataclasses.replace(cfg)) and cfg.head_dim == C // 4
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.rope_scaling.factor = 2.0


@pytest.mark.parametrize("model_type", ["llama", "mistral"])
def test_absent_fields_take_hfs_defaults(tmp_path, model_type):
    # Why: a config.json may leave fields out; HF then uses its class's defaults (Mistral's
    # differ from Llama's: 8 kv heads, a 131072 context and a 4096 window), and so must we
    required = {"model_type": model_type, "hidden_size": C, "num_attention_heads": 8,
                "num_hidden_layers": 2, "intermediate_size": 96, "vocab_size": V}
    (tmp_path / "config.json").write_text(json.dumps(required))
    hf = transformers.AutoConfig.from_pretrained(tmp_path)
    ours = load_config(tmp_path)
    window = getattr(hf, "sliding_window", None)
    assert (ours.norm_eps, ours.n_kv_heads, ours.head_dim, ours.rope_theta, ours.tie_embeddings) == \
        (hf.rms_norm_eps, hf.num_key_value_heads, hf.head_dim, hf.rope_parameters["rope_theta"],
         hf.tie_word_embeddings)
    assert ours.max_seq_len == min(hf.max_position_embeddings, window or hf.max_position_embeddings)
    assert ours.rope_scaling is None and hf.rope_parameters["rope_type"] == "default"
