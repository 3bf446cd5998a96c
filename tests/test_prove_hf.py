"""HF transformers' speculative sampler, certified black-box by tools/prove.py.

Why it matters: users who outgrow this engine run the same algorithm in transformers'
assisted generation; `_speculative_sampling` is the function that accepts or rejects the
assistant's tokens when sampling, and it draws from torch's global RNG, so only the
statistical mode can judge it. transformers is a pinned test extra (requirements-test.txt,
installed by `make setup`); without it these tests skip locally but fail under CI=true.
"""
import json
import os
from pathlib import Path

import pytest
import torch

try:
    import transformers
    from transformers.generation.utils import _speculative_sampling
except ImportError:
    if os.environ.get("CI") == "true":
        raise   # in CI a missing extra is a failure, never a silent skip
    pytest.skip("transformers not installed (pip install -r requirements-test.txt)", allow_module_level=True)

from engine.sampling import Sampler
from tools import prove, prove_hf

V, n = 4, 2
N = 8000       # ~6 s per case; detects TV >= 0.056 (the full 300,000-run table is in docs/proofs.md)


def test_the_installed_transformers_is_the_pinned_one():
    pin = [line for line in Path("requirements-test.txt").read_text().splitlines() if line.startswith("transformers==")]
    assert pin == [f"transformers=={transformers.__version__}"]


@pytest.mark.parametrize("K,sampler", [(2, Sampler(1.0)), (1, Sampler(0.7, top_k=3))], ids=["K=2 t=1", "K=1 t=0.7 top-k=3"])
def test_hf_speculative_sampling_keeps_the_target_law(K, sampler):
    v = prove.certify("hf-speculative", "stat", V, n, K, sampler, N, 0)
    assert v.passed and v.detects < 0.06, v


def hf_told_q_is_p(p, q, drafts):
    """A caller's bug, not HF's: the assistant's logits replaced by the target's."""
    return prove.hf_speculative(p, p[:len(drafts)], drafts)


def test_hf_fed_the_wrong_draft_law_fails():
    # Why: shows this test can fail through HF's own function: with q := p every draft is
    # accepted, so the tokens follow the draft's law, not the target's.
    v = prove.certify("test_prove_hf:hf_told_q_is_p", "stat", V, n, 2, Sampler(1.0), 2000, 0)
    assert not v.passed and v.p_value < 1e-6, v


def test_hf_returns_the_drafts_it_accepts_and_one_more_token():
    # Why: the adapter must hand HF's output back unchanged: with p = q all K drafts pass
    # (ratio 1 >= r for r in [0, 1)), then the bonus token follows.
    import torch
    p = torch.full((3, V), 1 / V, dtype=torch.float64)
    out = prove.hf_speculative(p, p[:2], [3, 1])
    assert out[:2] == [3, 1] and len(out) == 3 and 0 <= out[2] < V
    assert _speculative_sampling.__module__ == "transformers.generation.utils"


def hf_kept(logits, t, k, top_p) -> set[int]:
    """HF's own warpers in generate()'s order: temperature, top-k, top-p."""
    import torch
    from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper
    x = torch.tensor([logits], dtype=torch.float64)
    for warp in [TemperatureLogitsWarper(t)] + ([TopKLogitsWarper(k)] if k else []) + \
                ([TopPLogitsWarper(top_p)] if top_p < 1 else []):
        x = warp(None, x)
    return set(torch.softmax(x[0], -1).nonzero().flatten().tolist())


def test_hf_filters_agree_with_ours_except_which_tie_top_p_keeps():
    # Why: the Sampler docstring claims HF's order and conventions but one: at a tie that
    # straddles the top-p cut we keep the lower ids, HF the higher ones (as many tokens).
    from test_filters import EXAMPLES
    differ = {name for name, (x, t, k, p, want) in EXAMPLES.items() if hf_kept(x, t, k, p) != want}
    assert differ == {"top-p tie at the cut keeps the lower id", "top-p over four equal tokens keeps the two lowest ids",
                      "top-p just above 3/4 takes one more"}     # 1/8, 1/8: the third token is a tie too
    for name in differ:
        x, t, k, p, want = EXAMPLES[name]
        assert len(hf_kept(x, t, k, p)) == len(want)


def test_hf_assisted_generation_end_to_end_passes_at_a_coarse_power(capsys):
    # Why: the whole generate(assistant_model=..., do_sample=True) path, processors included;
    # at N = 300 it detects TV >= 0.29, and emitting the assistant's law instead (TV 0.58) would
    # fail. The 20,000-sample run is in docs/proofs.md.
    from tools import prove_hf
    assert prove_hf.main(["--samples", "300", "--json"]) == 0
    (v,) = json.loads(capsys.readouterr().out)
    assert v["passed"] and v["detects"] < 0.3
    a, d = prove_hf.target_law(prove_hf.tiny_hf_llama(5, 3), 1.0), prove_hf.target_law(prove_hf.tiny_hf_llama(6, 1), 1.0)
    assert 0.5 * sum(abs(a[k] - d[k]) for k in a) > 0.5


# --------------------------------------------------------------------------- --grid

