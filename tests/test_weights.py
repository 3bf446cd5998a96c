"""GGUF -> HF-format conversion and strict checkpoint loading.

Most tests build a tiny synthetic GGUF with gguf.GGUFWriter, so they need no weights; the
ones on the real converted SmolLM2 checkpoint skip when it is absent.
"""
import hashlib
import json
from pathlib import Path
import shutil

import gguf
import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer, pre_tokenizers

from engine.llama import RopeScaling, apply_rope, frequencies, rope
from engine.load.weights import DEFAULT_CHECKPOINT, load_model, rename
from tools.convert import GGUF_MAP, convert, main, unpermute_qk

C, L, H, HKV, F = 32, 2, 4, 2, 64  # D = 8; C and F are multiples of 32 so Q8_0 / Q4_1 fit
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TOKENS = SPECIALS + sorted(pre_tokenizers.ByteLevel.alphabet()) + ["Ġt", "he", "Ġthe"]
MERGES = ["Ġ t", "h e", "Ġt he"]
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
            "{% endfor %}")
QUANT = {"blk.0.attn_q.weight": gguf.GGMLQuantizationType.Q4_1,
         "blk.1.ffn_down.weight": gguf.GGMLQuantizationType.Q8_0}


def llamacpp_permute(w, n_head):
    # what llama.cpp's converter does to HF Q/K rows: per head, (0..D-1) -> (0, D/2, 1, D/2+1, ...)
    rows, cols = w.shape
    return w.reshape(n_head, 2, rows // n_head // 2, cols).swapaxes(1, 2).reshape(rows, cols)


def hf_tensors(tie=False, seed=0):
    """Random HF-layout ([out, in]) float32 tensors, keyed by GGUF name."""
    rng = np.random.default_rng(seed)
    shapes = {"token_embd.weight": (len(TOKENS), C), "output_norm.weight": (C,)}
    if not tie:
        shapes["output.weight"] = (len(TOKENS), C)
    for i in range(L):
        shapes |= {f"blk.{i}.attn_q.weight": (C, C), f"blk.{i}.attn_k.weight": (HKV * C // H, C),
                   f"blk.{i}.attn_v.weight": (HKV * C // H, C),
                   f"blk.{i}.attn_output.weight": (C, C),
                   f"blk.{i}.ffn_gate.weight": (F, C), f"blk.{i}.ffn_up.weight": (F, C),
                   f"blk.{i}.ffn_down.weight": (C, F), f"blk.{i}.attn_norm.weight": (C,),
                   f"blk.{i}.ffn_norm.weight": (C,)}
    return {n: rng.standard_normal(s).astype(np.float32) for n, s in shapes.items()}


def write_gguf(path, tensors, arch="llama", hkv=HKV, ff=F, theta=10000.0, extra=None):
    """A GGUF of `tensors` (HF layout, permuted here as llama.cpp does); extra(writer) adds keys."""
    w = gguf.GGUFWriter(path, arch)
    w.add_block_count(L), w.add_context_length(128), w.add_embedding_length(C)
    w.add_feed_forward_length(ff), w.add_head_count(H), w.add_head_count_kv(hkv)
    w.add_rope_freq_base(theta), w.add_layer_norm_rms_eps(1e-5)
    if extra is not None:
        extra(w)
    w.add_tokenizer_model("gpt2"), w.add_tokenizer_pre("smollm"), w.add_token_list(TOKENS)
    w.add_token_types([3] * len(SPECIALS) + [1] * (len(TOKENS) - len(SPECIALS)))
    w.add_token_merges(MERGES), w.add_bos_token_id(1), w.add_eos_token_id(2)
    w.add_chat_template(TEMPLATE)
    for name, t in tensors.items():
        heads = {"attn_q": H, "attn_k": HKV}.get(name.split(".")[-2])   # the tensors' own heads
        t = llamacpp_permute(t, heads) if heads else t
        if name in QUANT:
            w.add_tensor(name, gguf.quants.quantize(t, QUANT[name]), raw_dtype=QUANT[name])
        else:
            w.add_tensor(name, t)
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file()
    w.close()
    return path


def expected(name, t):
    # what survives quantisation; blocks lie within a row, so the Q/K row reorder commutes with it
    if name not in QUANT:
        return t
    return gguf.quants.dequantize(gguf.quants.quantize(t, QUANT[name]), QUANT[name])


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    d = tmp_path_factory.mktemp("convert")
    return convert(write_gguf(d / "tiny.gguf", hf_tensors()), d / "ckpt")


def corrupted(ckpt, tmp_path, edit):
    out = shutil.copytree(ckpt, tmp_path / "ckpt")
    tensors = load_file(out / "model.safetensors")
    edit(tensors)
    save_file(tensors, out / "model.safetensors")
    return out


# --------------------------------------------------------------------------- Q/K permutation

@given(st.integers(1, 4), st.integers(1, 4), st.integers(1, 5))
def test_unpermute_inverts_llamacpp_permute(n_head, half, cols):
    # the converter must restore HF rows exactly, for every head count and head size
    w = np.arange(n_head * 2 * half * cols, dtype=np.float32).reshape(-1, cols)
    assert np.array_equal(unpermute_qk(llamacpp_permute(w, n_head), n_head), w)


def test_interleaved_rope_on_gguf_rows_equals_half_split_rope_on_hf_rows():
    # why we unpermute: llama.cpp rotates adjacent pairs of the permuted rows, llama.py rotates
    # (i, i+D/2) of HF rows; both are the same rotation, reached only through the reorder
    g = torch.Generator().manual_seed(0)
    D, T = 8, 5
    q_hf = torch.randn(1, 1, T, D, generator=g)                         # (B, H, T, D)
    cos, sin = rope(torch.arange(T), D, 10000.0, torch.float32)         # (T, D)
    q_gg = torch.from_numpy(llamacpp_permute(q_hf[0, 0].T.numpy(), 1).T.copy())  # (T, D) pairs
    a, b = q_gg[:, 0::2], q_gg[:, 1::2]
    c, s = cos[:, : D // 2], sin[:, : D // 2]
    rotated = torch.stack([a * c - b * s, a * s + b * c], dim=-1).reshape(T, D)   # interleaved
    back = torch.from_numpy(unpermute_qk(rotated.T.numpy().copy(), 1).T.copy())
    torch.testing.assert_close(back, apply_rope(q_hf, cos, sin)[0, 0], atol=1e-6, rtol=0)


# --------------------------------------------------------------------------- conversion

def test_convert_round_trip_gives_the_hf_tensors(ckpt):
    # every weight lands under its HF name, in [out, in] layout, Q/K back in HF row order
    hf = load_file(ckpt / "model.safetensors")
    source = hf_tensors()
    assert len(hf) == len(source)
    for gguf_name, t in source.items():
        hf_name = rename(GGUF_MAP, gguf_name)
        assert np.array_equal(hf[hf_name].numpy(), expected(gguf_name, t)), hf_name
    model = load_model(ckpt)
    wq, wk, wv = (hf[f"model.layers.0.self_attn.{n}_proj.weight"] for n in "qkv")
    assert torch.equal(model.layers[0].attention.wqkv.weight, torch.cat([wq, wk, wv]))
    assert torch.equal(model.output.weight, hf["lm_head.weight"])
    cfg = model.config
    assert (cfg.dim, cfg.n_layers, cfg.n_heads, cfg.n_kv_heads, cfg.hidden_dim, cfg.vocab_size) == \
        (C, L, H, HKV, F, len(TOKENS))
    assert not cfg.tie_embeddings


def test_convert_writes_the_hf_side_files(ckpt):
    # transformers and our Tokenizer read these; the manifest lets `sha256sum -c` check them
    config = json.loads((ckpt / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["head_dim"] == C // H
    generation = json.loads((ckpt / "generation_config.json").read_text())
    assert generation == {"bos_token_id": 1, "eos_token_id": 2}
    tok_config = json.loads((ckpt / "tokenizer_config.json").read_text())
    assert tok_config["eos_token"] == "<|im_end|>" and tok_config["chat_template"] == TEMPLATE
    assert (ckpt / "chat_template.jinja").read_text() == TEMPLATE
    lines = (ckpt / "MANIFEST.sha256").read_text().splitlines()
    listed = {line.split("  ")[1] for line in lines}
    assert listed == {p.name for p in ckpt.iterdir()} - {"MANIFEST.sha256"}
    for line in lines:
        digest, name = line.split("  ")
        assert hashlib.sha256((ckpt / name).read_bytes()).hexdigest() == digest


def test_converted_tokenizer_is_byte_level_bpe_with_smollm_digits(ckpt):
    # specials are matched whole, merges apply in rank order, each digit is its own token
    tok = Tokenizer.from_file(str(ckpt / "tokenizer.json"))
    ids = tok.encode("<|im_start|>the 12", add_special_tokens=False).ids
    assert [tok.id_to_token(i) for i in ids] == ["<|im_start|>", "t", "he", "Ġ", "1", "2"]
    assert tok.encode(" the").tokens == ["Ġthe"]
    assert tok.decode(ids, skip_special_tokens=False) == "<|im_start|>the 12"


def test_gguf_without_output_converts_to_tied_embeddings(tmp_path):
    ckpt = convert(write_gguf(tmp_path / "t.gguf", hf_tensors(tie=True)), tmp_path / "ckpt")
    assert json.loads((ckpt / "config.json").read_text())["tie_word_embeddings"] is True
    assert "lm_head.weight" not in load_file(ckpt / "model.safetensors")
    assert not hasattr(load_model(ckpt), "output")


@pytest.mark.parametrize("case, error, words", [
    ("missing", FileNotFoundError, "no such file"),
    ("not_gguf", ValueError, "not a readable GGUF"),
    ("gpt2_arch", ValueError, "architecture 'gpt2'"),
    ("exists", ValueError, "already exists"),
    ("parent_is_a_file", ValueError, "cannot write a checkpoint there"),
])
def test_convert_refuses_bad_input_with_a_clear_message(tmp_path, case, error, words):
    src, out = tmp_path / "in.gguf", tmp_path / "out"
    if case == "not_gguf":
        src.write_bytes(b"definitely not a gguf file")
    elif case == "gpt2_arch":
        write_gguf(src, hf_tensors(), arch="gpt2")
    elif case == "exists":
        write_gguf(src, hf_tensors())
        out.mkdir()
    elif case == "parent_is_a_file":
        write_gguf(src, hf_tensors())
        (tmp_path / "file").write_text("")
        out = tmp_path / "file" / "out"
    with pytest.raises(error, match=words):
        convert(src, out)


def test_failed_conversion_leaves_no_output_dir(tmp_path):
    # a reader must never find a half-written checkpoint, nor temp dirs piling up beside it
    tensors = hf_tensors() | {"blk.0.mystery.weight": np.zeros(4, np.float32)}
    src = write_gguf(tmp_path / "bad.gguf", tensors)
    with pytest.raises(ValueError, match="blk.0.mystery.weight"):
        convert(src, tmp_path / "out")
    assert [p.name for p in tmp_path.iterdir()] == ["bad.gguf"]


def test_cli_reports_errors_in_one_line_and_exits_2(tmp_path, capsys):
    assert main(["convert", str(tmp_path / "none.gguf"), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "none.gguf" in err and "Traceback" not in err


@pytest.mark.parametrize("case, words", [
    ("head_count_kv 1",
     r"blk.0.attn_k.weight has shape \(16, 32\), but the metadata .*head_count_kv 1.* make it \(8, 32\)"),
    ("feed_forward_length 96", r"blk.0.ffn_gate.weight has shape \(64, 32\)"),
    ("key_length 4", r"blk.0.attn_q.weight has shape \(32, 32\)"),
    ("a block lacks a tensor", "lacks blk.1.ffn_up.weight"),
    ("a stray tensor", "blk.0.mystery.weight has no HF Llama counterpart"),
])
def test_gguf_whose_metadata_disagrees_with_its_tensors_is_refused_before_dequantising(
        tmp_path, monkeypatch, case, words):
    # Why: a wrong head count still "converts" (the Q/K unpermute reshapes any row count that
    # divides), then fails to load, or worse; it must be one error before any weight is touched
    tensors, kw = hf_tensors(), {}
    if case == "head_count_kv 1":
        kw["hkv"] = 1
    elif case == "feed_forward_length 96":
        kw["ff"] = 96
    elif case == "key_length 4":
        kw["extra"] = lambda w: (w.add_key_length(4), w.add_value_length(4), w.add_rope_dimension_count(4))
    elif case == "a block lacks a tensor":
        del tensors["blk.1.ffn_up.weight"]
    else:
        tensors["blk.0.mystery.weight"] = np.zeros(4, np.float32)
    src = write_gguf(tmp_path / "bad.gguf", tensors, **kw)
    monkeypatch.setattr("tools.convert.hf_tensors", lambda *a: pytest.fail("dequantised anyway"))
    with pytest.raises(ValueError, match=words):
        convert(src, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_gguf_with_an_explicit_head_size_converts_and_loads(tmp_path):
    # attention.key_length 16 with 4 heads of a 32-wide model: H x D = 64 != C
    D = 16
    tensors = hf_tensors()
    for i in range(L):
        rng = np.random.default_rng(i)
        tensors |= {f"blk.{i}.attn_q.weight": rng.standard_normal((H * D, C)).astype(np.float32),
                    f"blk.{i}.attn_k.weight": rng.standard_normal((HKV * D, C)).astype(np.float32),
                    f"blk.{i}.attn_v.weight": rng.standard_normal((HKV * D, C)).astype(np.float32),
                    f"blk.{i}.attn_output.weight": rng.standard_normal((C, H * D)).astype(np.float32)}
    extra = lambda w: (w.add_key_length(D), w.add_value_length(D), w.add_rope_dimension_count(D))
    ckpt = convert(write_gguf(tmp_path / "wide.gguf", tensors, extra=extra), tmp_path / "ckpt")
    model = load_model(ckpt)
    assert model.config.head_dim == D and model.config.dim == C
    hf = load_file(ckpt / "model.safetensors")
    assert np.array_equal(hf["model.layers.1.self_attn.k_proj.weight"].numpy(), tensors["blk.1.attn_k.weight"])


# --------------------------------------------------------------------------- RoPE scaling in GGUF

def llamacpp_divisors(D, theta, factor, low, high, n0):
    # what llama.cpp's converter writes as rope_freqs.weight for HF's llama3 rope_scaling
    # (its angle is p f_i / d_i), in float64 rounded to float32 as it does
    out = []
    for i in range(D // 2):
        w = 2 * np.pi * theta ** (2 * i / D)
        if w < n0 / high:
            out.append(1.0)
        elif w > n0 / low:
            out.append(factor)
        else:
            a = (n0 / w - low) / (high - low)
            out.append(1 / ((1 - a) / factor + a))
    return np.array(out, dtype=np.float32)


def with_rope_freqs(divisors):
    return hf_tensors() | {"rope_freqs.weight": divisors}


def test_llamacpp_llama3_rope_freqs_convert_to_the_equivalent_llama3_config(tmp_path):
    # D = 8 and theta 500000 give wavelengths 6, 167, 4443, 118000: with n0 = 256 one of each
    # band (kept, blended, divided), so the blended one pins n0 (GGUF does not store it)
    divisors = llamacpp_divisors(C // H, 500000.0, 8.0, 1.0, 4.0, 256)
    assert 1 < divisors[1] < 8 and divisors[0] == 1 and divisors[3] == 8
    src = write_gguf(tmp_path / "l3.gguf", with_rope_freqs(divisors), theta=500000.0)
    ckpt = convert(src, tmp_path / "ckpt")
    config = json.loads((ckpt / "config.json").read_text())
    assert config["rope_scaling"] == {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                      "high_freq_factor": 4.0, "original_max_position_embeddings": 256}
    assert "rope_freqs.weight" not in load_file(ckpt / "model.safetensors")
    cfg = load_model(ckpt).config
    f = 500000.0 ** (-torch.arange(0, C // H, 2, dtype=torch.float64) / (C // H))
    ours = frequencies(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, torch.float64)
    torch.testing.assert_close(ours, f / torch.from_numpy(divisors).double(), rtol=1e-6, atol=0)


def test_llamacpp_linear_rope_scaling_converts_to_hf_linear(tmp_path):
    extra = lambda w: (w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR), w.add_rope_scaling_factor(4.0))
    ckpt = convert(write_gguf(tmp_path / "lin.gguf", hf_tensors(), extra=extra), tmp_path / "ckpt")
    assert load_model(ckpt).config.rope_scaling == RopeScaling("linear", 4.0, original_context=128)


@pytest.mark.parametrize("case, words", [
    ("rope_freqs no llama3 reproduces", "no llama3 scaling"),
    ("yarn", "RoPE scaling 'yarn' unsupported"),
    ("rope_freqs of the wrong length", "rope_freqs.weight must hold 4 divisors"),
])
def test_gguf_rope_scaling_we_cannot_map_is_refused_by_name(tmp_path, case, words):
    divisors = llamacpp_divisors(C // H, 500000.0, 8.0, 1.0, 4.0, 256)
    if case == "rope_freqs no llama3 reproduces":
        divisors[2] = 3.0                       # a long wave divided by 3, not by factor 8
        tensors, extra = with_rope_freqs(divisors), None
    elif case == "yarn":
        tensors, extra = hf_tensors(), lambda w: w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    else:
        tensors, extra = with_rope_freqs(np.ones(3, np.float32)), None
    with pytest.raises(ValueError, match=words):
        convert(write_gguf(tmp_path / "x.gguf", tensors, theta=500000.0, extra=extra), tmp_path / "out")


# --------------------------------------------------------------------------- strict loading

@pytest.mark.parametrize("edit, words", [
    (lambda t: t.update({"model.norm.weight": torch.ones(C + 1)}), "model.norm.weight has shape"),
    (lambda t: t.update({"model.layers.0.self_attn.k_proj.weight": torch.zeros(4, C + 1)}),
     r"k_proj.weight has shape \(4, %d\).*stacked into layers.0.attention.wqkv" % (C + 1)),
    (lambda t: t.update({"model.norm.weight": torch.ones(C, 1)}), "model.norm.weight has shape"),
    (lambda t: t.pop("model.layers.1.mlp.up_proj.weight"),
     "lacks model.layers.1.mlp.up_proj.weight for layers.1.feed_forward.w13.weight"),
    (lambda t: t.update({"model.layers.0.self_attn.q_proj.bias": torch.zeros(C)}),
     "q_proj.bias is not used"),
    (lambda t: t.update({"model.layers.9.mlp.up_proj.weight": torch.zeros(F, C)}),
     "layers.9.mlp.up_proj"),
])
def test_load_is_strict_and_names_the_tensor(ckpt, tmp_path, edit, words):
    # a silently skipped or misshapen tensor would give a model that runs and talks nonsense
    with pytest.raises(ValueError, match=words):
        load_model(corrupted(ckpt, tmp_path, edit))


def test_load_refuses_corrupt_or_missing_files(ckpt, tmp_path):
    with pytest.raises(FileNotFoundError, match="no such checkpoint"):
        load_model(tmp_path / "nowhere")
    bad = shutil.copytree(ckpt, tmp_path / "bad")
    data = (bad / "model.safetensors").read_bytes()
    for broken in (b"\x00" * 100, data[:len(data) // 2]):      # garbage; a download cut short
        (bad / "model.safetensors").write_bytes(broken)
        with pytest.raises(ValueError, match="not a readable safetensors"):
            load_model(bad)
    (bad / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_model(bad)


def test_load_casts_to_the_requested_dtype(ckpt):
    model = load_model(ckpt, dtype=torch.float64)
    assert {p.dtype for p in model.parameters()} == {torch.float64}
    assert not any(p.is_meta for p in model.parameters())


@pytest.mark.skipif(not Path("/proc/self/maps").is_file(), reason="needs Linux /proc")
def test_loaded_model_does_not_pin_the_mapped_checkpoint(ckpt):
    # safetensors maps the file; one tensor left viewing the map (say the embeddings, which
    # prepack keeps) holds every page read while loading resident: ~540 MB more on SmolLM2
    model = load_model(ckpt)
    maps = Path("/proc/self/maps").read_text()
    assert str((ckpt / "model.safetensors").resolve()) not in maps
    assert model.tok_embeddings.weight.abs().sum() > 0      # the copies are what the model holds


# --------------------------------------------------------------------------- real checkpoint

real = pytest.mark.skipif(not DEFAULT_CHECKPOINT.is_dir(), reason="run `make weights` first")
GOLDEN = json.loads((Path(__file__).parent / "golden.json").read_text())


@pytest.mark.slow
@pytest.mark.kernels
@real
def test_real_checkpoint_reproduces_hf_greedy_tokens():
    # golden.json holds HF transformers' greedy continuations of this very checkpoint; one
    # teacher-forced forward must put its argmax on each of them (weights, layout, RoPE)
    model = load_model(DEFAULT_CHECKPOINT)
    assert model.config.tie_embeddings and model.config.n_layers == 30
    for case in GOLDEN["cases"]:
        tokens = case["input_ids"] + case["output_ids"][:-1]
        logits = model(torch.tensor([tokens]), torch.arange(len(tokens)))        # (1, T, V)
        greedy = logits[0, len(case["input_ids"]) - 1:].argmax(-1).tolist()
        assert greedy == case["output_ids"], case["prompt"]
