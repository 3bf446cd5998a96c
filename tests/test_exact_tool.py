"""tools/exact.py: its flags, and that its sweep tells an exact decoder from one that is not."""
import pytest

from conftest import tiny_llama
from engine.decoders import DECODERS
from engine.draft import EarlyExit
from engine.generate import Step, plain
from tools.exact import Run, compare, sweep

PROMPTS = {"a#0": [1, 2, 3, 1, 2], "b#0": [4, 5, 6, 7], "c#0": [2, 2, 2]}


@pytest.mark.parametrize("argv", [["--max-new-tokens", "0"], ["--max-new-tokens", "x"],
                                  ["--nope"], ["--quick", "1"], ["--no-batch-invariant=yes"],
                                  ["--paths", "fp16"], ["--paths", ""], ["--paths", "fp32,fp32"],
                                  ["--device", "tpu"], ["--device", "cuda", "--paths", "int4"]])
def test_bad_flags_exit_2_with_one_error_line(argv, capsys):
    from tools.exact import main
    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and err[0].startswith("error:")


def test_out_naming_a_file_and_a_missing_checkpoint_are_one_error_line(tmp_path, capsys):
    from tools.exact import main
    assert main(["--out", __file__]) == 2
    assert main(["--checkpoint", str(tmp_path / "none"), "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and all(line.startswith("tools.exact: error:") for line in err)


def broken(model, prompt, **kw):
    """Plain, but the fourth token of prompt b#0 is another one: not plain's tokens."""
    for i, step in enumerate(plain(model, prompt, **kw)):
        flip = prompt == PROMPTS["b#0"] and i == 3
        yield Step([(step.tokens[0] + 1) % model.config.vocab_size]) if flip else step


def test_sweep_finds_exact_decoders_identical_and_catches_a_flipped_token():
    # Why: the tool's table is the exactness proof; a comparison that cannot fail proves nothing
    model = tiny_llama(0, vocab=16, n_layers=2)
    la, sp = DECODERS["lookahead"], DECODERS["speculative"]
    rows = [Run("lookahead", la.decode, (), lambda m: {"window": 3, "ngram": 3, "guesses": 3}),
            Run("speculative coupled", sp.decode, (EarlyExit(1),), lambda m: {"num_draft": 3, "verify": "coupled"}),
            Run("broken", broken)]
    out = sweep(model, PROMPTS, (), 10, rows)
    for name in ("lookahead", "speculative coupled"):
        for mode in ("greedy", "seeded"):
            assert out[name][mode] == {"identical": 3, "total": 3, "first": None}
    for mode in ("greedy", "seeded"):
        assert out["broken"][mode]["identical"] == 2
        assert out["broken"][mode]["first"]["prompt"] == "b#0" and out["broken"][mode]["first"]["position"] == 3


def test_the_sweep_runs_every_registered_decoder_but_plain():
    # Why: `make exact` is the proof in tokens on the real weights; a decoder added to the
    # registry (docs/adding-a-decoder.md) must get its rows in tools/exact.py's runs()
    from tools.exact import runs
    swept = {r.decode for r in runs()}
    assert [name for name, d in DECODERS.items() if name != "plain" and d.decode not in swept] == []


def test_compare_names_the_first_difference_and_a_shorter_run():
    assert compare(["p", "q"], [[1, 2], [3, 4, 5]], [[1, 2], [3, 4]])["first"] == {
        "prompt": "q", "position": 2, "plain": [5], "decoder": []}
    assert compare(["p"], [[1, 2]], [[1, 9]])["identical"] == 0


def test_margin_is_zero_on_the_exact_fp32_path_and_not_without_it():
    # Why: --margin is how docs/exact-paths.md measures how near the near-exact fp32 path is;
    # it must read 0 where rows round alike (--batch-invariant) and see SDPA's rounding elsewhere
    import torch
    from engine.llama import Llama, LlamaConfig
    from engine.fast.packed import prepack
    from tools.exact import margin
    cfg = LlamaConfig(dim=64, n_layers=2, n_heads=9, n_kv_heads=3, hidden_dim=96, vocab_size=64,
                      head_dim=64)   # SmolLM2's heads, where SDPA rounds a row by the call's shape
    torch.manual_seed(0)
    model = Llama(cfg).float().requires_grad_(False)
    prompts = {"a#0": list(range(1, 40)), "b#0": [5, 9, 2, 7] * 5}
    exact = margin(prepack(model, batch_invariant=True), prompts, 20, rows=8)
    assert exact["steps"] == 40 and exact["max_diff"] == 0 and exact["gaps_below_max_diff"] == 0
    torch.manual_seed(0)
    near = margin(prepack(Llama(cfg).float().requires_grad_(False)), prompts, 20, rows=8)
    assert near["max_diff"] > 0
