"""The engine from Python: what `python -m engine.run` does, without its flags (README, "Python API").

    from engine.api import Engine
    llm = Engine.load()                              # the default model; or Engine.load(path)
    print(llm.generate("What is the capital of France?", max_new_tokens=20))
    for text in llm.stream("Name three colours.", decoder="lookahead", window=4):
        print(text, end="", flush=True)
    print(llm.stats.n_tokens, llm.stats.n_forwards)  # the last call's engine.generate.Stats

`Engine.load`'s keywords are the CLI's loading flags, `tokens`' its decoding ones: a decoder by
name, its knobs as keywords, `second=` a layer count or a Llama, `adaptive` as --adaptive,
priced as the CLI prices. A str prompt is chat-templated as there; a list of ids is sent as it
is. A bad argument is a ValueError before any token (a decoder's knob: at its first token's
read), as the CLI's `error:` lines are.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import torch

from engine.aot import Compiled, compile_step
from engine.cost import calibrated, draft_price
from engine.decoders import DECODERS
from engine.generate import Stats, generate
from engine.llama import Llama, LlamaConfig
from engine.packed import exact_by_default, prepack, quantize_int4
from engine.policy import Prices, four_bit_copy
from engine.sampling import Random, Sampler, check_ids
from engine.tokenizer import StreamDecoder, Tokenizer
from engine.weights import default_checkpoint, load_model


def build(checkpoint, *, dtype: torch.dtype = torch.float32, device: str = "cpu", int4: bool = False,
          packed: bool = True, batch_invariant: bool | None = None) -> Llama:
    """The model as the CLI loads it: on `device` (cpu, cuda[:N]) in `dtype`; int4: --int4, the
    layer weights in 4-bit groups with bf16 activations (CPU; `dtype` is then bf16's); packed:
    the oneDNN matmuls (--no-prepack: False); batch_invariant: --batch-invariant (CPU or CUDA),
    every decoder's tokens plain's bit for bit (fp32, bf16, int4); None, as the CLI: on where
    it costs a one-row step nothing, bf16 and int4 on a CPU (packed.exact_by_default)."""
    device = check_device(device)
    if batch_invariant and not packed:   # as the CLI refuses --batch-invariant --no-prepack
        raise ValueError("batch_invariant sets the packed path's kernels: it has no effect with packed=False")
    if int4:   # quantized from the fp32 weights, so that Q4_1 grids come back exactly
        model = quantize_int4(load_model(checkpoint, device, torch.float32))
    else:
        model = load_model(checkpoint, device, dtype)
    if not packed:
        return model
    return prepack(model, exact_by_default(model) if batch_invariant is None else batch_invariant)


def check_device(name, what: str = "device") -> torch.device:
    """`name` as torch understands it, on a device that exists here; else one ValueError."""
    try:
        d = torch.device(name)
    except (RuntimeError, ValueError, TypeError) as e:
        raise ValueError(f"{what} {name!r}: not a device ({str(e).splitlines()[0]})") from None
    if d.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"{what} {name}: CUDA is not available here")
    if d.type == "cuda" and d.index is not None and d.index >= torch.cuda.device_count():
        raise ValueError(f"{what} {name}: there are {torch.cuda.device_count()} CUDA devices")
    return d


def prices(model: Llama, second=None, table: dict | None = None, draft: float | None = None,
           notify: Callable[[str], None] | None = None) -> Prices:
    """The policy's prices, for the CLI and the API alike: `table` or this machine's k-row costs
    for `model`, and `draft` or, for a 4-bit copy of it, that draft's measured price; each
    measured on first use and kept (engine/cost.py, `notify` hears where). On an inexact path
    (int4 or bf16 without their exact kernels) a price moves the tokens too, so both must read
    the same."""
    table = calibrated(model, notify=notify) if table is None else table
    if draft is None and four_bit_copy(model, second):
        draft = draft_price(model, second, notify=notify)
    return Prices(table, draft)


@dataclass
class Engine:
    model: Llama
    tokenizer: Tokenizer
    stats: Stats | None = None     # of the last call, filled as its tokens stream

    @classmethod
    def load(cls, checkpoint=None, *, dtype: torch.dtype = torch.float32, device: str = "cpu",
             int4: bool = False, packed: bool = True, batch_invariant: bool | None = None,
             compile: bool = False) -> Engine:
        """A checkpoint directory (default: `make weights`' model) loaded as `build` does;
        compile: the CLI's --compile (int4 only), its notes on stderr as the CLI says them."""
        ckpt = default_checkpoint() if checkpoint is None else checkpoint
        if not Path(ckpt).is_dir():
            raise ValueError(f"checkpoint {ckpt} is not a directory")
        if compile:
            check_compile(int4, batch_invariant, "compile=True", "int4=True", "batch_invariant=False")
        model = build(ckpt, dtype=dtype, device=device, int4=int4, packed=packed, batch_invariant=batch_invariant)
        return cls(compile_step(model, say) if compile else model, Tokenizer.load(ckpt))

    def ids(self, prompt: str | list[int]) -> list[int]:
        return encode(self.tokenizer, prompt) if isinstance(prompt, str) else list(prompt)

    def tokens(self, prompt: str | list[int], *, decoder: str = "plain", max_new_tokens: int = 64,
               temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, seed: int = 0,
               second: int | Llama | None = None, adaptive: bool = True, **knobs) -> Iterator[int]:
        """New token ids as they are accepted, EOS included when it comes. Not a generator
        itself: its arguments are checked when it is called, its tokens drawn as they are read."""
        ids = self.ids(prompt)
        if not ids:
            raise ValueError("the prompt is empty")
        check_ids(ids, self.model.config.vocab_size, "a prompt of ids")
        if type(max_new_tokens) is not int or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
        check_fits(len(ids), max_new_tokens, self.model.config)
        if decoder not in DECODERS:
            raise ValueError(f"decoder {decoder!r}: one of {', '.join(DECODERS)}")
        if type(adaptive) is not bool:   # "false" would be truthy; checked for every decoder, read by a policy
            raise ValueError(f"adaptive must be True or False, got {adaptive!r}")
        d = DECODERS[decoder]
        if set(knobs) - set(d.knobs):
            raise ValueError(f"{decoder} has no knob {sorted(set(knobs) - set(d.knobs))[0]!r} "
                             f"(it takes {', '.join(d.knobs) or 'none'})")
        if (second is None) != (d.second is None):
            raise ValueError(f"{decoder} takes second= (a layer count or a Llama)" if second is None
                             else f"{decoder} takes no second model")
        if second is not None and (isinstance(second, bool) or not isinstance(second, (int, Llama))):
            raise ValueError(f"second= is a layer count or a Llama, got {second!r}")
        extra = () if second is None else (d.early_exit(second) if isinstance(second, int) else second,)
        compiled = self.model.__dict__.get("blocks")
        if isinstance(second, int) and isinstance(compiled, Compiled) and (0, second) not in compiled.runners:
            compile_step(self.model, say, splits=[second])   # the early exit's halves, compiled too
        if d.adapts(knobs, adaptive):
            knobs = {**knobs, "policy": d.policy(self.model, *extra, prices(self.model, *extra), knobs)}
        steps = d.decode(self.model, *extra, ids, sampler=Sampler(temperature, top_k, top_p),
                         rng=Random(seed), max_new_tokens=max_new_tokens, **knobs)
        self.stats = Stats()
        return generate(steps, max_new_tokens=max_new_tokens, eos_ids=self.tokenizer.eos_ids, stats=self.stats)

    def stream(self, prompt: str | list[int], **kw) -> Iterator[str]:
        """The answer's text in pieces, each as soon as its bytes are whole UTF-8 (no EOS text);
        checked when called, as tokens() is."""
        return text_pieces(self.tokens(prompt, **kw), self.tokenizer)

    def generate(self, prompt: str | list[int], **kw) -> str:
        return "".join(self.stream(prompt, **kw))


def encode(tokenizer: Tokenizer, text: str, raw: bool = False) -> list[int]:
    """A text prompt's ids, as the CLI and the API send it: one user message in the chat
    template (none: the text itself); raw (--raw): the text itself, its special-token strings
    (<|im_start|>, <s>) become control tokens. A blank text is a ValueError."""
    if not text.strip():
        raise ValueError("the prompt is empty")
    if raw or not tokenizer.chat_template:
        return tokenizer.encode(text, special=raw)
    return tokenizer.encode_chat([{"role": "user", "content": text}])


def check_fits(n: int, max_new_tokens: int, config: LlamaConfig, flag: str = "max_new_tokens") -> None:
    """n prompt tokens and the token budget must fit the model's context, else a ValueError
    naming the budget as `flag`."""
    if n + max_new_tokens > config.max_seq_len:
        capped = ", capped at its sliding window" if config.sliding_window else ""
        raise ValueError(f"prompt ({n} tokens) + {flag} ({max_new_tokens}) exceeds the model's "
                         f"context ({config.max_seq_len}{capped})")


def say(line: str) -> None:
    """A note on stderr, as the CLI prints it (compile's progress and fallbacks)."""
    print(f"note: {line}", file=sys.stderr, flush=True)


def check_compile(int4: bool, batch_invariant: bool | None, flag: str, four_bit: str, inexact: str) -> None:
    """The CLI's and the API's one rule for compiling: only the exact 4-bit step is compiled
    (engine/aot.py), so `flag` needs `four_bit` and refuses `inexact`; else a ValueError."""
    if not int4 or batch_invariant is False:
        raise ValueError(f"{flag} compiles the exact 4-bit step: pass {four_bit} (and not {inexact})")


def text_pieces(tokens: Iterator[int], tokenizer: Tokenizer) -> Iterator[str]:
    pieces = StreamDecoder(tokenizer)
    for x in tokens:
        if x not in tokenizer.eos_ids:
            yield pieces.push(x)
    yield pieces.flush()
