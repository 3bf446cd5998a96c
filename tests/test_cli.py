"""The CLI as a new user meets it: one-line errors, exit 2, and the same text from every
greedy decoder as from plain on the real checkpoint."""
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import unnamed_decoders
from engine.doors.cli import before_stop, main, stats_line
from engine.load.weights import DEFAULT_CHECKPOINT

pytestmark = pytest.mark.usefixtures("user_threads")   # a user's threads: conftest.py

real = pytest.mark.skipif(not (DEFAULT_CHECKPOINT / "config.json").is_file(),
                          reason="needs the converted checkpoint (make weights)")
# asserts tokens or text that rest on this CPU's kernels: `make test` runs these again under a
# second dispatch (the rest of this file would only repeat itself there)
kernels = pytest.mark.kernels
FP32 = ["--dtype", "float32"]   # the fp32 path (HF's tokens) by name: the default is the 4-bit one on a CPU


@pytest.fixture(scope="module", autouse=True)
def built_once():
    """The CLI's models, each built once for this module and kept while used (the last 3): a
    build takes seconds, and these tests are about what the CLI does with the model (its
    loading is tests/test_weights.py's and tests/test_api.py's)."""
    import engine.doors.cli
    build, kept = engine.doors.cli.build, {}

    def once(checkpoint, **how):
        key = (str(checkpoint), *sorted(how.items()))
        kept[key] = kept.pop(key) if key in kept else build(checkpoint, **how)
        while len(kept) > 3:
            kept.pop(next(iter(kept)))                 # the least recently used
        return kept[key]
    with pytest.MonkeyPatch.context() as m:
        m.setattr(engine.doors.cli, "build", once)
        yield


@pytest.mark.parametrize("argv,words", [
    (["--decoder", "nope", "--prompt", "hi"], "invalid choice"),
    (["--temperature", "-1", "--prompt", "hi"], "temperature"),
    (["--top-p", "0", "--prompt", "hi"], "top-p"),
    (["--top-p", "1.5", "--prompt", "hi"], "top-p"),
    (["--max-new-tokens", "0", "--prompt", "hi"], "max-new-tokens"),
    (["--checkpoint", "/nonexistent/ckpt", "--prompt", "hi"], "not a directory"),
    (["--device", "cuda:0", "--prompt", "hi"], "CUDA"),
    (["--device", "meta", "--prompt", "hi"], "only cpu and cuda"),
    (["--no-prepack", "--batch-invariant", "--prompt", "hi"], "batch-invariant"),
    (["--stop", "", "--prompt", "hi"], "--stop"),
    (["--int4", "--dtype", "float32", "--prompt", "hi"], "bfloat16"),
    (["--compile", "--dtype", "float32", "--prompt", "hi"], "--int4"),
    (["--compile", "--int4", "--dtype", "bfloat16", "--no-batch-invariant", "--prompt", "hi"], "--compile"),
    (["--decoder", "speculative", "--draft", "layers:x", "--prompt", "hi"], "layers:L"),
    (["--decoder", "contrastive", "--amateur", "layers:²", "--prompt", "hi"], "layers:L"),
    (["--decoder", "speculative", "--draft", "ngram:0", "--prompt", "hi"], "ngram:n"),
    (["--decoder", "speculative", "--draft", "ngram:x", "--prompt", "hi"], "ngram:n"),
    (["--decoder", "speculative", "--draft", "ngrams", "--prompt", "hi"], "ngram:n"),
    (["--decoder", "contrastive", "--amateur", "ngram", "--prompt", "hi"], "amateur is a model"),
    (["--draft-cost", "0", "--prompt", "hi"], "--draft-cost"),
    (["--draft-cost", "nan", "--prompt", "hi"], "--draft-cost"),
])
def test_bad_input_is_one_line_and_exit_2(argv, words, capsys):
    with pytest.raises(SystemExit) as e:
        code = main(argv)
        raise SystemExit(code)
    err = capsys.readouterr().err
    assert e.value.code == 2 and words in err and len(err.strip().splitlines()) == 1, err


