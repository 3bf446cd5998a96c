"""The engine from Python: what `python -m engine.run` does, without its flags (README, "Python API").

    from engine.api import Engine
    llm = Engine.load()                              # the default model; or Engine.load(path)
    print(llm.generate("What is the capital of France?", max_new_tokens=20))
    for text in llm.stream("Name three colours.", decoder="lookahead", window=4):
        print(text, end="", flush=True)
    print(llm.stats.n_tokens, llm.stats.n_forwards)  # the last call's engine.generate.Stats

`Engine.load`'s keywords are the CLI's loading flags, `tokens`' its decoding ones: a decoder by
name, its knobs as keywords, `second=` a Llama (`llm.second(path)`: a draft or amateur of the
same family, loaded as the CLI's --draft PATH), an early exit (EarlyExit(L), or just L), for
speculative the text's n-grams (Ngram(n)), or any spec the CLI's --draft and --amateur take
("auto", "int4", "ngram:3", "ngram:3+PATH", "layers:8", a checkpoint path:
engine/doors/session.py's second_for),
`adaptive` as --adaptive, priced as the CLI prices. A str prompt is chat-templated as there; a
list of ids is sent as it is. A bad argument is a ValueError when the call is made, before
any token, as the CLI's `error:` lines are.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch

from engine.adapt.cost import probed
from engine.adapt.policy import adaptive as policy_for
from engine.decoders import DECODERS
from engine.doors.session import (Auto, cache_note, check_context, compile_second, encode, pick, prices,
                                  others_running, prices_move_tokens, say, second_for, share_cores, wire)
from engine.fast.paths import build, check_compile, check_device, default_path, on_exact_path, path_name
from engine.load.weights import second_checkpoint
from engine.fast.aot import compile_step
from engine.doors.receipt import receipt, reference
from engine.draft import Draft, EarlyExit, Ngram
from engine.generate import Stats, generate
from engine.llama import Llama
from engine.load.tokenizer import StreamDecoder, Tokenizer
from engine.load.config import load_config
from engine.load.weights import DTYPES, default_checkpoint
from engine.sampling import Random, Sampler, check_ids


@dataclass
class Engine:
    model: Llama
    tokenizer: Tokenizer
    stats: Stats | None = None     # of the last call, filled as its tokens stream
    path: str = ""                 # the path it runs on, as the CLI's stats line names it
    checkpoint: Path | None = None # where it was loaded from, and how (build's keywords):
    built: dict | None = None      # a second model (Engine.second) loads the same way
    picked: tuple = ()             # the last call's second model (second="auto": the draft it took)

    @classmethod
    def load(cls, checkpoint=None, *, dtype: torch.dtype | None = None, device: str = "cpu",
             int4: bool | None = None, packed: bool = True, batch_invariant: bool | None = None,
             compile: bool = False, threads: int | None = None) -> Engine:
        """A checkpoint directory (default: `make weights`' model) loaded as `build` does, on the
        CLI's path for these keywords (unset: the fastest exact path here, fast.paths.default_path);
        compile: the CLI's --compile (int4 only), its notes on stderr as the CLI says them;
        threads: the CLI's --threads (torch's threads, for this process; unset, split among the
        engine runs on this machine at once, on the exact 4-bit path)."""
        ckpt = default_checkpoint() if checkpoint is None else checkpoint
        if not Path(ckpt).is_dir():
            raise ValueError(f"checkpoint {ckpt} is not a directory")
        if threads is not None and (type(threads) is not int or not 1 <= threads <= 1024):
            raise ValueError(f"threads must be an int in [1, 1024], got {threads!r}")
        names = {v: k for k, v in DTYPES.items()}
        if dtype is not None and dtype not in names:
            raise ValueError(f"dtype {dtype!r}: one of {', '.join(map(str, names))}")
        path = default_path(load_config(ckpt), str(check_device(device)), names.get(dtype), int4, batch_invariant,
                            packed)
        if compile:
            check_compile(path.int4, path.batch_invariant, "compile=True", "int4=True", "batch_invariant=False")
        if (note := cache_note()) is not None:
            say(note)
        # other engine runs at once split the cores, on the exact 4-bit path (session.share_cores)
        used, others = share_cores(threads, bool(path.int4 and path.batch_invariant is not False))
        if others:
            say(f"{others} other engine run(s) share this machine: {used} thread(s) here (threads= sets them)")
        built = dict(dtype=DTYPES[path.dtype], device=device, int4=path.int4, packed=packed,
                     batch_invariant=path.batch_invariant)
        model = build(ckpt, **built)
        model = compile_step(model, say) if compile else model
        return cls(model, Tokenizer.load(ckpt), path=path_name(path, model), checkpoint=Path(ckpt), built=built)

    def second(self, checkpoint, draft: bool = True) -> Llama:
        """A draft (or, draft=False, an amateur) for tokens(second=...) from its checkpoint
        directory, as the CLI's --draft PATH (--amateur PATH) loads it: on this engine's path, or
        a ValueError where its tokenizer does not give this engine's ids (the target's family)."""
        if self.built is None:
            raise ValueError("second() loads beside an engine made by Engine.load")
        if not Path(checkpoint).is_dir():
            raise ValueError(f"checkpoint {checkpoint} is not a directory")
        return second_checkpoint(self.checkpoint, checkpoint, lambda c: build(c, **self.built, draft=draft))

    def seconds(self, second, flag: str) -> tuple:
        """second= as decode() takes it (session.second_for, as the CLI reads --draft/--amateur):
        a spec loads on this engine's path (a 4-bit copy of an fp32 target: int4, bf16 activations)."""
        built = self.built or {}
        why = None if built and not built["int4"] and torch.device(built["device"]).type == "cpu" else \
            "int4 drafts for an fp32 target on the CPU loaded by Engine.load (a 4-bit target is its own copy)"
        if isinstance(second, str) and self.built is None and (not second.startswith(("layers:", "ngram")) or "+" in second):
            raise ValueError(f"second={second!r} loads beside an engine made by Engine.load")
        copy = {**built, "int4": True, "batch_invariant": bool(built.get("batch_invariant"))}
        return second_for(second, flag, self.checkpoint or Path("."),
                          lambda c, four_bit: build(c, **(copy if four_bit else built), draft=flag == "draft"), why)

    def ids(self, prompt: str | list[int]) -> list[int]:
        return encode(self.tokenizer, prompt) if isinstance(prompt, str) else list(prompt)

    def tokens(self, prompt: str | list[int], *, decoder: str = "plain", max_new_tokens: int = 64,
               temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, seed: int = 0,
               second: int | str | Draft | None = None, adaptive: bool = True, **knobs) -> Iterator[int]:
        """New token ids as they are accepted, EOS included when it comes. Not a generator
        itself: its arguments are checked when it is called, its tokens drawn as they are read."""
        ids = self.ids(prompt)
        if not ids:
            raise ValueError("the prompt is empty")
        check_ids(ids, self.model.config.vocab_size, "a prompt of ids")
        if type(max_new_tokens) is not int or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
        check_context(len(ids), max_new_tokens, self.model.config)
        if decoder not in DECODERS:
            raise ValueError(f"decoder {decoder!r}: one of {', '.join(DECODERS)}")
        if type(adaptive) is not bool:   # "false" would be truthy; checked for every decoder, read by a policy
            raise ValueError(f"adaptive must be True or False, got {adaptive!r}")
        d = DECODERS[decoder]
        if set(knobs) - set(d.names):
            raise ValueError(f"{decoder} has no knob {sorted(set(knobs) - set(d.names))[0]!r} "
                             f"(it takes {', '.join(d.names) or 'none'})")
        if (second is None) != (d.second is None):
            raise ValueError(f"{decoder} takes second= (a Llama, or a layer count: an early exit)" if second is None
                             else f"{decoder} takes no second model")
        if second is not None and (isinstance(second, bool) or not isinstance(second, (int, str, EarlyExit, Ngram, Llama))):
            raise ValueError(f"second= is a layer count (an early exit), EarlyExit(L), Ngram(n), a Llama or a spec "
                             f"as the CLI's --{d.second.flag} takes, got {second!r}")
        d.check(self.model.config, **knobs)   # now, not at the first token's read, and before a second model loads
        extra = self.seconds(second, d.second.flag) if second is not None else ()
        d.check(self.model.config, *[m for m in extra if not isinstance(m, Auto)], **knobs)
        extra = tuple(compile_second(self.model, m, say) for m in extra)   # compiled too, where the target's is
        # as the CLI: a first run whose tokens no price can move answers first, then measures
        now = prices_move_tokens(decoder, knobs, temperature, on_exact_path(self.model, probed))
        steps, _, picked = wire(decoder, self.model, extra, ids, knobs, adaptive=adaptive, sampler=Sampler(temperature, top_k, top_p),
                           rng=Random(seed), max_new_tokens=max_new_tokens,
                           price=lambda second: pick(self.model, second, lambda m: prices(self.model, m, measure_now=now))[1:])
        self.stats, self.picked = Stats(), picked
        tokens = generate(steps, max_new_tokens=max_new_tokens, eos_ids=self.tokenizer.eos_ids, stats=self.stats)
        return tokens if now or policy_for(decoder, knobs, adaptive) is None else \
            then(tokens, lambda: others_running() or prices(self.model, *picked))   # not beside another run

    def receipt(self, prompt: str | list[int], **kw) -> dict:
        """The CLI's --receipt: this call's tokens (`tokens(prompt, **kw)`) against the reference
        it is held to (plain's; contrastive's own one-row steps) on the same model, prompt,
        sampler and seed: {"identical": True, ...}, or the first new token where they part and
        the top-2 logit gap there (engine/doors/receipt.py's `reference`, as the CLI's)."""
        got = list(self.tokens(prompt, **kw))
        same = {k: kw[k] for k in ("temperature", "top_k", "top_p") if k in kw}
        decoder = kw.get("decoder", "plain")
        extra = self.picked   # the second model the call ran with (--draft auto's pick)
        knobs = {k: v for k, v in kw.items() if k in DECODERS[decoder].names}
        ref = reference(decoder, self.model, extra, self.ids(prompt), knobs, Sampler(**same), kw.get("seed", 0), len(got))
        return receipt(self.model, self.ids(prompt), got, ref, self.tokenizer.eos_ids)

    def stream(self, prompt: str | list[int], **kw) -> Iterator[str]:
        """The answer's text in pieces, each as soon as its bytes are whole UTF-8 (no EOS text);
        checked when called, as tokens() is."""
        return text_pieces(self.tokens(prompt, **kw), self.tokenizer)

    def generate(self, prompt: str | list[int], **kw) -> str:
        return "".join(self.stream(prompt, **kw))


def then(tokens: Iterator[int], after) -> Iterator[int]:
    """`tokens`, then after() once they are all out (the prices a first run measures)."""
    yield from tokens
    after()


def text_pieces(tokens: Iterator[int], tokenizer: Tokenizer) -> Iterator[str]:
    pieces = StreamDecoder(tokenizer)
    for x in tokens:
        if x not in tokenizer.eos_ids:
            yield pieces.push(x)
    yield pieces.flush()
