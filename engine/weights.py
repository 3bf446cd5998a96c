"""HF-format checkpoint loading.

A checkpoint directory (config.json, model.safetensors or a sharded index, tokenizer.json,
tokenizer_config.json, generation_config.json) is the unit everything loads. Loading is
strict: every tensor maps to a parameter, every parameter is filled, every shape is checked.
A GGUF file becomes such a directory once, by `python -m tools.convert` (`make weights`).
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from engine.kvcache import check_fits
from engine.llama import Llama, LlamaConfig, RopeScaling

DEFAULT_CHECKPOINT = Path(__file__).resolve().parent.parent / "weights" / "smollm2-135m-instruct"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}

# HF checkpoint name -> our parameter name; {i} is the layer index. Names that share a
# parameter are stacked by rows in this order (q, k, v -> wqkv; gate, up -> w13).
LINEAR = {"self_attn.q_proj": "attention.wqkv", "self_attn.k_proj": "attention.wqkv",
          "self_attn.v_proj": "attention.wqkv", "self_attn.o_proj": "attention.wo",
          "mlp.gate_proj": "feed_forward.w13", "mlp.up_proj": "feed_forward.w13",
          "mlp.down_proj": "feed_forward.w2"}
NAME_MAP = {
    "model.embed_tokens.weight": "tok_embeddings.weight",
    **{f"model.layers.{{i}}.{hf}.{p}": f"layers.{{i}}.{ours}.{p}"
       for p in ("weight", "bias") for hf, ours in LINEAR.items()},
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

def config_from_hf(d: dict) -> LlamaConfig:
    """From the dict of an HF `config.json` (LlamaForCausalLM or MistralForCausalLM); a wrong
    value is a ValueError naming its field. null counts as absent for the optional fields.

    Mistral is Llama plus a sliding window (key j is visible to query i iff i - j < window),
    which below the window is causal attention: so a smaller window caps max_seq_len, a longer
    run is refused like any other, and sliding_window stays in the config to say why.
    """
    if not isinstance(d, dict):
        raise ValueError(f"expected a JSON object, got {type(d).__name__}")
    get = lambda k, default=None: default if d.get(k) is None else d[k]

    def count(k, default=None, top=2**31 - 1):   # int32 indexing; load_model checks memory
        v = get(k, default)
        if v is None:
            raise ValueError(f"lacks {k!r}")
        # subtle: bool is an int in Python, and "576" or 576.0 would silently mean other things
        if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= top:
            raise ValueError(f"{k} must be an integer in [1, {top}], got {v!r}")
        return v

    def flag(k):
        v = get(k, False)
        if not isinstance(v, bool):
            raise ValueError(f"{k} must be true or false, got {v!r}")
        return v

    # an absent field takes HF's default for the class: MistralConfig's differ from LlamaConfig's
    mistral = d.get("model_type") == "mistral"
    C, H = count("hidden_size"), count("num_attention_heads")
    head_dim = count("head_dim", max(C // H, 1))    # H x head_dim may differ from C (explicit)
    Hkv = count("num_key_value_heads", 8 if mistral else H)
    if head_dim % 2 or H % Hkv:   # RoPE rotates halves; each kv head serves H/Hkv query heads
        raise ValueError(f"need an even head_dim ({head_dim}) and num_key_value_heads ({Hkv}) "
                         f"dividing num_attention_heads ({H})")
    if d.get("quantization_config") is not None:   # packed or scaled tensors, read as plain floats
        raise ValueError(f"quantization_config {d['quantization_config']!r:.80} is not supported "
                         "(a float checkpoint, or a GGUF through tools.convert)")
    if get("hidden_act", "silu") != "silu":   # the MLP is SwiGLU: another activation would be ignored
        raise ValueError(f"hidden_act {d['hidden_act']!r} is not supported (only 'silu')")
    context = count("max_position_embeddings", 131072 if mistral else 2048)
    theta, scaling = rope_from_hf(d, head_dim, context)
    window = None
    if mistral:
        for k in ("attention_bias", "mlp_bias"):   # HF's Mistral has no biases, whatever it says
            if flag(k):
                raise ValueError(f"{k} is true, but a Mistral has no biases")
        # subtle: an absent sliding_window is MistralConfig's 4096; only an explicit null is none
        window = 4096 if "sliding_window" not in d else count("sliding_window", context)
        window = window if window < context else None
    eps = get("rms_norm_eps", 1e-6)
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not 0 < eps < 1:
        raise ValueError(f"rms_norm_eps must be a number in (0, 1), got {eps!r}")
    return LlamaConfig(
        dim=C, n_layers=count("num_hidden_layers"), n_heads=H, n_kv_heads=Hkv,
        hidden_dim=count("intermediate_size"), vocab_size=count("vocab_size"), norm_eps=float(eps),
        rope_theta=theta, rope_scaling=scaling, max_seq_len=window or context, head_dim=head_dim,
        tie_embeddings=flag("tie_word_embeddings"), attention_bias=flag("attention_bias"),
        mlp_bias=flag("mlp_bias"), sliding_window=window)


# what each rope_type reads besides rope_type and rope_theta (HF's Llama, transformers 4 and 5)
ROPE_KEYS = {"default": set(), "linear": {"factor"}, "dynamic": {"factor"},
             "llama3": {"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"}}


def rope_from_hf(d: dict, head_dim: int, context: int) -> tuple[float, RopeScaling | None]:
    """rope_theta and the scaling, from either spelling: top-level `rope_theta` + `rope_scaling`
    (transformers 4) or `rope_parameters` holding both (transformers 5). A value given twice
    must agree; an unknown rope_type or a key the type does not read is refused by name, since
    ignoring it would put every token at the wrong angle and still print fluent-looking text."""
    seen = {"rope_theta": ("rope_theta", d["rope_theta"])} if d.get("rope_theta") is not None else {}
    for field in ("rope_scaling", "rope_parameters"):
        p = d.get(field)
        if p is not None and not isinstance(p, dict):
            raise ValueError(f"{field} must be a JSON object, got {p!r}")
        for key, v in (p or {}).items():
            k = "rope_type" if key == "type" else key         # the older spelling of the same key
            if k in seen and seen[k][1] != v:
                raise ValueError(f"{field}.{key} is {v!r}, but {seen[k][0]} is {seen[k][1]!r}")
            seen[k] = (f"{field}.{key}", v)
    val = {k: v for k, (_, v) in seen.items()}
    kind = val.pop("rope_type", "default")
    if not isinstance(kind, str) or kind not in ROPE_KEYS:   # subtle: a list is unhashable
        raise ValueError(f"rope_type {kind!r} is not supported (only {', '.join(ROPE_KEYS)})")
    if val.pop("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError(f"partial_rotary_factor {seen['partial_rotary_factor'][1]!r} is not supported (only 1.0)")
    for k in sorted(set(val) - ROPE_KEYS[kind] - {"rope_theta"}):
        raise ValueError(f"{seen[k][0]} ({val[k]!r}) is not read by rope_type {kind!r}; refusing it "
                         "rather than ignoring it")
    for k in sorted(ROPE_KEYS[kind] - set(val)):
        raise ValueError(f"rope_type {kind!r} needs {k}")

    def real(k, lo=0.0):
        v = val.get(k, 10000.0)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not lo < v < 1e30:
            raise ValueError(f"{seen[k][0]} must be a number in ({lo}, 1e30), got {v!r}")
        return float(v)
    theta = real("rope_theta", 1.0)
    if kind == "default":
        return theta, None
    n0 = val.get("original_max_position_embeddings", context)
    if isinstance(n0, bool) or not isinstance(n0, int) or n0 < 1:
        raise ValueError(f"original_max_position_embeddings must be a positive integer, got {n0!r}")
    s = RopeScaling(kind, real("factor"), original_context=n0)
    if kind == "dynamic" and head_dim <= 2:       # theta' has the exponent D / (D - 2)
        raise ValueError(f"rope_type 'dynamic' needs head_dim > 2, got {head_dim}")
    if kind == "llama3":
        low, high = real("low_freq_factor"), real("high_freq_factor")
        if not low < high:   # a = (n0 / w - low) / (high - low)
            raise ValueError(f"llama3 RoPE needs low_freq_factor < high_freq_factor, got {low} and {high}")
        s = RopeScaling(kind, s.factor, low, high, n0)
    return theta, s


def load_config(ckpt_dir: str | Path) -> LlamaConfig:
    """config.json, validated field by field; every error names the file and the field."""
    path = Path(ckpt_dir) / "config.json"
    if not Path(ckpt_dir).is_dir():
        raise FileNotFoundError(f"{ckpt_dir}: no such checkpoint directory")
    if not path.is_file():
        raise FileNotFoundError(f"{path}: missing (not an HF-format checkpoint?)")
    d = read_json(path)
    if d.get("model_type") not in ("llama", "mistral"):
        raise ValueError(f"{path}: model_type {d.get('model_type')!r}, only 'llama' and 'mistral' load")
    try:
        return config_from_hf(d)
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None


def read_json(path: Path) -> dict:
    """The JSON object in `path`, {} if the file is missing; anything else is a ValueError naming it."""
    if not path.is_file():
        return {}
    try:
        d = json.loads(path.read_bytes().decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise ValueError(f"{path}: not valid JSON ({str(e).splitlines()[0][:200]})") from None
    if not isinstance(d, dict):
        raise ValueError(f"{path}: expected a JSON object, got a {type(d).__name__}")
    return d


def parameter_count(c: LlamaConfig) -> int:
    """Parameters of a Llama with config c: embeddings, head unless tied, L blocks, final norm."""
    D, qkv = c.head_dim, (c.n_heads + 2 * c.n_kv_heads) * c.head_dim
    block = c.dim * qkv + c.n_heads * D * c.dim + 3 * c.dim * c.hidden_dim + 2 * c.dim \
        + (qkv + c.dim) * c.attention_bias + (2 * c.hidden_dim + c.dim) * c.mlp_bias
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
    check_fits(n * dtype.itemsize, f"{ckpt_dir}: {n:,} parameters", device)


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
