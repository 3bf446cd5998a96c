"""engine/doors/api.py: the CLI's answer from Python, every decoder by name, and the README's snippet
runs as written."""
import json
import re
from pathlib import Path

import pytest
import torch

from engine.adapt.policy import POLICIES
from engine.decoders import DECODERS
from engine.doors.api import Engine
from engine.doors.cli import main
from engine.load.tokenizer import Tokenizer
from engine.load.weights import DEFAULT_CHECKPOINT, load_model
from test_weights import hf_tensors, write_gguf
from tools.convert import convert

pytestmark = pytest.mark.usefixtures("user_threads")   # a user's threads: conftest.py


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    d = tmp_path_factory.mktemp("api")
    return convert(write_gguf(d / "tiny.gguf", hf_tensors(seed=3)), d / "ckpt")


def test_generate_gives_the_clis_text(ckpt, capsys):
    # Why: the API is the CLI without flags; one prompt must give one answer through either
    argv = ["--checkpoint", str(ckpt), "--prompt", "the the", "--max-new-tokens", "12",
            "--decoder", "plain", "--temperature", "0", "--json"]
    assert main(argv) == 0
    cli = json.loads(capsys.readouterr().out)
    llm = Engine.load(ckpt)
    assert llm.generate("the the", max_new_tokens=12) == cli["text"]
    assert llm.stats.n_tokens == cli["n_tokens"] and llm.stats.n_forwards == cli["n_forwards"]


@pytest.mark.parametrize("decoder", DECODERS)
def test_every_decoder_by_name_gives_plains_tokens(ckpt, decoder):
    # float64, unpacked: k-row and one-row forwards cannot flip a near tie (tests/conftest.py)
    llm = Engine(load_model(ckpt, dtype=torch.float64), Tokenizer.load(ckpt))
    kw = {"second": 1} if DECODERS[decoder].second else {}
    kw |= {"beta": 0.0} if decoder == "contrastive" else {}
    want = list(llm.tokens("the the the", max_new_tokens=16))
    assert list(llm.tokens("the the the", decoder=decoder, max_new_tokens=16, **kw)) == want
    # and under a policy (the default: a 1-layer self-draft is priced at K = 0 here)
    assert list(llm.tokens("the the the", decoder=decoder, max_new_tokens=16, adaptive=False, **kw)) == want
    # and it is the named decoder that ran: plain neither drafts nor runs a second model
    assert (llm.stats.drafted + llm.stats.draft_forwards > 0) == (decoder != "plain")


def test_batch_invariant_fp32_gives_plains_tokens_from_every_decoder(ckpt):
    # Why: batch_invariant is the API's --batch-invariant; fp32 rows then round alike, bit for bit
    from engine.fast.invariant import row_attention, rows_round_alike
    llm = Engine.load(ckpt, dtype=torch.float32, batch_invariant=True)
    assert llm.model.layers[0].attention.attend is row_attention and rows_round_alike(llm.model)
    want = list(llm.tokens("the the the", max_new_tokens=16))
    for decoder in ("lookahead", "lookup", "speculative"):
        kw = {"second": 1} if DECODERS[decoder].second else {}
        assert list(llm.tokens("the the the", decoder=decoder, max_new_tokens=16, adaptive=False, **kw)) == want


def test_int4_is_the_clis_4_bit_path(ckpt, capsys):
    # Why: Engine.load(int4=True) is the API's --int4 --dtype bfloat16: the same 4-bit layers
    # and, by default as there, the exact kernels, so one prompt gives the CLI's tokens and
    # every decoder gives its plain's
    from engine.fast.invariant import rows_round_alike
    from engine.fast.packed import Int4Linear
    argv = ["--checkpoint", str(ckpt), "--prompt", "the the", "--max-new-tokens", "12", "--int4",
            "--dtype", "bfloat16", "--json"]
    assert main(argv) == 0
    cli = json.loads(capsys.readouterr().out)
    llm = Engine.load(ckpt, int4=True)
    assert isinstance(llm.model.layers[0].feed_forward.w13, Int4Linear)
    assert list(llm.tokens("the the", max_new_tokens=12)) == cli["tokens"]
    exact = llm
    if not rows_round_alike(exact.model):   # as the CLI's exact claim, it rests on this CPU's probe
        pytest.skip("invariant.rows_round_alike: this CPU's 4-bit kernels round a row by row count")
    want = list(exact.tokens("the the the", max_new_tokens=16))
    assert list(exact.tokens("the the the", decoder="lookahead", max_new_tokens=16, adaptive=False)) == want


def test_a_policy_reads_the_prices_the_cli_gives_it(ckpt, monkeypatch, capsys):
    # Why: on an inexact path (int4, bf16) a price moves the tokens too (another copy length
    # sends other rows, which round apart), so the API's adaptive decoders must be priced as the
    # CLI's are: this machine's measured costs, not fixed slopes
    import dataclasses
    seen, real = [], POLICIES["lookup"].build

    def spy(model, prices, knobs):
        seen.append(prices)
        return real(model, prices, knobs)

    monkeypatch.setitem(POLICIES, "lookup", dataclasses.replace(POLICIES["lookup"], build=spy))
    for _ in range(2):   # a first run (greedy: no price moves its tokens) answers, then measures
        assert main(["--checkpoint", str(ckpt), "--prompt", "the the", "--max-new-tokens", "4",
                     "--decoder", "lookup", "--json"]) == 0
    capsys.readouterr()
    Engine.load(ckpt).generate("the the", decoder="lookup", max_new_tokens=4)
    assert len(seen) == 3 and seen[0].table is None and seen[1].table and seen[2] == seen[1]


