"""The one decoder registry: name -> its decode function, its knobs, its second model.

Both front doors (engine/doors/: the CLI and the Python API), the benchmark and the quality
report (tools/) read this table; the CLI makes a flag of every knob declared here (--knob-name,
its type, default and help). Adding a decoder is a module with `decode(model, [second,]
prompt, *, sampler, rng, max_new_tokens, trace=False, **knobs) -> Iterator[Step]`, one entry
here, its Tracer method (engine/trace.py) and its tests (docs/adding-a-decoder.md;
engine/lookup.py is the worked example). Every decoder takes `trace`. A decoder that can adapt
also takes `policy=` (None: its textbook loop with fixed knobs); what builds it lives with the
rest of what adapts (engine/adapt/policy.py, POLICIES).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, NamedTuple

from engine import contrastive, lookahead, lookup, speculative
from engine.generate import plain


class Knob(NamedTuple):
    """One keyword of a decode() function, and the CLI flag --name-with-dashes made from it."""
    name: str
    type: Callable = int          # int, float, str; bool: a switch, off by default
    default: object = None        # None: decode()'s own default holds
    help: str = ""
    choices: tuple = ()


class Second(NamedTuple):
    """A decoder's second model, named by one flag: a checkpoint dir, layers:L (an early exit) or
    (a draft) ngram[:n], the text's n-grams."""
    flag: str                     # draft | amateur
    default: str
    help: str                     # layers:L is EarlyExit(L), ngram:n Ngram(n) (engine/draft.py)


@dataclass(frozen=True, kw_only=True)
class Decoder:
    decode: Callable
    check: Callable = lambda config, second=None, **knobs: None   # its knobs for a model of config, before
                                    # any weight loads: a ValueError, as decode() would raise at its first read
    knobs: tuple[Knob, ...] = ()    # decode()'s keyword knobs
    sizes: tuple[str, ...] = ()     # knobs that size a step: the CLI clamps them to the token budget
    second: Second | None = None
    rejection: Callable = lambda knobs: False   # verifies by rejection? (sampled: plain's law, not its tokens)
    one_row: Callable = lambda knobs: False     # only one-row forwards? (then no k-row rounding to disclaim)
    held_to: str = "plain's"                    # whose tokens (or law) its k-row forwards must keep
    own_loop: dict | None = None                # held to its own one-row loop: the knobs that run it
    about: str = ""                             # its flags' heading in --help

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(k.name for k in self.knobs)


AMATEUR_LAYERS = 8         # the early-exit amateur depth the quality report chose
NUM_DRAFT = Knob("num_draft", help="K draft tokens per step (--no-adaptive: default 4; adaptive: the K it starts "
                                   "from, by default the best K at the draft's prior acceptance and price; "
                                   "contrastive --speculative: a fixed K, default 4)")

DECODERS = {
    "plain": Decoder(decode=plain, one_row=lambda knobs: True),
    "lookahead": Decoder(
        decode=lookahead.decode, check=lookahead.check, sizes=("window", "guesses", "ngram"),
        about="lookahead (giving --window or --guesses fixes both: the textbook loop)",
        knobs=(Knob("window", help="W, Jacobi window columns (textbook default 5)"),
               Knob("ngram", help="N, n-gram size (default 4)"),
               Knob("guesses", help="G, candidate n-grams verified per step (default: W)"),
               Knob("trim_layers", default=0, help="freeze window rows in the last m layers"))),
    "speculative": Decoder(
        decode=speculative.decode, check=speculative.check, sizes=("num_draft",), about="speculative",
        knobs=(NUM_DRAFT, Knob("verify", str, "rejection", "rejection sampling, or coupled noise "
                               "(seed-identical to plain)", ("rejection", "coupled"))),
        second=Second("draft", "auto", "int4: the target's weights in 4 bits; layers:L: the target's first L "
                      "layers; ngram[:n]: the text's own n-grams, no model (n = 3: the token after the latest "
                      "earlier match of the last 3 or 2 tokens); ngram[:n]+MODEL: the n-grams where the text "
                      "repeats, else MODEL (int4 or a checkpoint dir); a checkpoint dir; auto (default): of the "
                      "drafts that can be built here (the smaller checkpoints beside the target that share its "
                      "tokenizer, each alone and beside the n-grams, int4 but under a SIMD-less kernel "
                      "dispatch, ngram) the one the cost model says pays most (--no-adaptive: the first)"),
        rejection=lambda k: k.get("verify", "rejection") == "rejection"),
    "contrastive": Decoder(
        decode=contrastive.decode, check=contrastive.check, sizes=("num_draft",), about="contrastive",
        held_to="contrastive's", own_loop={"speculative": False},
        knobs=(Knob("alpha", float, 0.1, "keep tokens with p_E >= alpha * max p_E"),
               Knob("beta", float, 1.0, "amateur weight (logit form); docs/quality.md chose 1.0"),
               Knob("form", str, "logit", "score form", ("logit", "ratio")),
               Knob("amateur_temperature", float, 1.0, "tau: p_A = softmax(l_A / tau)"),
               Knob("speculative", bool, help="the amateur drafts, the expert verifies"), NUM_DRAFT),
        second=Second("amateur", f"layers:{AMATEUR_LAYERS}", "amateur checkpoint dir, or layers:L: an early exit "
                      "of the expert (default %(default)s)"),
        rejection=lambda k: bool(k.get("speculative")), one_row=lambda k: not k.get("speculative")),
    "lookup": Decoder(
        decode=lookup.decode, check=lookup.check, sizes=("lookup_tokens",), about="lookup (prompt lookup decoding)",
        knobs=(Knob("lookup_ngram", default=3, help="longest n-gram to match (tried from there down to 1)"),
               Knob("lookup_tokens", default=8, help="K, tokens copied after the match and verified"))),
}
