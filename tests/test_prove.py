"""The certification tool (tools/prove.py): its verdicts, its stated power, its command line.

Why it matters: the tool is meant for other people's samplers, so it must say PASS only when
the law is right, catch what it claims to catch, and answer bad input in one line.
"""
import json
import subprocess
import sys

import pytest
import torch

from engine.sampling import Sampler
from tools import prove
from tools.exact_law import reference_law

V, n = 4, 2
LAW = reference_law(lambda pre: prove.TableLM(11, V, Sampler(1.0))(pre), n)
N = 300_000            # the power table's sample count (docs/proofs.md)


def test_the_engine_samplers_pass_exactly():
    for name in ["engine-rejection", "engine-plain", "engine-speculative", "engine-coupled", "engine-lookahead"]:
        v = prove.certify(name, "exact", V, n, 2, Sampler(0.8, top_k=3), N, 0)
        assert v.passed and v.gap < 1e-12, v


def test_a_classic_bug_fails_exact_certification():
    # Why: a white-box PASS means something only if a wrong verifier gets FAIL: always
    # accepting emits the draft's law, not the target's.
    v = prove.certify("test_sampling:always_accept", "exact", V, n, 2, Sampler(1.0), N, 0)
    assert not v.passed and v.gap > 1e-3


def test_the_stated_power_reaches_tv_0_01_at_a_false_alarm_rate_of_1e_minus_6():
    assert prove.threshold(N, 16) < prove.detects(N, 16) < 0.01


@pytest.mark.parametrize("toward", ["mode", "uniform"])
@pytest.mark.parametrize("tv", [0.01, 0.02, 0.05])
def test_a_sampler_biased_by_tv_0_01_or_more_fails(tv, toward):
    # Why: the black-box mode claims every bias of TV >= 0.0092 is caught with probability
    # >= 0.99 at N = 300,000; three independent runs per planted bias must all be caught.
    sample = prove.planted(LAW, tv, toward, V, n)
    for seed in range(3):
        v = prove.certify_samples(f"planted {tv}", sample(N, seed), LAW, V)
        assert not v.passed and v.p_value < 1e-6, v


def test_an_unbiased_sampler_passes_repeated_runs():
    # Why: the false-alarm rate is <= 1e-6 by construction (Hoeffding + union bound), so
    # 20 runs of an exact sampler must all pass; the planted TV 0 sampler draws from the law.
    sample = prove.planted(LAW, 0.0, "mode", V, n)
    for seed in range(20):
        v = prove.certify_samples("unbiased", sample(N, seed), LAW, V)
        assert v.passed and v.gap < v.threshold, v


def test_a_planted_bias_has_exactly_the_tv_it_claims():
    keys = sorted(LAW)
    counts = torch.bincount(prove.planted(LAW, 0.05, "uniform", V, n)(400_000, 1)[:, 0] * V
                            + prove.planted(LAW, 0.05, "uniform", V, n)(400_000, 1)[:, 1], minlength=V * V)
    tv = 0.5 * sum(abs(float(counts[a * V + b]) / 400_000 - LAW[(a, b)]) for a, b in keys)
    assert abs(tv - 0.05) < 0.005


def test_the_engine_verifier_passes_black_box_and_always_accept_fails():
    ok = prove.certify("engine-rejection", "stat", V, n, 2, Sampler(1.0), 2000, 0)
    bad = prove.certify("test_sampling:always_accept", "stat", V, n, 2, Sampler(1.0), 2000, 0)
    assert ok.passed and not bad.passed, (ok, bad)


def test_a_token_outside_the_vocabulary_fails_at_once():
    samples = prove.planted(LAW, 0.0, "mode", V, n)(1000, 0)
    samples[3, 1] = -1
    v = prove.certify_samples("pads with -1", samples, LAW, V)
    assert not v.passed and "outside" in v.note


def raises(p, q, drafts):
    raise RuntimeError("boom")


def test_a_sampler_that_raises_fails_instead_of_crashing_the_tool():
    v = prove.certify("test_prove:raises", "stat", V, n, 2, Sampler(1.0), 10, 0)
    assert not v.passed and "RuntimeError: boom" in v.note


def cli(*args):
    return subprocess.run([sys.executable, "-m", "tools.prove", *args], capture_output=True, text=True,
                          env={"PYTHONPATH": ".:tests", "PATH": ""})


def test_cli_exit_codes_json_and_a_one_line_error_in_a_fresh_process():
    ok = cli("planted:0", "planted:0.05", "--mode", "stat", "--samples", "20000", "--json")
    verdicts = json.loads(ok.stdout)
    assert ok.returncode == 1 and [v["passed"] for v in verdicts] == [True, False], ok
    bad = cli("no_such_module:f")
    assert bad.returncode == 2 and bad.stdout == "" and bad.stderr.startswith("error:"), bad
    assert bad.stderr.count("\n") == 1


def main(args, capsys):
    try:
        rc = prove.main(args)
    except SystemExit as e:   # argparse's own errors, through tools.cli.Parser
        rc = e.code
    out, err = capsys.readouterr()
    return rc, out, err


def test_cli_passes_with_exit_0_and_prints_a_table(capsys):
    rc, out, _ = main(["engine-rejection", "engine-plain"], capsys)
    assert rc == 0 and out.count("| PASS |") == 2


@pytest.mark.parametrize("args", [["no_such_module:f"], ["tools.prove:nope"], ["plain"], ["engine-rejection", "--vocab", "1"],
                                  ["engine-rejection", "--draft-len", "-1"], ["--mode", "stat", "planted:0.9"],
                                  ["hf-speculative", "--draft-len", "0", "--mode", "stat"], ["engine-rejection", "--top-p", "2"],
                                  ["engine-rejection", "--temperature", "0"], ["engine-plain", "--mode", "stat"],
                                  ["test_sampling:always_accept", "--samples", "x"], ["test_prove:raises"], []])
def test_cli_bad_input_is_one_error_line_exit_2(args, capsys):
    rc, out, err = main(args, capsys)
    assert rc == 2 and out == "" and err.startswith("error:") and err.count("\n") == 1, (rc, out, err)


def says_nothing(p, q, drafts, rng, position):
    return []


def test_a_verifier_that_returns_nothing_fails_instead_of_hanging():
    v = prove.certify("test_prove:says_nothing", "exact", V, n, 2, Sampler(1.0), N, 0)
    assert not v.passed and "no token" in v.note


def test_the_threshold_holds_for_thousands_of_outcomes():
    # ln(2^m - 2) overflows as a float power for m > 1023
    assert 0 < prove.threshold(10**6, 4096) < 1


def wrong_bonus_row(p, q, drafts, rng, position):
    """The classic bug: after K accepted drafts, the bonus drawn from p_K-1, the last draft's row."""
    from test_sampling import MUTANTS
    return MUTANTS["bonus from p_K-1 (the last draft's row) instead of p_K"][0](p, q, drafts, rng, position)


def test_the_default_window_checks_the_bonus_token(capsys):
    # Why: the defaults were n = 2 tokens for K = 2 drafts, so a verifier's own token after K
    # accepted drafts (its third) was never checked, and a wrong bonus row passed; n now
    # defaults to K + 1, and a window that still misses it says so
    rc, out, err = main(["test_prove:wrong_bonus_row"], capsys)
    assert rc == 1 and "| FAIL |" in out and "note" not in err
    rc, out, err = main(["test_prove:wrong_bonus_row", "--tokens", "2"], capsys)   # the old default
    assert rc == 0 and "| PASS |" in out and "a wrong bonus row cannot fail" in err