@real
@pytest.mark.parametrize("argv,words", [
    (["--prompt", "   "], "empty"),
    (["--prompt", "hi", "--max-new-tokens", "9000"], "context"),
    (["--decoder", "speculative", "--draft", "layers:99", "--prompt", "hi"], "layers"),
    (["--decoder", "lookahead", "--trim-layers", "31", "--prompt", "hi"], "trim_layers"),
    (["--decoder", "lookahead", "--trim-layers", "-1", "--prompt", "hi"], "trim_layers"),
    (["--decoder", "contrastive", "--beta", "-1", "--prompt", "hi"], "beta"),
    (["--decoder", "lookahead", "--cost-table", "/nonexistent.json", "--prompt", "hi"], "forward-cost"),
    (["--decoder", "speculative", "--draft", "int4", "--int4", "--dtype", "bfloat16", "--prompt", "hi"],
     "not 4-bit itself"),
])
def test_bad_input_on_the_real_checkpoint_is_one_line_and_exit_2(argv, words, capsys):
    # refused before the first token: no half answer on stdout ahead of the error
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert out == "" and words in err and len(err.strip().splitlines()) == 1, (out, err)


def run_json(argv, capsys):
    assert main(argv + ["--json"]) == 0
    return json.loads(capsys.readouterr().out)


PLAIN = {}


def plain_json(argv, capsys):
    """run_json of a plain command, run once per module: the reference many tests compare with
    (plain is deterministic: test_int4_commands_print_the_same_tokens_every_run)."""
    if tuple(argv) not in PLAIN:
        PLAIN[tuple(argv)] = run_json(argv, capsys)
    return PLAIN[tuple(argv)]


@real
@kernels
def test_plain_greedy_answers_as_the_reference_implementation_does(capsys):
    # Why: the same chat-templated prompt through HF transformers gave this text (golden.json).
    out = run_json([*FP32, "--prompt", "What is the capital of France?", "--max-new-tokens", "20"], capsys)
    assert out["text"] == "The capital of France is Paris."
    assert out["n_tokens"] == out["n_forwards"] == 8   # 7 tokens + <|im_end|>


@real
@kernels
@pytest.mark.parametrize("decoder", [["--decoder", "lookahead"], ["--decoder", "speculative"],
                                     ["--decoder", "contrastive", "--temperature", "0.7"]])
def test_int4_commands_print_the_same_tokens_every_run(decoder, capsys):
    # Why: --int4's text differs from fp32's and may differ from CPU to CPU (its kernels round
    # by CPU; tests/test_fidelity.py bounds how far); but one command on one machine must print
    # the same tokens every time, adaptive choices and sampling included.
    argv = ["--prompt", "Write a short story about a robot who learns to paint.",
            "--max-new-tokens", "24", "--int4", "--dtype", "bfloat16", "--seed", "3"] + decoder
    runs = [run_json(argv, capsys)["tokens"] for _ in range(2)]
    assert runs[0] == runs[1] and len(runs[0]) == 24


PROMPT = "Write a Python function that reverses a string."
GREEDY_DECODERS = {
    "lookahead": ["--decoder", "lookahead"],
    "lookahead trimmed": ["--decoder", "lookahead", "--trim-layers", "2"],
    "speculative": ["--decoder", "speculative"],
    "speculative int4 draft": ["--decoder", "speculative", "--draft", "int4"],
    "speculative self-draft": ["--decoder", "speculative", "--draft", "layers:20"],
    "speculative n-gram draft": ["--decoder", "speculative", "--draft", "ngram"],
    "speculative coupled": ["--decoder", "speculative", "--verify", "coupled", "--adaptive"],
    "contrastive beta=0": ["--decoder", "contrastive", "--beta", "0"],
    "lookup": ["--decoder", "lookup"],
}
INT4_DECODERS = ["lookahead", "lookahead trimmed", "speculative", "speculative coupled", "contrastive beta=0", "lookup"]


def test_every_registered_decoder_is_held_to_plain_on_the_real_checkpoint():
    # Why: a decoder added to the registry (docs/adding-a-decoder.md) must be run against plain
    # on the real weights, fp32 and int4, by the two tests below: a label of each list names it
    assert unnamed_decoders(GREEDY_DECODERS, but=["plain"]) == unnamed_decoders(INT4_DECODERS, but=["plain"]) == []


@real
@kernels
@pytest.mark.parametrize("name", GREEDY_DECODERS)
def test_greedy_decoders_print_what_plain_prints(name, capsys):
    # Why: a user switching --decoder at temperature 0 must see the same text, only faster.
    argv = [*FP32, "--prompt", PROMPT, "--max-new-tokens", "32", "--temperature", "0"]
    plain = plain_json(argv + ["--decoder", "plain"], capsys)
    other = run_json(argv + GREEDY_DECODERS[name], capsys)
    assert other["tokens"] == plain["tokens"] and other["text"] == plain["text"]


