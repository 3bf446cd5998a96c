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

try:
    import transformers
    from transformers.generation.utils import _speculative_sampling
except ImportError:
    if os.environ.get("CI") == "true":
        raise   # in CI a missing extra is a failure, never a silent skip
    pytest.skip("transformers not installed (pip install -r requirements-test.txt)", allow_module_level=True)

from engine.sampling import Sampler
from tools import prove

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