@pytest.mark.skipif(not (DEFAULT_CHECKPOINT / "config.json").is_file(), reason="run `make weights` first")
@pytest.mark.parametrize("decoder", ["lookup", "lookahead"])
def test_int4_adaptive_decoders_print_the_clis_tokens(decoder, capsys):
    # Why: the same prompt, decoder and path through the API and the CLI is one answer, also
    # where k-row forwards round apart (int4 without its exact kernels) and the policy's prices
    # choose the rows (here, a lookup priced by fixed slopes left the CLI's tokens at the 6th)
    prompt = "Write a short story about a robot who learns to paint."
    assert main(["--prompt", prompt, "--max-new-tokens", "48", "--int4", "--dtype", "bfloat16",
                 "--no-batch-invariant", "--decoder", decoder, "--json"]) == 0
    cli = json.loads(capsys.readouterr().out)
    llm = Engine.load(int4=True, dtype=torch.bfloat16, batch_invariant=False)
    assert list(llm.tokens(prompt, decoder=decoder, max_new_tokens=48)) == cli["tokens"]


def test_the_device_is_where_the_weights_go_and_batch_invariant_needs_a_cpu_or_cuda(ckpt):
    # Why: Engine.load(device=) is the API's --device (docs/cuda.md: an H200 ran every decoder);
    # on meta the weights go there, unpacked, and batch_invariant, whose kernels are the
    # CPU's and CUDA's, is one ValueError
    llm = Engine.load(ckpt, device="meta")
    assert llm.model.tok_embeddings.weight.device.type == "meta" and llm.model.packed_head is None
    with pytest.raises(ValueError, match="CPU or CUDA"):
        Engine.load(ckpt, device="meta", batch_invariant=True)


@pytest.mark.parametrize("device, words", [("bogus", "not a device"), ("cuda:99", "CUDA"), (3.5, "not a device")])
def test_a_device_that_is_not_here_is_one_value_error(ckpt, device, words):
    # Why: the API's errors are ValueErrors, as the CLI's `error:` lines; torch would raise an
    # AssertionError ("not compiled with CUDA") or a RuntimeError from deep inside the load
    with pytest.raises(ValueError, match=words):
        Engine.load(ckpt, device=device)


def test_stream_pieces_join_to_the_text(ckpt):
    llm = Engine.load(ckpt)
    pieces = list(llm.stream([5, 6, 7], max_new_tokens=10, temperature=0.9, seed=4))
    assert "".join(pieces) == llm.generate([5, 6, 7], max_new_tokens=10, temperature=0.9, seed=4)
    assert llm.stats.n_tokens == 10


@pytest.mark.parametrize("kw, words", [
    ({"decoder": "beam"}, "decoder 'beam'"),
    ({"decoder": "lookahead", "num_draft": 3}, "no knob 'num_draft'"),
    ({"decoder": "speculative"}, "takes second="),
    ({"decoder": "plain", "second": 2}, "takes no second"),
    ({"max_new_tokens": 10**6}, "context"),
])
def test_bad_arguments_are_value_errors(ckpt, kw, words):
    with pytest.raises(ValueError, match=words):
        Engine.load(ckpt).generate("the", **kw)


@pytest.mark.parametrize("prompt, kw, words", [
    ([10**6], {}, "token ids"), ([-5], {}, "token ids"), ([], {}, "empty"), ("  ", {}, "empty"),
    ([5], {"max_new_tokens": 0}, "max_new_tokens"), ([5], {"max_new_tokens": 10**6}, "context"),
    ([5], {"decoder": "speculative", "second": 2.5}, "layer count .*a Llama"),
    ([5], {"decoder": "speculative", "second": "layers:8"}, "self-draft layers must be in"),   # the CLI's spec
    ([5], {"decoder": "beam"}, "decoder 'beam'"), ([5], {"temperature": -1}, "temperature"),
    ([5], {"decoder": "lookahead", "adaptive": "false"}, "adaptive"),   # a truthy string: not True
])
def test_bad_arguments_raise_at_the_call_not_at_the_first_token(ckpt, prompt, kw, words):
    # Why: an error that waits for the first next() lands far from the line that caused it, and
    # an IndexError from the embedding or a silent empty answer is no error line at all
    llm = Engine.load(ckpt)
    for call in (llm.tokens, llm.stream):
        with pytest.raises(ValueError, match=words):
            call(prompt, **kw)                                      # called, never iterated


def test_bad_loads_are_value_errors(ckpt):
    with pytest.raises(ValueError, match="not a directory"):
        Engine.load(ckpt / "nonexistent")
    with pytest.raises(ValueError, match="packed=False"):   # the CLI's --no-prepack --batch-invariant
        Engine.load(ckpt, packed=False, batch_invariant=True)


@pytest.mark.skipif(not (DEFAULT_CHECKPOINT / "config.json").is_file(), reason="run `make weights` first")
def test_the_readme_snippet_runs(capsys):
    readme = (Path(__file__).parent.parent / "README.md").read_text()
    code = re.search(r"## Python API\n\n```python\n(.*?)```", readme, re.S)[1]
    exec(compile(code, "README.md", "exec"), {})
    out = capsys.readouterr().out
    assert "Paris" in out and re.search(r"\d+ tokens in \d+ forwards", out)
    assert out.startswith(("int4 bf16 | ", "fp32 batch-invariant | "))   # the default path, named