@real
@kernels
@pytest.mark.parametrize("verify", ["coupled", "rejection"])
def test_an_int4_draft_keeps_fp32_plain_sampling(verify, capsys):
    # Why: --draft int4 drafts in 4 bits, but the fp32 target decides every token: coupled
    # verification prints plain sampling's tokens for the seed; rejection keeps plain's law
    # (test_proofs), and one command prints the same tokens every run.
    argv = [*FP32, "--prompt", PROMPT, "--max-new-tokens", "32", "--temperature", "0.8", "--seed", "5"]
    plain = plain_json(argv, capsys)
    # --no-adaptive: K = 4 every step, whatever a busy machine's measured prices would say
    runs = [run_json(argv + ["--decoder", "speculative", "--draft", "int4", "--verify", verify, "--no-adaptive"],
                     capsys) for _ in range(2)]
    assert runs[0]["tokens"] == runs[1]["tokens"] and runs[0]["draft"] == "int4"
    assert runs[0]["draft_forwards"] > 0 and runs[0]["draft_mb"] > 50     # it drafted, and says its size
    # and it says which: plain's tokens (coupled), or only plain's law (rejection)
    held = {"coupled": ("plain's", None), "rejection": (None, "plain's")}[verify]
    assert (runs[0]["held_to"], runs[0]["law_of"]) == held
    if verify == "coupled":
        assert runs[0]["tokens"] == plain["tokens"]


@real
@pytest.mark.parametrize("price,want", [("0.05", "int4"), ("50", "ngram:3")])
def test_draft_auto_takes_the_draft_the_cost_model_prices_higher(price, want, capsys):
    # Why: the default draft is a choice; the stats say which was taken, and it is the one
    # `speculative.pays` ranks first (a 4-bit draft at 0.05 of a forward wins, at 50 loses to
    # the text's n-grams).
    out = run_json([*FP32, "--prompt", "hi", "--max-new-tokens", "4", "--decoder", "speculative",
                    "--draft-cost", price], capsys)
    assert out["draft"] == want and (out["draft_mb"] > 0) == (want == "int4")


@real
def test_draft_auto_builds_no_4_bit_draft_where_the_4_bit_kernel_is_scalar(monkeypatch, capsys):
    # Why: under a SIMD-less dispatch (ATEN_CPU_CAPABILITY=default) torch's 4-bit matmul is a
    # scalar loop, far dearer than the fp32 target: building that draft and timing its price
    # took minutes, for a draft auto never takes. There auto drafts from the text at once.
    import engine.doors.cli
    built, build = [], engine.doors.cli.build   # the module's kept builds (built_once)
    monkeypatch.setattr(engine.doors.cli, "ATEN_CAPABILITY", "DEFAULT")
    monkeypatch.setattr(engine.doors.cli, "build", lambda ckpt, **how: built.append(how["int4"]) or build(ckpt, **how))
    out = run_json([*FP32, "--prompt", "hi", "--max-new-tokens", "4", "--decoder", "speculative", "--draft-cost", "0.05"],
                   capsys)
    assert out["draft"] == "ngram:3" and built == [False]   # at 0.05 a 4-bit draft would have won


INT4_EXACT = ["--int4", "--dtype", "bfloat16"]   # exact by default: --batch-invariant is on for bf16 and int4


@real
@kernels
@pytest.mark.parametrize("name", INT4_DECODERS)
def test_int4_decoders_print_int4_plains_tokens_by_default(name, capsys):
    # Why: on --int4 a k-row forward used to round a row apart from plain's one-row forward, so
    # decoders left plain's tokens (4 prompts in 10 kept them). Now every kernel rounds a row
    # alike however many share the call (int4 matmuls, the head, and invariant.row_attention),
    # by default, so the 4-bit path is exact against its own plain, here and under the second
    # kernel dispatch of `make test`.
    decoder = GREEDY_DECODERS.get(name, ["--decoder", name])
    for prompt in (PROMPT, "List five fruits and their colours."):
        argv = ["--prompt", prompt, "--max-new-tokens", "40"] + INT4_EXACT
        plain = plain_json(argv, capsys)
        if not plain["exact_path"]:   # this CPU's int4 or bf16 kernel rounds by row count
            pytest.skip("invariant.rows_round_alike: this CPU's 4-bit kernels round a row by row count")
        other = run_json(argv + decoder, capsys)
        assert other["tokens"] == plain["tokens"] and other["exact_path"]


