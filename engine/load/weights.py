"""HF-format checkpoint loading.

A checkpoint directory (config.json, model.safetensors or a sharded index, tokenizer.json,
tokenizer_config.json, generation_config.json) is the unit everything loads. Loading is
strict: every tensor maps to a parameter, every parameter is filled, every shape is checked.
A GGUF file becomes such a directory once, by `python -m tools.convert` (`make weights`).
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Callable

import torch
from safetensors import SafetensorError, safe_open

from engine.fast.machine import check_memory
from engine.llama import Llama, LlamaConfig
from engine.load.config import load_config, read_json
from engine.load.tokenizer import Tokenizer

DEFAULT_CHECKPOINT = Path(__file__).resolve().parents[2] / "weights" / "smollm2-135m-instruct"   # the clone's
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}

# HF checkpoint name -> our parameter name; {i} is the layer index. Names that share a
# parameter are stacked by rows in this order (q, k, v -> wqkv; gate, up -> w13).
PROJECTIONS = {"self_attn.q_proj": "attention.wqkv", "self_attn.k_proj": "attention.wqkv",
          "self_attn.v_proj": "attention.wqkv", "self_attn.o_proj": "attention.wo",
          "mlp.gate_proj": "feed_forward.w13", "mlp.up_proj": "feed_forward.w13",
          "mlp.down_proj": "feed_forward.w2"}
NAME_MAP = {
    "model.embed_tokens.weight": "tok_embeddings.weight",
    **{f"model.layers.{{i}}.{hf}.{p}": f"layers.{{i}}.{ours}.{p}"
       for p in ("weight", "bias") for hf, ours in PROJECTIONS.items()},
    "model.layers.{i}.input_layernorm.weight": "layers.{i}.attention_norm.weight",
    "model.layers.{i}.post_attention_layernorm.weight": "layers.{i}.ffn_norm.weight",
    "model.norm.weight": "norm.weight",
    "lm_head.weight": "output.weight",
}


def rename(table: dict[str, str], name: str) -> str | None:
    """Look a name up with its layer index factored out; None when the table lacks it.

    Example: rename(NAME_MAP, "model.layers.3.mlp.up_proj.weight") -> "layers.3.feed_forward.w13.weight"
    """
    m = re.search(r"\.(\d+)\.", name)
    key = name.replace(m[0], ".{i}.", 1) if m else name
    return table[key].format(i=m[1] if m else "") if key in table else None


def sources(name: str) -> list[str]:
    """The HF names that make up our parameter `name`, in NAME_MAP (stacking) order.

    Example: sources("layers.3.feed_forward.w13.weight")
             -> ["model.layers.3.mlp.gate_proj.weight", "model.layers.3.mlp.up_proj.weight"]
    """
    m = re.search(r"\.(\d+)\.", name)
    i = m[1] if m else ""
    return [hf.format(i=i) for hf, ours in NAME_MAP.items() if ours.format(i=i) == name]


# --------------------------------------------------------------------------- loading

def parameter_count(c: LlamaConfig) -> int:
    """Parameters of a Llama with config c: embeddings, head unless tied, L blocks, final norm."""
    D, qkv = c.head_dim, (c.n_heads + 2 * c.n_kv_heads) * c.head_dim
    block = c.dim * qkv + c.n_heads * D * c.dim + 3 * c.dim * c.hidden_dim + 2 * c.dim \
        + qkv * (c.attention_bias or c.qkv_bias) + c.dim * c.attention_bias \
        + (2 * c.hidden_dim + c.dim) * c.mlp_bias
    return c.vocab_size * c.dim * (1 if c.tie_embeddings else 2) + c.n_layers * block + c.dim


def check_plausible(ckpt_dir: Path, config: LlamaConfig, tensors: dict, device, dtype) -> None:
    """Before a single module is built: the config agrees with the tensors the files hold, and
    the weights fit in the memory the device has free. A config.json saying 10^9 layers must be
    one error line, not a hang while a meta model of 10^9 blocks is being built."""
    layers = {int(m[1]) for n in tensors if (m := re.match(r"model\.layers\.(\d+)\.", n))}
    if len(layers) < config.n_layers:   # more layers than named: the strict loop names the extra tensor
        raise ValueError(f"{ckpt_dir / 'config.json'}: num_hidden_layers is {config.n_layers}, "
                         f"but the safetensors hold {len(layers)} layers")
    embed = tensors.get("model.embed_tokens.weight", (None, None))[1]
    if embed is not None and embed != (config.vocab_size, config.dim):
        raise ValueError(f"{ckpt_dir / 'config.json'}: vocab_size x hidden_size is "
                         f"{config.vocab_size} x {config.dim}, but model.embed_tokens.weight has shape {embed}")
    n = parameter_count(config)   # a lower bound (the loaded model alone): refuse only what cannot possibly fit
    check_memory(n * dtype.itemsize, f"{ckpt_dir}: {n:,} parameters", device)


def read_tensors(ckpt_dir: Path) -> dict[str, tuple[Path, tuple[int, ...]]]:
    """Every tensor of the checkpoint: name -> (its safetensors file, its shape), headers only."""
    index = ckpt_dir / "model.safetensors.index.json"
    files = ["model.safetensors"]
    if index.is_file():
        wmap = read_json(index).get("weight_map")
        if not isinstance(wmap, dict) or not all(isinstance(f, str) and "/" not in f and f != ".."
                                                 for f in wmap.values()):
            raise ValueError(f"{index}: weight_map must map tensor names to file names beside it")
        files = sorted(set(wmap.values()))
    found = {}
    for f in files:
        if not (ckpt_dir / f).is_file():
            raise FileNotFoundError(f"{ckpt_dir / f}: missing")
        try:
            with safe_open(ckpt_dir / f, "pt") as h:
                found |= {n: (ckpt_dir / f, tuple(h.get_slice(n).get_shape())) for n in h.keys()}
        except (SafetensorError, OSError) as e:
            raise ValueError(f"{ckpt_dir / f}: not a readable safetensors file ({e})") from None
    return found


def read_tensor(file: Path, name: str) -> torch.Tensor:
    # subtle: safetensors maps the file, and while one tensor views the map every page read
    # through it stays resident (~540 MB for SmolLM2); a map per tensor, copied out, keeps
    # the loading peak near one copy of the weights
    try:
        with safe_open(file, "pt") as h:
            return h.get_tensor(name).clone()
    except (SafetensorError, OSError) as e:
        raise ValueError(f"{file}: cannot read {name} ({e})") from None


def load_model(ckpt_dir: str | Path, device: str | torch.device = "cpu",
               dtype: torch.dtype = torch.float32) -> Llama:
    ckpt_dir = Path(ckpt_dir)
    if dtype not in DTYPES.values():   # an int8 model would fail inside load_state_dict, in torch's words
        raise ValueError(f"dtype {dtype}: one of {', '.join(map(str, DTYPES.values()))}")
    config = load_config(ckpt_dir)
    tensors = read_tensors(ckpt_dir)                           # name -> (file, shape)
    check_plausible(ckpt_dir, config, tensors, device, dtype)
    with torch.device("meta"):  # no memory, no init: every tensor comes from the checkpoint
        model = Llama(config)
    expected = model.state_dict()
    get = lambda name: read_tensor(tensors[name][0], name)
    # subtle: some tied checkpoints also store the head; accept it only as an exact copy
    if config.tie_embeddings and "lm_head.weight" in tensors:
        embed = "model.embed_tokens.weight"
        if embed in tensors and not torch.equal(get("lm_head.weight"), get(embed)):
            raise ValueError(f"{ckpt_dir}: tied embeddings, yet lm_head.weight differs")
        del tensors["lm_head.weight"]
    for hf_name in tensors:
        if rename(NAME_MAP, hf_name) not in expected:
            raise ValueError(f"{ckpt_dir}: checkpoint tensor {hf_name} is not used by the model")
    state = {}
    for name, want in expected.items():
        parts = sources(name)                                  # HF names, in stacking order
        for hf_name in parts:
            if hf_name not in tensors:
                raise ValueError(f"{ckpt_dir}: checkpoint lacks {hf_name} for {name}")
        shapes = [tensors[n][1] for n in parts]
        rows = sum(sh[0] for sh in shapes if sh)
        if any(sh[1:] != tuple(want.shape[1:]) for sh in shapes) or rows != want.shape[0]:
            said = ", ".join(f"{n} has shape {sh}" for n, sh in zip(parts, shapes))
            raise ValueError(f"{ckpt_dir}: {said}; the model wants {tuple(want.shape)}"
                             + (f" stacked into {name}" if len(parts) > 1 else ""))
        t = torch.cat([get(n) for n in parts]) if len(parts) > 1 else get(parts[0])
        state[name] = t.to(device=device, dtype=dtype)
    model.load_state_dict(state, strict=True, assign=True)
    return model.eval().requires_grad_(False)


def default_checkpoint() -> Path:
    """The default model's directory; `make weights` (python -m tools.convert default) makes it."""
    if not DEFAULT_CHECKPOINT.is_dir():
        raise FileNotFoundError(f"{DEFAULT_CHECKPOINT} does not exist: run `make weights` "
                                "(or python -m tools.convert default)")
    return DEFAULT_CHECKPOINT


