"""The one decoder registry: name -> its decode function, its knobs, its second model, its policy.

The CLI (engine/run.py), the benchmark and the quality report (tools/) all read this table.
Adding a decoder is a module with `decode(model, [second,] prompt, *, sampler, rng,
max_new_tokens, trace=False, **knobs) -> Iterator[Step]`, one line here, a flag per knob in
engine/run.py, and its tests (README, "Adding a decoder"; engine/lookup.py is the worked example).
Every decoder takes `trace`: the CLI passes --trace to all of them. A decoder that can adapt
also takes `policy=` (None: its textbook loop with fixed knobs), built by `policy` here from
the models, the prices (engine/policy.py, Prices) and the knobs given.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from engine import contrastive, lookahead, lookup, policy, speculative
from engine.draft import SelfDraft
from engine.generate import plain


@dataclass(frozen=True)
class Decoder:
    decode: Callable
    knobs: tuple[str, ...] = ()     # decode()'s keyword knobs; the CLI flag is --knob-name
    sizes: tuple[str, ...] = ()     # knobs that size a step: the CLI clamps them to the token budget
    second: str | None = None       # the flag naming its second model: a checkpoint or layers:L
    early_exit: Callable = int      # layers:L -> what decode() takes for an early exit of the target
    policy: Callable | None = None  # (model, [second,] prices, knobs) -> what decode(policy=) takes
    fixed_by: tuple[str, ...] = ()  # knobs that, given, ask for the textbook loop: no policy
    rejection: Callable = lambda knobs: False   # verifies by rejection? (sampled: plain's law, not its tokens)
    one_row: Callable = lambda knobs: False     # only one-row forwards? (then no k-row rounding to disclaim)
    held_to: str = "plain's"                    # whose tokens (or law) its k-row forwards must keep

    def adapts(self, knobs: dict, adaptive: bool = True) -> bool:
        return self.policy is not None and adaptive and not set(self.fixed_by) & set(knobs)


DECODERS = {
    "plain": Decoder(plain, one_row=lambda knobs: True),
    "lookahead": Decoder(lookahead.decode, ("window", "ngram", "guesses", "trim_layers"),
                         ("window", "guesses", "ngram"), policy=policy.for_lookahead, fixed_by=("window", "guesses")),
    "speculative": Decoder(speculative.decode, ("num_draft", "verify"), ("num_draft",), "draft", SelfDraft,
                           policy.for_speculative, rejection=lambda k: k.get("verify", "rejection") == "rejection"),
    "contrastive": Decoder(contrastive.decode, ("alpha", "beta", "form", "amateur_temperature",
                                                "speculative", "num_draft"), ("num_draft",), "amateur",
                           rejection=lambda k: bool(k.get("speculative")),
                           one_row=lambda k: not k.get("speculative"), held_to="contrastive's"),
    "lookup": Decoder(lookup.decode, ("lookup_ngram", "lookup_tokens"), ("lookup_tokens",), policy=policy.for_lookup),
}
