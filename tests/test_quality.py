"""The quality report's metrics, on examples small enough to count by hand, and its plumbing
on a tiny model: the numbers in docs/quality.md mean only what these tests pin down."""
import math

import pytest
import torch

from tools import quality
from tools.quality import (Config, distinct_n, evaluate, markdown, ngram_entropy, perplexity,
                            repeat_rate, summarize)
from engine.load.weights import DEFAULT_CHECKPOINT
from engine.sampling import Sampler
from conftest import tiny_llama

ALTERNATING = [1, 2, 1, 2, 1, 2]   # bigrams 12 21 12 21 12; trigrams 121 212 121 212


def test_distinct_n_counts_unique_ngrams_over_all_ngrams():
    # Why: distinct-n is the paper-standard diversity number; off-by-one windows change it.
    assert distinct_n(ALTERNATING, 1) == 2 / 6
    assert distinct_n(ALTERNATING, 2) == 2 / 5
    assert distinct_n(ALTERNATING, 3) == 2 / 4
    assert distinct_n([1, 2, 3, 4, 5], 2) == 1.0
    assert distinct_n([1, 2], 3) == 0.0       # no trigram at all: nothing to be distinct


def test_repeat_rate_counts_ngrams_seen_at_an_earlier_start():
    # Why: this is the "greedy loops" number; the first occurrence must not count as a repeat.
    assert repeat_rate(ALTERNATING, 2) == 3 / 5            # 12 21 [12 21 12]
    assert repeat_rate(ALTERNATING, 4) == 1 / 3            # 1212 2121 [1212]
    assert repeat_rate([7, 7, 7, 7, 7], 4) == 1 / 2        # overlapping repeats count
    assert repeat_rate([1, 2, 3, 4, 5, 6], 4) == 0.0
    assert repeat_rate([1, 2, 3], 4) == 0.0                # too short for one 4-gram


def test_ngram_entropy_is_shannon_entropy_of_ngram_counts_in_bits():
    # Why: bits, over the empirical n-gram law: 3 x "12" and 2 x "21" -> H(3/5, 2/5).
    h = -(0.6 * math.log2(0.6) + 0.4 * math.log2(0.4))
    assert ngram_entropy(ALTERNATING, 2) == pytest.approx(h)          # 0.971 bits
    assert ngram_entropy(ALTERNATING, 1) == pytest.approx(1.0)        # two tokens, 3 each
    assert ngram_entropy([1, 2, 3, 4, 5], 2) == pytest.approx(2.0)    # 4 distinct bigrams
    assert ngram_entropy([5, 5, 5], 2) == 0.0
    assert ngram_entropy([5], 2) == 0.0


def test_perplexity_of_a_uniform_model_is_the_vocabulary_size():
    # Why: a model that knows nothing (all logits equal) must score any text at exactly V.
    model = tiny_llama(0)
    model.output.weight.zero_()
    assert perplexity(model, [1, 2, 3], [4, 5, 6, 7]) == pytest.approx(16.0)


def test_perplexity_is_the_mean_nll_of_the_output_tokens_given_the_prompt():
    # Why: one forward must score exactly the output rows, shifted by one, not the prompt.
    model, prompt, output = tiny_llama(1), [3, 1, 4], [1, 5, 9, 2]
    nll = []
    for i, x in enumerate(output):
        seq = prompt + output[:i]
        logits = model(torch.tensor([seq]), torch.arange(len(seq)))[0, -1]
        nll.append(-logits.log_softmax(-1)[x].item())
    assert perplexity(model, prompt, output) == pytest.approx(math.exp(sum(nll) / len(nll)))
    with pytest.raises(ValueError):
        perplexity(model, prompt, [])


def test_evaluate_runs_every_config_prompt_and_seed_and_summary_averages_them():
    # Why: the table averages over exactly the outputs it claims (nucleus: every seed).
    model = tiny_llama(0)
    prompts = {"chat": [[1, 2, 3]], "code": [[4, 5], [6, 7, 8]]}
    cfgs = [Config("greedy", Sampler()),
            Config("nucleus", Sampler(temperature=1.0, top_p=0.95), sampled=True),
            Config("CD", Sampler(), 1, dict(alpha=0.1, beta=0.5, form="logit"))]
    records = evaluate(model, cfgs, prompts, seeds=[0, 1], max_new_tokens=6)
    assert len(records) == 3 + 6 + 3
    assert all(r["n_tokens"] == 6 and len(r["tokens"]) == 6 for r in records)
    summary = summarize(records)
    assert summary["nucleus"]["all"]["n_outputs"] == 6
    assert summary["greedy"]["code"]["n_outputs"] == 2
    code = [r["repeat_4"] for r in records if r["config"] == "greedy" and r["category"] == "code"]
    assert summary["greedy"]["code"]["repeat_4"] == pytest.approx(sum(code) / 2)
    table = markdown(summary, 6)
    assert all(f"| {c.name} |" in table for c in cfgs) and "chat | code" in table


def test_outputs_are_written_whole_via_a_renamed_temporary_file(tmp_path):
    # Why: a killed run must never leave a half-written report where a reader expects one.
    quality.write_atomic(tmp_path / "quality.md", b"table\n")
    summary = {"greedy": {"all": {"repeat_4": 0.1, "perplexity": 2.0}}}
    quality.plot(summary, tmp_path / "quality.png")
    assert (tmp_path / "quality.md").read_bytes() == b"table\n"
    assert (tmp_path / "quality.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["quality.md", "quality.png"]


@pytest.mark.parametrize("argv,words", [
    (["--bogus"], "unrecognized"),
    (["--max-new-tokens", "x"], "invalid int"),
    (["--max-new-tokens", "0"], "max-new-tokens"),
    (["--seeds", "0"], "seeds"),
    (["--checkpoint", "/nonexistent/ckpt"], "not a directory"),
    # --out is checked before the long run: here it names a file (the checkpoint, the real one)
    pytest.param(["--out", __file__], "--out", marks=pytest.mark.skipif(
        not (DEFAULT_CHECKPOINT / "config.json").is_file(), reason="needs the converted checkpoint")),
])
def test_bad_flags_are_one_line_and_exit_2(argv, words, capsys):
    with pytest.raises(SystemExit) as e:
        raise SystemExit(quality.main(argv))
    err = capsys.readouterr().err
    assert e.value.code == 2 and words in err and len(err.strip().splitlines()) == 1, err
