"""config.json -> LlamaConfig: the Llama family's variants, read strictly.

LlamaForCausalLM, MistralForCausalLM and Qwen2ForCausalLM, with HF's defaults per class; RoPE scaling (linear,
dynamic, llama3) in either spelling, transformers 4's `rope_theta` + `rope_scaling` or 5's
`rope_parameters`. Every field it reads is checked, and a setting HF's Llama would honour
but this model would not (an unknown rope_type or RoPE key, a quantization_config, another
activation, partial rotary) is refused by name: a loader that ignored it would print
fluent-looking text from the wrong model. Fields HF's Llama itself ignores are ignored here.
"""
from __future__ import annotations

import json
from pathlib import Path

from engine.llama import LlamaConfig, RopeScaling


def config_from_hf(d: dict) -> LlamaConfig:
    """From the dict of an HF `config.json` (LlamaForCausalLM, MistralForCausalLM or
    Qwen2ForCausalLM); a wrong value is a ValueError naming its field. null counts as absent
    for the optional fields.

    Mistral is Llama plus a sliding window (key j is visible to query i iff i - j < window),
    which below the window is causal attention: so a smaller window caps max_seq_len, a longer
    run is refused like any other, and sliding_window stays in the config to say why.
    Qwen2 is Llama with biases on q, k and v (always: its config has no switch for them) and
    a sliding window only where `use_sliding_window` asks, in its upper layers: that is refused.
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

    # an absent field takes HF's default for the class: MistralConfig's and Qwen2Config's
    # differ from LlamaConfig's
    mistral, qwen2 = d.get("model_type") == "mistral", d.get("model_type") == "qwen2"
    C, H = count("hidden_size"), count("num_attention_heads")
    head_dim = count("head_dim", max(C // H, 1))    # H x head_dim may differ from C (explicit)
    Hkv = count("num_key_value_heads", 8 if mistral else H)   # Qwen2Config's default is H too
    if head_dim % 2 or H % Hkv:   # RoPE rotates halves; each kv head serves H/Hkv query heads
        raise ValueError(f"need an even head_dim ({head_dim}) and num_key_value_heads ({Hkv}) "
                         f"dividing num_attention_heads ({H})")
    if d.get("quantization_config") is not None:   # packed or scaled tensors, read as plain floats
        raise ValueError(f"quantization_config {d['quantization_config']!r:.80} is not supported "
                         "(a float checkpoint, or a GGUF through tools.convert)")
    if get("hidden_act", "silu") != "silu":   # the MLP is SwiGLU: another activation would be ignored
        raise ValueError(f"hidden_act {d['hidden_act']!r} is not supported (only 'silu')")
    context = count("max_position_embeddings", 131072 if mistral else 32768 if qwen2 else 2048)
    theta, scaling = rope_from_hf(d, head_dim, context)
    window = None
    if mistral:
        for k in ("attention_bias", "mlp_bias"):   # HF's Mistral has no biases, whatever it says
            if flag(k):
                raise ValueError(f"{k} is true, but a Mistral has no biases")
        # subtle: an absent sliding_window is MistralConfig's 4096; only an explicit null is none
        window = 4096 if "sliding_window" not in d else count("sliding_window", context)
        window = window if window < context else None
    if qwen2:   # HF's Qwen2 reads neither attention_bias nor mlp_bias: q, k, v always have biases
        layer_types = get("layer_types", [])
        if flag("use_sliding_window") or not isinstance(layer_types, list) or \
                any(t != "full_attention" for t in layer_types):
            raise ValueError("use_sliding_window (or a sliding_attention layer) is not supported: "
                             "this model attends to every earlier key in every layer")
    eps = get("rms_norm_eps", 1e-6)
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not 0 < eps < 1:
        raise ValueError(f"rms_norm_eps must be a number in (0, 1), got {eps!r}")
    return LlamaConfig(
        dim=C, n_layers=count("num_hidden_layers"), n_heads=H, n_kv_heads=Hkv,
        hidden_dim=count("intermediate_size"), vocab_size=count("vocab_size"), norm_eps=float(eps),
        rope_theta=theta, rope_scaling=scaling, max_seq_len=window or context, head_dim=head_dim,
        tie_embeddings=flag("tie_word_embeddings"), attention_bias=not qwen2 and flag("attention_bias"),
        mlp_bias=not qwen2 and flag("mlp_bias"), qkv_bias=qwen2, sliding_window=window)


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
    if d.get("model_type") not in ("llama", "mistral", "qwen2"):
        raise ValueError(f"{path}: model_type {d.get('model_type')!r}, only 'llama', 'mistral' and 'qwen2' load")
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