def spy_on_hf_verification(monkeypatch) -> list:
    """Every call of HF's _speculative_sampling inside generate(): (candidate ids, q logits, p logits)."""
    import transformers.generation.utils as hf
    calls, real = [], hf._speculative_sampling

    def spy(ids, q_logits, k, p_logits, **kw):
        calls.append((ids[0].tolist(), q_logits[0].double(), p_logits[0].double()))
        return real(ids, q_logits, k, p_logits, **kw)
    monkeypatch.setattr(hf, "_speculative_sampling", spy)
    return calls


def test_the_grids_target_law_applies_the_processors_hf_applies_to_the_target(monkeypatch):
    # Why: a grid verdict compares HF's tokens with a law we compute; if our law processed the
    # target's logits otherwise than HF does (order, top-k ties, top-p's cut), a correct HF
    # would FAIL, or a wrong one PASS. Here HF's own processed target rows, as its verifier
    # receives them, are held to ours at every setting of the grid; and its first step drafts 2.
    calls = spy_on_hf_verification(monkeypatch)
    target, assistant = prove_hf.pair()
    at, K = prove_hf.logits_of(target), set()
    for s in prove_hf.GRID:
        calls.clear()
        prove_hf.draws(target, assistant, prove_hf.config(s, prove_hf.GRID_TOKENS), 3, 0)
        for ids, q, p in calls:
            k, K = q.shape[0], K | {q.shape[0]}
            for i in range(k + 1):
                prefix = tuple(ids[len(prove_hf.PROMPT):len(ids) - k + i])
                assert (torch.softmax(p[i], -1) - s.probs(at(prefix))).abs().max() < 1e-6, (s, prefix)
    assert K == {1, 2}     # 2 drafts on the first step; 1 where a rejection left 2 tokens to go


def test_the_plants_exact_law_is_the_target_law_where_no_processor_bites():
    # Why: the plant is the bug class "declared q != sampled q", nothing else: with q' = q its
    # exact law is the target's at every setting, and with q' = the raw logits too where the
    # processors change nothing (t = 1, top-k 0 or 50 >= V, top-p 1); elsewhere it plants a TV.
    target, assistant = prove_hf.pair(plant=True)
    n, K = prove_hf.GRID_TOKENS, prove_hf.GRID_DRAFTS
    for s in prove_hf.GRID:
        want = prove_hf.law(target, s, n)
        assert prove_hf.tv(prove_hf.assisted_law(target, assistant, s, n, K, "processed"), want) < 1e-12
        planted = prove_hf.tv(prove_hf.assisted_law(target, assistant, s, n, K, "raw"), want)
        assert (planted < 1e-12) == (s in (Sampler(1.0), Sampler(1.0, 50))), (s, planted)


def test_the_grid_passes_hf_where_temperature_top_k_and_top_p_all_bite():
    # Why: a setting where every processor changes the law, through the whole generate() path.
    # A PASS is robust at any N (a false alarm is <= 1e-6 by construction); N = 300 detects TV
    # >= 0.32 over its 27 outcomes only: the 5,000-run grid is in docs/proofs.md.
    (v,) = prove_hf.grid(300, samplers=[Sampler(0.8, 3, 0.9)])
    assert v.passed and v.samples == 300, v


def test_the_grid_fails_the_planted_raw_q_assistant_where_top_k_bites():
    # Why: the grid must catch the bug class transformers had in 2026 (issue #47932: drafters
    # that sample from the processed logits but return the raw ones as q, lossy under the default
    # top_k=50). At t = 1, top-k = 2 (of V = 4) the plant's exact law is TV 0.12 from the
    # target's (0.1225); N = 1,500 detects TV >= 0.1195 with probability >= 0.99 over its 8
    # outcomes, so it FAILs; the same samples PASS against the plant's own exact law: the FAIL is the declared
    # q's, not noise or the harness's.
    s, N = Sampler(1.0, 2), 1500
    target, assistant = prove_hf.pair(plant=True)
    planted = prove_hf.assisted_law(target, assistant, s, prove_hf.GRID_TOKENS, prove_hf.GRID_DRAFTS, "raw")
    tv = prove_hf.tv(planted, prove_hf.law(target, s, prove_hf.GRID_TOKENS))
    v, samples = prove_hf.setting(target, assistant, s, N, 0, plant=True)
    assert v.outcomes == 8 and v.detects < 0.1196 < tv, v
    assert not v.passed and v.p_value < 1e-6 and v.note == f"planted TV {tv:.3f} (exact)", v
    assert prove.certify_samples("the plant against its own law", samples, planted, V).passed


def test_grid_prints_one_row_per_setting_and_says_where_top_k_is_a_no_op(capsys):
    # Why: the table is the grid's answer: 16 settings, each named, top-k 50 marked as doing
    # nothing on a vocabulary of 4 (a PASS there says nothing about top-k); --plant needs --grid,
    # and --grid takes no --temperature of its own (it would be silently ignored).
    assert prove_hf.main(["--plant"]) == 2 and prove_hf.main(["--grid", "--temperature", "0.8"]) == 2
    assert prove_hf.main(["--grid", "--samples", "5"]) in (0, 1)
    rows = [r for r in capsys.readouterr().out.splitlines() if r.startswith("| HF")]
    assert len(rows) == 16 and sum("top-k=50 (>= V = 4: no-op)" in r for r in rows) == 4