@real
@kernels
@pytest.mark.parametrize("path", [["--int4"], []], ids=["int4", "bf16"])   # make test's 2nd dispatch: int4 only
def test_4bit_and_bfloat16_paths_are_exact_by_default_and_say_so_only_without_the_flag(path, capsys):
    # Why: the exact kernels cost a bf16 or 4-bit one-row step nothing measurable (plain's step
    # is SDPA either way), so they are the default there; --no-batch-invariant turns them off,
    # and then the stats line says the tokens may leave plain's
    from engine.fast.paths import build
    from engine.fast.invariant import row_attention
    model = build(DEFAULT_CHECKPOINT, dtype=torch.bfloat16, int4=bool(path))   # the CLI's default build
    assert model.layers[0].attention.attend is row_attention        # the default did turn them on
    argv = ["--prompt", PROMPT, "--max-new-tokens", "24", "--dtype", "bfloat16", "--no-adaptive"] + path
    plain = run_json(argv, capsys)
    if not plain["exact_path"]:
        pytest.skip("invariant.rows_round_alike: this CPU's bf16 kernels round a row by row count")
    look = run_json(argv + ["--decoder", "lookahead"], capsys)
    assert look["tokens"] == plain["tokens"] and "tokens may differ" not in stats_line(look)
    off = run_json(argv + ["--decoder", "lookahead", "--no-batch-invariant"], capsys)
    assert not off["exact_path"] and "tokens may differ" in stats_line(off)


@real
@kernels
def test_batch_invariant_fp32_is_exact_and_default_fp32_says_near_exact(capsys):
    # Why: fp32's SDPA rounds a verified row ~1e-4 of a logit apart from plain's one row, so the
    # default fp32 path is called near-exact; --batch-invariant makes fp32 row-exact (attention
    # by invariant.row_attention), and there every decoder prints plain's tokens, bit for bit
    argv = [*FP32, "--prompt", PROMPT, "--max-new-tokens", "16", "--no-adaptive"]   # textbook loops: no pricing
    default = run_json(argv + ["--decoder", "lookup"], capsys)
    assert not default["exact_path"] and default["near_exact"]
    assert "near-exact path" in stats_line(default)
    plain = run_json(argv + ["--batch-invariant"], capsys)
    assert plain["exact_path"] and not plain["near_exact"]
    for decoder in (["lookahead"], ["speculative", "--draft", "layers:20", "--num-draft", "2"], ["lookup"]):
        other = run_json(argv + ["--batch-invariant", "--decoder"] + decoder, capsys)
        assert other["tokens"] == plain["tokens"] and other["exact_path"]


@real
@kernels
def test_int4_speculative_sampling_is_plains_with_the_seed(capsys):
    # Why: coupled verification promises plain sampling's tokens for the seed; on the exact
    # 4-bit path that promise now holds too
    argv = ["--prompt", PROMPT, "--max-new-tokens", "32", "--temperature", "0.8", "--seed", "2"] + INT4_EXACT
    plain = run_json(argv, capsys)
    if not plain["exact_path"]:
        pytest.skip("invariant.rows_round_alike: this CPU's 4-bit kernels round a row by row count")
    spec = run_json(argv + ["--decoder", "speculative", "--verify", "coupled", "--num-draft", "3"], capsys)
    assert spec["tokens"] == plain["tokens"]


@real
def test_streamed_text_equals_the_json_text(capsys):
    argv = [*FP32, "--prompt", "Say hi in French.", "--max-new-tokens", "12"]
    assert main(argv) == 0
    streamed = capsys.readouterr().out
    assert streamed.rstrip("\n") == run_json(argv, capsys)["text"]


@pytest.mark.parametrize("text,final,want", [
    ("A.\n\nQ: more", True, "A."),        # cut before the stop string
    ("A.\n\nQ: more", False, "A."),
    ("A.\n\n", False, "A."),              # a tail that may begin the stop string waits
    ("A.\n\n", True, "A.\n\n"),          # at the end it was not a stop string after all
    ("A.\nB", False, "A.\nB"),
    ("x Q: y", False, "x Q: y"),            # only the whole string stops
])
def test_text_before_a_stop_string(text, final, want):
    assert before_stop(text, ["\n\nQ:", "STOP"], final) == want