def second_checkpoint(target: str | Path, checkpoint: str | Path, load: Callable[[str | Path], Llama]) -> Llama:
    """A draft or an amateur from its checkpoint directory, loaded by `load` (the target's
    path), or one ValueError where its tokenizer does not give the target's ids to the same text."""
    load_config(checkpoint)   # a missing or malformed checkpoint: its own error, first
    why = Tokenizer.load(target).same_ids(Tokenizer.load(checkpoint))
    if why is not None:
        raise ValueError(f"{checkpoint}: its tokenizer is not the target's ({why}); a draft or an "
                         "amateur must share the target's tokenizer")
    return load(checkpoint)


def family(target: str | Path) -> list[Path]:
    """The smaller checkpoints beside `target` (in its folder) whose tokenizer gives its ids:
    the drafts of its family that --draft auto weighs, smallest first. Configs are read first
    (cheap), tokenizers only for the smaller ones; a folder that does not load is passed over."""
    target = Path(target)
    size = parameter_count(load_config(target))
    smaller = []
    for d in sorted(p for p in target.parent.iterdir() if p.is_dir() and p.resolve() != target.resolve()):
        try:
            n = parameter_count(load_config(d))
        except (OSError, ValueError):
            continue
        if n < size:
            smaller.append((n, d))
    mine = Tokenizer.load(target)
    found = []
    for _, d in sorted(smaller):
        try:
            if mine.same_ids(Tokenizer.load(d)) is None:
                found.append(d)
        except (OSError, ValueError):
            continue
    return found
