"""Every decoder on the tiny models: the one table of runs the decoder-wide tests read.

    test_generate.py   a first forward is the prompt's alone; k-row forwards exactly where
                       the registry's one_row says
    test_trace.py      a trace claims exactly what its step emitted, greedy and sampled

A new decoder adds its rows here (one at least, its label naming it); both tests fail until one
does. Labels are what the tests print; a row builds its second model and knobs afresh for each
run (a policy learns as it goes).
"""
from engine.adapt import policy
from engine.decoders import DECODERS
from engine.draft import EarlyExit, Ngram


def cheap(k: int) -> float:
    """A k-row forward's price where rows are nearly free: every policy sends guesses."""
    return 1.0 + 0.01 * k


# label -> (registry name, (target, the test's small draft model) -> (second models, knobs))
CASES = {
    "plain": ("plain", lambda t, d: ((), {})),
    "lookahead W=3 N=3 G=3": ("lookahead", lambda t, d: ((), {"window": 3, "ngram": 3, "guesses": 3})),
    "lookahead trimmed": ("lookahead", lambda t, d: ((), {"window": 3, "ngram": 3, "trim_layers": 1})),
    "lookahead policy, cheap rows": ("lookahead", lambda t, d: ((), {"policy": policy.Lookahead(cheap, 4)})),
    "lookahead auto": ("lookahead", lambda t, d: ((), {"policy": policy.for_lookahead(t, policy.Prices(), {})})),
    "lookup": ("lookup", lambda t, d: ((), {})),
    "lookup policy, cheap rows": ("lookup", lambda t, d: ((), {"policy": policy.CopyLength(cheap)})),
    "speculative K=3": ("speculative", lambda t, d: ((d,), {"num_draft": 3})),
    "speculative coupled": ("speculative", lambda t, d: ((d,), {"num_draft": 2, "verify": "coupled"})),
    "speculative self-draft": ("speculative", lambda t, d: ((EarlyExit(1),), {})),
    "speculative adaptive self-draft": ("speculative", lambda t, d: (
        (EarlyExit(1),), {"policy": policy.draft_length(t, EarlyExit(1))})),
    "speculative policy, cheap rows": ("speculative", lambda t, d: (
        (EarlyExit(1),), {"policy": policy.DraftLength(4, 6, 0.1, cheap)})),
    "speculative n-gram draft": ("speculative", lambda t, d: ((Ngram(2, least=1),), {"num_draft": 3})),
    "contrastive": ("contrastive", lambda t, d: ((d,), {})),
    "speculative contrastive": ("contrastive", lambda t, d: ((EarlyExit(1),), {"speculative": True, "num_draft": 2})),
    "speculative contrastive, model amateur": ("contrastive", lambda t, d: ((d,), {"speculative": True})),
}


def case(label: str, target, draft) -> tuple[str, tuple, dict]:
    """(registry name, second models, knobs) of one row, built afresh."""
    name, make = CASES[label]
    return (name, *make(target, draft))


def run(label: str, target, draft, prompt: list[int], **kw):
    """One row's decode(): its Steps, one per target forward (kw: sampler, rng, max_new_tokens, trace)."""
    name, second, knobs = case(label, target, draft)
    return DECODERS[name].decode(target, *second, prompt, **kw, **knobs)
