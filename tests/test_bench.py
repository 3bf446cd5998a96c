"""The benchmark's CLI contract, and the packed linear path it times against nn.Linear.

The packed path is only a speed choice: it must give the logits nn.Linear gives (to float32
rounding), and by default a row's logits must not depend on how many rows share its forward.
"""
import json

import pytest
import torch

from engine import llama
from engine.kvcache import KVCache
from conftest import tiny_llama

needs_onednn = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="no oneDNN")


def fp32_pair(tie=False):
    from engine.bench import twin
    model = tiny_llama(0, vocab=64, tie=tie).float()
    return twin(model), llama.prepack(model)


@needs_onednn
@pytest.mark.parametrize("tie", [False, True])
def test_prepacked_model_gives_the_logits_of_nn_linear(tie):
    # why: prepack is a kernel swap, never a model change
    naive, packed = fp32_pair(tie)
    assert isinstance(packed.layers[0].feed_forward.w13, llama.PackedLinear)
    tokens, pos = torch.randint(0, 64, (1, 7)), torch.arange(7)
    a = naive(tokens, pos, KVCache.for_model(naive, 8))
    b = packed(tokens, pos, KVCache.for_model(packed, 8))
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_prepack_leaves_float64_models_alone():
    # why: the exactness tests run float64 models; they must keep nn.Linear
    model = llama.prepack(tiny_llama(0))
    assert type(model.layers[0].attention.wqkv) is torch.nn.Linear and model.packed_head is None


@needs_onednn
@pytest.mark.parametrize("shape", [(96, 40), (576, 1536)])  # (576, 1536): SmolLM2's down proj
def test_batch_invariant_rows_do_not_depend_on_the_row_count(shape):
    # why: a decoder verifying k rows must round row t exactly as a one-row step would
    lin = llama.PackedLinear(torch.randn(shape), min_rows=2)  # prepack(batch_invariant=True)
    x = torch.randn(1, 23, shape[1])
    full = lin(x)
    for n in range(1, 23):
        assert torch.equal(lin(x[:, :n]), full[:, :n])
        assert torch.equal(lin(x[:, n - 1:n]), full[:, n - 1:n])


@needs_onednn
def test_one_row_kernel_rounds_differently_so_the_padding_is_needed():
    # the broken variant: without the zero row, a one-row step takes oneDNN's matrix-vector
    # kernel, whose bits differ; the test above must be able to see that
    g = torch.Generator().manual_seed(0)
    lin = llama.PackedLinear(torch.randn(576, 1536, generator=g), min_rows=1)
    x = torch.randn(1, 8, 1536, generator=g)
    full = lin(x)
    assert any(not torch.equal(lin(x[:, t:t + 1]), full[:, t:t + 1]) for t in range(8))


def test_forward_cost_reports_every_k_for_every_model():
    from engine.bench import forward_cost, twin
    model = tiny_llama(0, vocab=64).float()
    out = forward_cost({"a": model, "b": twin(model)}, ks=(1, 3), prompt_len=5, repeats=2)
    assert set(out) == {"a", "b"} and set(out["a"]) == {1, 3}
    assert out["a"][1]["ratio"] == 1.0 and out["b"][3]["n"] == 2


@pytest.mark.parametrize("argv", [["--forward-cost", "--ks", "0"], ["--forward-cost", "--ks", "x"],
                                  ["--configs", "nope"], ["--roof", "--random-weights"], ["--forward-cost", "--repeats", "0"]])
def test_bad_arguments_exit_2_with_one_line(argv, capsys):
    from engine.bench import main
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2 and "error:" in capsys.readouterr().err


def test_missing_checkpoint_is_a_clean_error(tmp_path, capsys):
    from engine.bench import main
    assert main(["--forward-cost", "--checkpoint", str(tmp_path / "none")]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith("engine.bench: error:")


def test_compare_runs_every_config_and_checks_tokens_against_plain():
    # why: the benchmark's "same tokens" column is the exactness claim next to every speedup
    from engine.bench import CONFIGS, compare, markdown
    from engine import speculative
    model = tiny_llama(0, vocab=8, n_layers=3)
    configs = {"plain": CONFIGS["plain"], "lookahead W5 N4 G5": CONFIGS["lookahead W5 N4 G5"],
               "spec": (speculative.decode, speculative.SelfDraft(1), dict(num_draft=2))}
    prompts = {"a": [[1, 2, 3, 1, 2]], "b": [[4, 5], [6]]}
    table = compare(model, prompts, configs, repeats=1, max_new_tokens=12)
    for name in configs:
        for cat in prompts:
            assert table[name][cat]["same_tokens_as_plain"] == 1.0
    assert table["plain"]["a"]["speedup"] == 1.0 and table["plain"]["a"]["tokens_per_forward"] == 1.0
    assert table["spec"]["b"]["acceptance_by_position"]           # drafts were tried
    assert "| lookahead W5 N4 G5 |" in markdown(table, None)


@pytest.mark.parametrize("tie", [False, True])
def test_weight_bytes_counts_what_one_token_reads(tie):
    # every matrix and norm once, the head included; of the embedding table only a row is read,
    # so an untied model's table is not counted and a tied one's is counted once, as the head
    from engine.bench import weight_bytes
    model = tiny_llama(0, vocab=64, tie=tie)
    params = sum(p.numel() for p in model.parameters())
    table = model.tok_embeddings.weight.numel()
    assert weight_bytes(model.config, 8) == 8 * (params - (0 if tie else table))