@real
@kernels
@pytest.mark.parametrize("decoder", ["plain", "lookahead"])
def test_stop_string_ends_the_answer_before_it(decoder, capsys):
    # Why: "--stop" is how a user ends an answer at a marker; the text must end just before it,
    # streamed or not, and every greedy decoder must stop on the same token.
    argv = [*FP32, "--prompt", "What is the capital of France?", "--max-new-tokens", "20",
            "--decoder", decoder, "--stop", "Paris", "--stop", "never seen"]
    out = run_json(argv, capsys)
    assert out["text"] == "The capital of France is "
    assert out["n_tokens"] == 6                # "Paris" completes on token 6 of 7 (+ EOS)
    assert main(argv) == 0
    assert capsys.readouterr().out == "The capital of France is \n"


@real
@kernels
def test_a_stop_string_spanning_several_tokens_is_seen(capsys):
    # Why: the CLI decodes only a tail of tokens per check; a stop string made of several
    # tokens must still fall inside it (a one-token tail would miss this one).
    out = run_json([*FP32, "--prompt", "What is the capital of France?", "--max-new-tokens", "20",
                    "--stop", "capital of France"], capsys)
    assert out["text"] == "The " and out["n_tokens"] == 4   # The / capital / of / France


def test_help_defines_every_stats_field_and_the_trace(capsys):
    # Why: a number on the stats line that --help does not define is a number nobody can read.
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    for field in ("tokens", "target forwards", "draft forwards", "tok/forward", "acceptance",
                  "hit rate", "tokens per step", "prefill", "decode", "near-exact path", "inexact path",
                  "rejection sampling", "--trace", "--lookup-ngram", "--lookup-tokens"):
        assert field in out, field


@real
def test_help_names_every_json_key(capsys):
    # Why: --json is read by programs; a key --help does not name is a key nobody can rely on
    keys = run_json([*FP32, "--prompt", "hi", "--max-new-tokens", "2", "--decoder", "speculative",
                     "--draft", "layers:20"], capsys)
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    assert [k for k in keys if not re.search(rf"\b{k}\b", out)] == []


def test_help_works_with_docstrings_stripped():
    # Why: --help's text is built from docstrings (the stats fields are engine.generate.Stats');
    # under python -OO they are None, and the CLI must still start, not raise at import
    out = subprocess.run([sys.executable, "-OO", "-m", "engine.run", "--help"], capture_output=True, text=True,
                         cwd=Path(__file__).resolve().parent.parent, timeout=120)
    assert out.returncode == 0 and "--decoder" in out.stdout and not out.stderr


@real
@kernels
def test_lookup_traces_its_steps_and_prints_plain_greedy_text(capsys):
    # Why: the fifth decoder runs from the CLI by its registry line and flags; its trace says,
    # step by step, exactly the tokens that were printed (the golden greedy answer).
    argv = [*FP32, "--prompt", "What is the capital of France?", "--max-new-tokens", "20", "--decoder", "lookup",
            "--lookup-ngram", "2", "--lookup-tokens", "5", "--trace", "--json"]
    assert main(argv) == 0
    out, err = capsys.readouterr()
    got = json.loads(out)
    assert got["text"] == "The capital of France is Paris." and got["n_tokens"] == 8
    emitted = [l for l in err.splitlines() if "emitted" in l or "plain step" in l or "(plain's)" in l]
    assert len(emitted) == got["n_forwards"] and err.startswith("#0 @")
    assert got["accepted"] == got["n_tokens"] - got["n_forwards"]


@real
@kernels
def test_a_self_draft_shows_its_draft_forwards(capsys):
    # Why: speculative with layers:8 once printed "acceptance 0.00" and hid its draft forwards;
    # they are counted now, and the trace shows each rejected draft with the models' p and q
    # (greedy: the laws are one-hot, so their 1 and 0 would say nothing).
    argv = [*FP32, "--prompt", "What is the capital of France?", "--max-new-tokens", "4", "--decoder", "speculative",
            "--draft", "layers:8", "--no-adaptive", "--num-draft", "3", "--trace"]
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert "reject  (the target's argmax is not x)" in err and "#3 @40 speculative" in err
    assert "models' p=" in err and "q=1.000" not in err
    assert "| 4 target forwards | 3 draft forwards (layers:8) |" in err   # K = 0 (the prompt's), 2, 1, 0: none past the budget


