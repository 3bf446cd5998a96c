"""--trace tells the truth: what a step's trace says it accepted is exactly what the step
emitted, and its numbers (u, p/q, positions, matches) are the ones the decision read.
A reader learns the algorithms from these traces, so a trace that flatters them is a bug."""
import json

import pytest
import torch

from cases import CASES, run
from conftest import tiny_llama, unnamed_decoders
from engine import contrastive, lookup, speculative
from engine.decoders import DECODERS
from engine.generate import generate
from engine.sampling import Random, Sampler
from engine.trace import Tracer, claimed, traced

V, PROMPT, BUDGET = 6, [1, 2, 3, 1, 2, 4, 1, 2], 64
TARGET, DRAFT = tiny_llama(0, vocab=V), tiny_llama(3, vocab=V, n_layers=1)
SAMPLERS = {"greedy": Sampler(), "t=0.8": Sampler(0.8), "t=1.2,top-k=4": Sampler(1.2, top_k=4)}

# label naming its registry decoder -> (sampler, rng, trace) -> steps: tests/cases.py's table
TRACED = {label: lambda s, r, t, label=label: run(label, TARGET, DRAFT, PROMPT, sampler=s, rng=r,
                                                  max_new_tokens=BUDGET, trace=t) for label in CASES}


def letters(ids):   # the tiny models' "tokenizer": token i is the i-th letter
    return "".join(chr(ord("a") + i) for i in ids)


def lies(steps, rng, sampler) -> list[str]:
    """Every claim of the steps' traces that the steps themselves or the random source refute."""
    wrong, text = [], list(PROMPT)
    for n, step in enumerate(steps):
        t = step.trace
        if claimed(t) != step.tokens:
            wrong.append(f"step {n}: claims {claimed(t)}, emitted {step.tokens}")
        if t["position"] != len(text):
            wrong.append(f"step {n}: at @{t['position']}, the first new token is @{len(text)}")
        for i, d in enumerate(t.get("drafts", [])):   # each verdict read the u it shows
            key = "token" if t.get("verify") == "coupled" else "accept"
            if d["u"] != rng.uniform(key, len(text) + i):
                wrong.append(f"step {n}: draft {i} shows u={d['u']}, not its key's")
            if key == "accept" and d["verdict"] != "unverified" and (d["u"] < d["p"] / d["q"]) != (d["verdict"] == "accept"):
                wrong.append(f"step {n}: draft {i} says {d['verdict']} for u={d['u']}, p/q={d['p'] / d['q']}")
        if t["kind"] == "lookup" and t["guess"]:      # the copy follows a real earlier match
            m, at = t["ngram"], t["source"]
            if text[at:at + m] != text[-m:] or text[at + m:at + m + len(t["guess"])] != t["guess"]:
                wrong.append(f"step {n}: no match of the last {m} tokens @{at} followed by {t['guess']}")
        if t["kind"] == "lookup" and (t["first"] != (n == 0) or bool(t["found"]) != bool(
                lookup.find(text, 3, 8)[0] if n else [])):   # the prompt's step; a match, sent or not
            wrong.append(f"step {n}: first={t['first']}, found={t['found']}")
        if t["kind"] == "lookup" and n and (t["room"] != min(8, BUDGET - (len(text) - len(PROMPT)) - 1) or (
                len(t["guess"]) != min(t["found"], t["room"]) if not t["policy"] else len(t["guess"]) > t["room"])):
            wrong.append(f"step {n}: room {t['room']}, sent {len(t['guess'])} of {t['found']}")   # only a policy cuts
        if t["kind"] == "contrastive" and sampler.greedy and t["best"][:len(step.tokens)] != step.tokens:
            wrong.append(f"step {n}: greedy picks {step.tokens}, trace says argmax {t['best']}")
        text += step.tokens
    return wrong


def traced_steps(name, sampler, seed=0, n_steps=12):
    """The first n_steps steps (fewer if the budget would run out), and the random source."""
    rng, out = Random(seed), []
    for step in TRACED[name](sampler, rng, True):
        out.append(step)
        if len(out) == n_steps or sum(len(s.tokens) for s in out) > BUDGET // 2:
            return out, rng


