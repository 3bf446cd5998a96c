"""--receipt (engine/doors/receipt.py): after a run, the same prompt through that path's plain
decoder, and where the two part. On an exact path it must read "identical"; on a path made
inexact on purpose it must name the first token where they part and plain's top-2 gap there."""
import json

import pytest
import torch

from engine import lookahead
from engine.decoders import DECODERS
from engine.doors.cli import main
from engine.doors.receipt import line, receipt


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory):
    """test_hostile's tiny converted checkpoint: a real tokenizer and chat template, 2 layers."""
    import tools.convert
    from test_hostile import write_gguf
    d = tmp_path_factory.mktemp("tiny")
    return tools.convert.convert(write_gguf(d / "tiny.gguf"), d / "ckpt")


SECOND = {"contrastive": ["--amateur", "layers:1"], "speculative": ["--draft", "layers:1", "--no-adaptive"]}


def run(ckpt, capsys, *flags):
    # fp32 with the batch-invariant kernels: exact by construction on every CPU (the tiny model's
    # 4-bit default is exact only where this CPU's probe agrees)
    argv = ["--checkpoint", str(ckpt), "--prompt", "the the the", "--max-new-tokens", "16", "--receipt", "--json",
            "--dtype", "float32", "--batch-invariant"]
    assert main(argv + list(flags)) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("decoder", list(DECODERS))
def test_every_decoder_on_an_exact_path_gets_an_identical_receipt(tiny_checkpoint, capsys, decoder):
    # Why: a user asking "is this answer plain's?" on the exact path must hear yes, for every
    # decoder, greedy and seeded (coupled keeps the seed's tokens)
    for extra in (["--temperature", "0"], ["--temperature", "0.9", "--seed", "3", "--verify", "coupled"]):
        if decoder != "speculative" and "--verify" in extra:
            extra = extra[:4]
        out = run(tiny_checkpoint, capsys, "--decoder", decoder, *SECOND.get(decoder, []), *extra)
        assert out["receipt"]["identical"] is True and out["receipt"]["tokens"] == out["n_tokens"], out["receipt"]


def test_a_path_made_inexact_gets_the_first_token_where_it_parts(tiny_checkpoint, capsys, monkeypatch):
    # Why: where the promise does not hold (a kernel that rounds k rows apart, here perturbed on
    # purpose), the receipt is the user's only evidence: the first divergent token and how near
    # a tie plain was there. The perturbation: every k-row forward's logits pushed towards
    # token 5, so lookahead's verification accepts what plain never draws
    real = lookahead.tree_forward

    def skewed(model, cache, tokens, parent, keep, trim):
        logits = real(model, cache, tokens, parent, keep, trim)
        if len(tokens) > 1:
            logits = logits.clone()
            logits[:, 5] += 100.0
        return logits
    monkeypatch.setattr(lookahead, "tree_forward", skewed)
    out = run(tiny_checkpoint, capsys, "--decoder", "lookahead", "--window", "3", "--guesses", "3")
    r = out["receipt"]
    assert r["identical"] is False and 0 < r["index"] < out["n_tokens"] and r["got"] == out["tokens"][r["index"]]
    assert r["plain"] != r["got"] and r["gap"] >= 0 and out["tokens"][:r["index"]] == r["agreed"]


def test_the_receipt_compares_token_by_token():
    # the unit: identical; parted at 2; one ended (EOS) where the other went on
    assert line({"identical": True, "tokens": 4}).startswith("receipt: identical")
    r = {"identical": False, "index": 2, "position": 9, "plain": 7, "got": 8, "gap": 0.0123, "agreed": [1, 2]}
    assert line(r, show=str) == ("receipt: parts from plain at new token 2 (position 9): plain 7, this run 8; "
                                 "plain's top-2 logit gap there 0.0123")


def test_the_receipt_on_a_real_model_is_identical_for_plain_itself():
    # the broken variant a receipt must not be: one that compares the run with itself would say
    # identical for a perturbed run too; this one replays plain, so a run that is not plain's
    # (here: plain's tokens with one changed) parts at the change
    from conftest import tiny_llama
    from engine.generate import generate, plain
    from engine.sampling import Random, Sampler
    model = tiny_llama(0)
    want = list(generate(plain(model, [1, 2, 3], sampler=Sampler(), rng=Random(0), max_new_tokens=8),
                         max_new_tokens=8))
    ref = lambda: plain(model, [1, 2, 3], sampler=Sampler(), rng=Random(0), max_new_tokens=8)
    assert receipt(model, [1, 2, 3], want, ref())["identical"]
    bent = want[:3] + [(want[3] + 1) % 16] + want[4:]
    r = receipt(model, [1, 2, 3], bent, ref())
    assert not r["identical"] and r["index"] == 3 and r["plain"] == want[3] and r["agreed"] == want[:3]


def test_the_api_receipt_is_the_clis(tiny_checkpoint, capsys):
    from engine.api import Engine
    llm = Engine.load(tiny_checkpoint, dtype=torch.float32, batch_invariant=True)
    r = llm.receipt("the the the", decoder="lookahead", max_new_tokens=16)
    assert r == {"identical": True, "tokens": len(list(llm.tokens("the the the", max_new_tokens=16)))}
    cli = run(tiny_checkpoint, capsys, "--decoder", "lookahead")["receipt"]
    assert cli["identical"] and cli["tokens"] == r["tokens"]


API_SECOND = {"contrastive": 1, "speculative": 1}
API_KNOBS = {"speculative": {"adaptive": False}}


@pytest.mark.parametrize("decoder", list(DECODERS))
def test_the_api_and_the_cli_hold_every_decoder_to_the_same_reference(tiny_checkpoint, capsys, decoder):
    # Why: the API's receipt replayed plain for every decoder while the CLI held contrastive to
    # its own one-row steps, so the two doors could call one exact run identical and not identical.
    # Both now take engine/doors/receipt.py's `reference`; seeded, contrastive parts from plain
    from engine.api import Engine
    llm = Engine.load(tiny_checkpoint, dtype=torch.float32, batch_invariant=True)
    kw = dict(decoder=decoder, max_new_tokens=16, temperature=0.9, seed=3, **API_KNOBS.get(decoder, {}))
    if decoder in API_SECOND:
        kw["second"] = API_SECOND[decoder]
    api = llm.receipt("the the the", **kw)
    cli = run(tiny_checkpoint, capsys, "--decoder", decoder, *SECOND.get(decoder, []),
              "--temperature", "0.9", "--seed", "3")["receipt"]
    assert api == {k: v for k, v in cli.items() if k != "line"}
    if decoder == "speculative":   # rejection sampling keeps plain's law, not its draws
        return
    assert api["identical"], api