def test_the_stats_line_says_when_a_decoder_may_leave_plains_tokens():
    # Why: on --int4 or bf16 a k-row forward rounds apart from a one-row one, so lookahead's
    # tokens may differ from plain's there; the user must read that, not find it out
    from engine.doors.cli import stats_line
    r = {"decoder": "lookahead", "step_lengths": {1: 3}, "draft_forwards": 0, "acceptance": None,
         "n_tokens": 3, "n_forwards": 3, "tokens_per_forward": 1.0, "prefill_seconds": 0.1,
         "decode_tokens_per_second": 9.0, "exact_path": False, "held_to": "plain's"}
    assert "inexact path" in stats_line(r)
    assert "inexact" not in stats_line(r | {"exact_path": True})
    assert "inexact" not in stats_line(r | {"decoder": "plain", "held_to": None})
    # contrastive is held to its own one-row steps: --speculative may leave them, alone it cannot
    assert "differ from contrastive's" in stats_line(r | {"decoder": "contrastive", "held_to": "contrastive's"})
    assert "inexact" not in stats_line(r | {"decoder": "contrastive", "held_to": None})
    # sampled by rejection, a decoder keeps plain's law, not plain's tokens, on any path
    law = stats_line(r | {"decoder": "speculative", "held_to": None, "law_of": "plain's"})
    assert "plain's law, not plain's tokens" in law and "inexact" not in law


PROMISES = [
    ("plain", {}, 0.8, (None, None)),
    ("lookahead", {}, 0.8, ("plain's", None)),
    ("lookup", {}, 0.0, ("plain's", None)),
    ("lookup", {}, 0.8, ("plain's", None)),                                  # matched, not rejected
    ("speculative", {"verify": "rejection"}, 0.0, ("plain's", None)),        # greedy: tokens
    ("speculative", {"verify": "rejection"}, 0.8, (None, "plain's")),        # sampled: the law
    ("speculative", {}, 0.8, (None, "plain's")),                             # rejection is the default
    ("speculative", {"verify": "coupled"}, 0.8, ("plain's", None)),          # coupled: the seed's tokens
    ("contrastive", {"speculative": False}, 0.8, (None, None)),              # one-row steps only
    ("contrastive", {"speculative": True}, 0.0, ("contrastive's", None)),
    ("contrastive", {"speculative": True}, 0.8, (None, "contrastive's"))]


@pytest.mark.parametrize("name, knobs, temperature, want", PROMISES)
def test_each_decoder_promises_whose_tokens_or_law_its_registry_line_says(name, knobs, temperature, want):
    # Why: the stats line and --json's held_to/law_of tell a user what a run may be held to; the
    # registry (rejection, one_row, held_to), not the decoder's name, decides it
    from engine.decoders import DECODERS
    from engine.doors.cli import promise
    assert promise(DECODERS[name], knobs, temperature) == want


def test_every_registered_decoder_has_its_promise_pinned():
    # a new decoder's line must not inherit plain's promise unread: the table above names it
    from engine.decoders import DECODERS
    assert {name for name, *_ in PROMISES} == set(DECODERS)


def knob_defaults_that_disagree(parser) -> list[str]:
    """Each registered knob whose --knob-name flag is missing, or whose default is neither None
    (then decode()'s own default holds) nor decode()'s default."""
    import inspect
    from engine.decoders import DECODERS
    flags = {a.dest: a.default for a in parser._actions}
    wrong = []
    for name, d in DECODERS.items():
        own = {k: p.default for k, p in inspect.signature(d.decode).parameters.items()}
        for knob in d.names:
            if knob not in flags or flags[knob] not in (None, own[knob]):
                wrong.append(f"{name} {knob}: flag {flags.get(knob, 'missing')!r}, decode() {own[knob]!r}")
    return wrong


def test_every_knobs_flag_defaults_to_decodes_own_default():
    # Why: a knob's default is written twice, in decode() and in its CLI flag; the CLI must not
    # run a decoder with another value than the one its docstring and the API use
    from engine.doors.cli import parser
    assert knob_defaults_that_disagree(parser()) == []
    p = parser()
    p.set_defaults(lookup_tokens=9)                     # the broken variant: one default drifted
    assert knob_defaults_that_disagree(p) == ["lookup lookup_tokens: flag 9, decode() 8"]