@pytest.mark.parametrize("sampler", SAMPLERS.values(), ids=SAMPLERS.keys())
@pytest.mark.parametrize("name", TRACED)
def test_trace_claims_exactly_what_each_step_emitted(name, sampler):
    # Why: a trace is read as the story of the step; every claim in it is checked against the
    # tokens and the keyed random source, for every decoder, greedy and sampled.
    steps, rng = traced_steps(name, sampler)
    assert lies(steps, rng, sampler) == []


@pytest.mark.parametrize("name", TRACED)
def test_tracing_changes_no_token_and_untraced_steps_carry_none(name):
    # Why: --trace must watch the decoding, not steer it; and the default path builds nothing.
    sampler = Sampler(0.8)
    quiet = TRACED[name](sampler, Random(1), False)
    loud = TRACED[name](sampler, Random(1), True)
    a, b = [next(quiet) for _ in range(8)], [next(loud) for _ in range(8)]
    assert [s.tokens for s in a] == [s.tokens for s in b]
    assert all(s.trace is None for s in a) and all(s.trace is not None for s in b)


def test_every_registered_decoder_is_traced_here():
    # Why: a decoder added to the registry (docs/adding-a-decoder.md) must have its trace held
    # to the truth by the tests above: one label of TRACED at least names it
    assert unnamed_decoders(TRACED) == []



def test_an_ngram_drafts_short_step_says_it_ran_out_of_matches():
    # Why: a step of the text's n-grams drafts fewer than the K it was asked where the text stops
    # repeating; the trace must say so, not show a smaller K as if the policy had chosen it
    tracer = Tracer(letters)
    infos = [s.trace for s, _ in zip(TRACED["speculative n-gram draft"](Sampler(), Random(0), True), range(24))]
    short = [t for t in infos if not t["first"] and t["asked"] > t["k"]]
    assert short and all("3 asked; the n-grams " in tracer.speculative("@", t)[0] for t in short)
    assert all("asked" not in tracer.speculative("@", t)[0] for t in infos if t["asked"] == t["k"])


def test_a_trace_claimed_has_no_rule_for_is_one_line_naming_the_keys_it_needs():
    # Why: a new decoder's trace with keys of its own must tell its author what claimed() reads
    # (docs/adding-a-decoder.md), not end in a KeyError on 'drafts'
    with pytest.raises(ValueError, match="no rule for a 'medusa' trace.*'drafts'.*'next'"):
        claimed({"kind": "medusa", "position": 3, "heads": [[1, 2]], "next": 4})
    assert claimed({"kind": "medusa", "drafts": [{"token": 1, "verdict": "accept"}], "next": 2}) == [1, 2]

def test_the_traces_accept_something_somewhere():
    # Why: the truth test is vacuous for multi-token claims if every step emits one token; every
    # decoder but plain (whose trace "kind" is its registry name) must show one somewhere
    long = [s for name in TRACED for s in traced_steps(name, Sampler())[0] if len(s.tokens) > 1]
    kinds = {s.trace["kind"] for s in long}
    assert set(DECODERS) - {"plain"} <= kinds


def test_printed_trace_shows_every_step_and_its_emitted_tokens(capsys):
    # Why: what the reader sees is the formatter's output; it must name the emitted tokens.
    tracer = Tracer(letters)
    for name in TRACED:
        steps = TRACED[name](Sampler(0.8), Random(2), True)
        out = list(generate(traced(steps, tracer), max_new_tokens=10))
        printed = capsys.readouterr().err
        assert printed.count("#0 @8 ") == 1 and out
    lines = Tracer(letters).lines(0, traced_steps("lookup", Sampler(), n_steps=1)[0][0].trace)
    assert "the prompt's step (plain's)" in lines[0]
    # the last token of the budget: a match (every token is in the prompt), and no room to send it
    steps = lookup.decode(TARGET, [0, 1, 2, 3, 4, 5, 0, 1], sampler=Sampler(), rng=Random(0), max_new_tokens=2, trace=True)
    next(steps)
    t = next(steps).trace
    assert t["found"] and t["room"] == 0 and "no room left in the budget" in Tracer(letters).lines(1, t)[0]
    steps, _ = traced_steps("lookahead W=3 N=3 G=3", Sampler(), n_steps=6)
    text = "\n".join(line for n, s in enumerate(steps) for line in Tracer(letters).lines(n, s.trace))
    assert "mask, drawn when" in text and "window level 1" in text
    for s in steps:
        assert f"emitted {Tracer(letters).show(s.tokens)}" in text