@real
def test_the_first_run_says_where_it_kept_the_cost_table_and_later_runs_do_not(tmp_path, monkeypatch, capsys):
    # why: the table is measured once and priced with forever after, so the user must learn
    # where it went (a busy spell during that one measurement makes every k-row look dear)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    argv = [*FP32, "--prompt", "hi", "--max-new-tokens", "2", "--decoder", "lookahead"]
    notes = []
    for _ in range(2):
        assert main(argv) == 0
        notes.append([l for l in capsys.readouterr().err.splitlines() if l.startswith("note: measured")])
    assert len(notes[0]) == 1 and str(tmp_path / "engine") in notes[0][0] and notes[1] == []


@real
def test_a_home_that_cannot_keep_the_table_prices_by_constants_and_says_so(tmp_path, monkeypatch, capsys):
    # why: measured anew by every run, the prices (and on --int4 the tokens) could move from one
    # run of a command to the next; where nothing can be kept, nothing is measured
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "file"))
    monkeypatch.setattr("engine.adapt.cost.measure", lambda m: pytest.fail("measured where nothing can be kept"))
    assert main([*FP32, "--prompt", "hi", "--max-new-tokens", "2", "--decoder", "lookahead"]) == 0
    notes = [l for l in capsys.readouterr().err.splitlines() if l.startswith("note: ")]
    assert len(notes) == 1 and "cannot write the cache" in notes[0] and "fixed constants" in notes[0]


@real
def test_the_exact_claim_is_probed_once_per_machine_and_read_back(tmp_path, monkeypatch, capsys):
    # Why: exact_path rests on invariant.rows_round_alike, ~0.7 s of one-row head calls a run;
    # the CLI keeps its answer beside the prices (cost.probed) and later runs read it back.
    # Caught broken variant: run() calling the probe itself (no call was kept)
    import engine.fast.invariant
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    probe, said = engine.fast.invariant.rows_round_alike, []
    monkeypatch.setattr(engine.fast.invariant, "rows_round_alike", lambda m: said.append(probe(m)) or said[-1])
    argv = ["--prompt", "hi", "--max-new-tokens", "2"] + INT4_EXACT
    first, again = run_json(argv, capsys), run_json(argv, capsys)
    assert len(said) == 1 and first["exact_path"] == again["exact_path"] == said[0]   # its answer, kept


@real
@kernels
def test_the_default_path_is_named_and_every_decoder_prints_its_plains_tokens(capsys):
    # Why: `python -m engine.run --decoder lookahead` with no path flags must keep the promise
    # on the fastest path it can: here the 4-bit one (the model packs in groups of 32), named in
    # the stats line, where every decoder prints that path's plain tokens
    # (under a SIMD-less dispatch, make test's second pass on an AVX2 CPU, 4 bits would be a
    # scalar loop: there the default is fp32 with the batch-invariant kernels, exact too)
    from engine.fast.machine import ATEN_CAPABILITY
    name = "fp32 batch-invariant" if ATEN_CAPABILITY == "DEFAULT" else "int4 bf16"
    argv = ["--prompt", PROMPT, "--max-new-tokens", "24"]
    plain = run_json(argv, capsys)
    assert plain["path"] == name and (plain["path_why"] == "") == (name == "int4 bf16")
    if not plain["exact_path"]:
        pytest.skip("invariant.rows_round_alike: this CPU's kernels round a row by row count")
    for decoder in ("lookahead", "lookup"):
        other = run_json(argv + ["--decoder", decoder], capsys)
        assert other["tokens"] == plain["tokens"] and other["exact_path"] and other["path"] == name
    assert main(argv) == 0
    assert f"| path {name}" in capsys.readouterr().err.strip().splitlines()[-1]


def test_the_stats_line_names_the_path_and_why_the_default_fell_back():
    r = {"decoder": "plain", "n_tokens": 4, "n_forwards": 4, "draft_forwards": 0, "tokens_per_forward": 1.0,
         "acceptance": None, "step_lengths": {1: 4}, "prefill_seconds": 0.1, "decode_tokens_per_second": 9.0,
         "held_to": None, "exact_path": True, "path": "fp32 batch-invariant",
         "path_why": "projections that do not pack in 4-bit groups of 32"}
    line = stats_line(r)
    assert line.endswith("| path fp32 batch-invariant (the default here: projections that do not pack "
                         "in 4-bit groups of 32)")
    assert stats_line({**r, "path_why": ""}).endswith("| path fp32 batch-invariant")