# --------------------------------------------------------------------------- lying traces are caught

def lie_whole_guess(t):      # reports the guess's tokens instead of the verified ones
    if t["kind"] == "lookahead" and t["grams"]:
        t["accepted"] = len(t["grams"][t["best"]])
    if t["kind"] == "lookup":
        t["accepted"] = len(t["guess"])


def lie_all_accepted(t):     # every draft "accepted", whatever the target said
    for d in t.get("drafts", []):
        d["verdict"] = "accept"


def lie_fresh_u(t):          # a u from another key than the one the verdict read
    for i, d in enumerate(t.get("drafts", [])):
        d["u"] = Random(99).uniform("accept", t["position"] + i)


def lie_expert_pick(t):      # the expert's argmax shown as the contrastive one
    if t["kind"] == "contrastive":
        t["best"] = t["expert"]


def lie_no_match(t):         # a match the policy priced out shown as no match at all
    if t["kind"] == "lookup":
        t["found"] = 0


def lie_priced_out(t):       # the budget's end shown as the policy's choice
    if t["kind"] == "lookup":
        t["room"] += 1


LIARS = {
    "lookahead reports the guess": (lie_whole_guess, "lookahead W=3 N=3 G=3"),
    "lookup reports the copy": (lie_whole_guess, "lookup"),
    "lookup hides its match": (lie_no_match, "lookup"),
    "lookup blames the policy for the budget": (lie_priced_out, "lookup"),
    "speculative accepts every draft": (lie_all_accepted, "speculative K=3"),
    "speculative shows another u": (lie_fresh_u, "speculative K=3"),
    "contrastive shows the expert's pick": (lie_expert_pick, "contrastive"),
}


@pytest.mark.parametrize("liar", LIARS)
def test_a_lying_trace_is_caught(liar):
    lie, name = LIARS[liar]
    sampler = Sampler()
    steps, rng = traced_steps(name, sampler, n_steps=16)
    for s in steps:
        lie(s.trace)
    assert lies(steps, rng, sampler)


# --------------------------------------------------------------------------- the CLI on a tiny checkpoint

@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory):
    """test_hostile's tiny converted checkpoint: a real tokenizer and chat template, 2 layers."""
    import tools.convert
    from test_hostile import write_gguf
    d = tmp_path_factory.mktemp("tiny")
    return tools.convert.convert(write_gguf(d / "tiny.gguf"), d / "ckpt")


CLI_FLAGS = {"contrastive": ["--amateur", "layers:1"], "speculative": ["--draft", "layers:1", "--no-adaptive"]}


@pytest.mark.parametrize("decoder", [[name, *CLI_FLAGS.get(name, [])] for name in DECODERS]
                         + [["speculative", "--draft", "int4", "--num-draft", "3", "--dtype", "float32"]])   # every registry line
def test_cli_trace_prints_one_block_per_target_forward(tiny_checkpoint, decoder, capsys):
    # Why: `--trace` is the flag a reader types; on any checkpoint it must print every step
    # (one per target forward) on stderr and leave stdout's answer alone.
    from engine.doors.cli import main
    argv = ["--checkpoint", str(tiny_checkpoint), "--prompt", "hi hi hi", "--max-new-tokens", "12",
            "--temperature", "0.8", "--json", "--decoder", *decoder]
    assert main(argv) == 0
    quiet = json.loads(capsys.readouterr().out)
    assert main(argv + ["--trace"]) == 0
    out, err = capsys.readouterr()
    loud = json.loads(out)
    assert loud["tokens"] == quiet["tokens"]
    heads = [l for l in err.splitlines() if l.startswith("#")]
    assert len(heads) == loud["n_forwards"] and heads[0].startswith("#0 @") and decoder[0] in heads[0]


def model_p(model, prefix: list[int], x: int) -> float:
    """The model's own probability (temperature 1) of x after prefix, from a fresh forward."""
    logits = model(torch.tensor([prefix]), torch.arange(len(prefix)))[0, -1]
    return float(logits.float().softmax(-1)[x])


def contrastive_p(prefix: list[int], x: int) -> tuple[float, float]:
    """Speculative contrastive's two laws at temperature 1 after prefix, from fresh forwards:
    the contrastive one (expert TARGET, amateur its first layer), and the amateur's own."""
    tokens, positions = torch.tensor([prefix]), torch.arange(len(prefix))
    expert = TARGET(tokens, positions)[0, -1]
    amateur = TARGET.head(TARGET.blocks(TARGET.tok_embeddings(tokens), positions, stop=1))[0, -1]
    s = contrastive.scores(expert, amateur)
    return float(s.float().softmax(-1)[x]), float(amateur.float().softmax(-1)[x])


def greedy_probability_lies(name) -> list[str]:
    steps, _ = traced_steps(name, Sampler(), n_steps=8)
    wrong, text = [], list(PROMPT)
    for n, s in enumerate(steps):
        t = s.trace
        if t["kind"] == "plain" and abs(t["p_model"] - model_p(TARGET, text, t["token"])) > 1e-9:
            wrong.append(f"step {n}: p_model {t['p_model']}")
        for i, d in enumerate(t.get("drafts", [])):
            prefix = text + [e["token"] for e in t["drafts"][:i]]
            want = contrastive_p(prefix, d["token"]) if t["kind"] == "contrastive" else \
                (model_p(TARGET, prefix, d["token"]), model_p(DRAFT, prefix, d["token"]))
            if d["verdict"] != "unverified" and (abs(d["p_model"] - want[0]) > 1e-9 or abs(d["q_model"] - want[1]) > 1e-9):
                wrong.append(f"step {n} draft {i}: p_model {d['p_model']}, q_model {d['q_model']}, want {want}")
        text += s.tokens
    return wrong


@pytest.mark.parametrize("name", ["plain", "speculative K=3", "speculative contrastive"])
def test_a_greedy_trace_shows_the_models_probability_of_each_pick(name):
    # Why: a greedy law is one-hot, so its p = 1.000 (or q = 0) says nothing about the step;
    # the trace shows what each model thought of the token instead, and it must be the
    # probability a fresh forward of that model gives (the target's, and the draft's for q).
    assert greedy_probability_lies(name) == []
    steps, _ = traced_steps(name, Sampler(), n_steps=8)
    shown = "\n".join(line for n, s in enumerate(steps) for line in Tracer(letters).lines(n, s.trace))
    assert "p=1.000" not in shown and "model" in shown


def test_a_greedy_trace_showing_the_one_hot_law_is_caught(monkeypatch):
    # the broken variant: the drafts' verdicts built without the models' logits, so the
    # "model's" p and q are the one-hot laws
    real = speculative.verdicts
    monkeypatch.setattr(speculative, "verdicts", lambda p, q, drafts, out, u, logits=None: real(p, q, drafts, out, u))
    assert greedy_probability_lies("speculative K=3")
    monkeypatch.setattr(contrastive, "verdicts", lambda p, q, drafts, out, u, logits=None: real(p, q, drafts, out, u))
    assert greedy_probability_lies("speculative contrastive")


@pytest.mark.parametrize("name", ["lookahead W=3 N=3 G=3", "lookup", "speculative K=3"])
def test_a_step_the_run_ends_inside_says_what_it_kept(name, capsys):
    # Why: a trace prints a step before generate() cuts it at the budget (or an EOS, a stop);
    # its "emitted" then names tokens the run never printed, unless the trace says what it kept
    from engine.generate import cut
    steps = traced_steps(name, Sampler(), n_steps=12)[0]
    i = next(i for i, s in enumerate(steps) if len(s.tokens) > 1)          # a multi-token step
    budget = sum(len(s.tokens) for s in steps[:i]) + 1                      # ends after its first token
    ends = lambda tokens, out: cut(tokens, out, budget, set(), None)
    out = list(generate(traced(TRACED[name](Sampler(), Random(0), True), Tracer(letters), cut=ends),
                        max_new_tokens=budget))
    blocks = capsys.readouterr().err.split("\n#")
    assert len(out) == budget and len(blocks) == i + 1
    assert blocks[-1].splitlines()[-1] == f"  kept {letters([out[-1]])!r}: the run ends there (EOS, --stop or the budget)"
    assert all("kept" not in b for b in blocks[:-1])                       # whole steps say nothing


def test_a_verdict_on_tiny_laws_shows_digits_a_reader_can_check():
    # Why: at three decimals p = 4.1e-05 and q = 3.9e-05 both print 0.000, and "accept (u < p/q)"
    # then reads as a lie; the laws are shown to three significant digits
    d = {"token": 1, "p": 4.1e-05, "q": 3.9e-05, "u": 0.274, "verdict": "accept"}
    assert "p=4.1e-05 q=3.9e-05 u=0.274  accept" in Tracer(letters).drafts([d], "(u < p/q)")[0]


def test_the_module_docstrings_example_is_what_the_tracer_prints():
    # Why: the example in engine/trace.py's docstring is a reader's first trace; it had gone
    # stale (aligned columns, p=0.050) while the tracer printed p=0.05
    import engine.trace
    shown = {0: " Paris", 1: ".", 2: ","}
    draft = lambda token, p, q, u, verdict: {"token": token, "p": p, "q": q, "u": u, "verdict": verdict}
    t = {"kind": "speculative", "position": 47, "k": 2, "verify": "rejection", "adaptive": False, "next": 2,
         "bonus": False, "drafts": [draft(0, 0.912, 0.85, 0.118, "accept"), draft(1, 0.05, 0.601, 0.402, "reject")]}
    doc = engine.trace.__doc__.split("\n\n")[-1].strip("\n").splitlines()
    assert Tracer(lambda ids: shown[ids[0]]).lines(12, t) == [line[4:] for line in doc]


def test_a_traced_answer_never_breaks_a_steps_lines(tiny_checkpoint, monkeypatch):
    # Why: on a terminal stdout and stderr are one stream, and the answer streamed between
    # steps ran into the next block's head ("1#1 @40 lookahead"); traced, it comes at the end
    import io
    import re
    from engine.doors.cli import main
    both = io.StringIO()
    monkeypatch.setattr("sys.stdout", both)
    monkeypatch.setattr("sys.stderr", both)
    argv = ["--checkpoint", str(tiny_checkpoint), "--prompt", "hi hi hi", "--max-new-tokens", "12", "--trace"]
    assert main(argv) == 0
    text = both.getvalue()
    assert len(re.findall(r"^#\d+ @", text, re.M)) >= 2 and not re.search(r"[^\n]#\d+ @\d+ ", text)


@pytest.mark.parametrize("name", ["lookahead W=3 N=3 G=3", "lookahead auto"])
def test_the_mask_is_drawn_once_for_each_run_of_one_window_shape(name):
    # Why: drawn whenever the trie's rows changed, the mask came back at nearly every step and
    # buried the window and the guesses; the guesses' lines say the trie, the picture the shape
    steps, _ = traced_steps(name, Sampler(), n_steps=40)
    tracer, drawn, shapes = Tracer(letters), 0, []
    for n, s in enumerate(steps):
        drawn += any("mask, drawn" in line for line in tracer.lines(n, s.trace))
        if not s.trace["first"]:
            shapes.append((len(s.trace["levels"][0]) if s.trace["levels"] else 0, s.trace["N"]))
    assert drawn == sum(a != b for a, b in zip([None] + shapes, shapes)) >= 1


@pytest.mark.parametrize("name", ["lookahead auto", "speculative adaptive self-draft"])
def test_an_adaptive_step_says_the_numbers_that_chose_it(name):
    # Why: "arm plain" or "K=0" alone does not tell a reader why the policy chose it; each
    # adaptive step after the prompt's shows the expected tokens per unit of cost behind its
    # choice. Broken variant run: the decoders' trace without the policy's `why` fails this
    import re
    steps, _ = traced_steps(name, Sampler(), n_steps=8)
    lines = [[line for line in Tracer(letters).lines(n, s.trace) if line.startswith("  why: ")]
             for n, s in enumerate(steps)]
    assert not lines[0] and all(len(w) == 1 for w in lines[1:]), lines
    assert all(re.search(r"\d\.\d\d", w[0]) for w in lines[1:])              # numbers, not a name alone
