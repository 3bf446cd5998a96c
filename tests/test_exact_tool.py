"""tools/exact.py: its flags, and that its sweep tells an exact decoder from one that is not."""
import pytest

from conftest import tiny_llama
from engine.decoders import DECODERS
from engine.draft import SelfDraft
from engine.generate import Step, plain
from tools.exact import Run, compare, sweep

PROMPTS = {"a#0": [1, 2, 3, 1, 2], "b#0": [4, 5, 6, 7], "c#0": [2, 2, 2]}


@pytest.mark.parametrize("argv", [["--max-new-tokens", "0"], ["--max-new-tokens", "x"],
                                  ["--nope"], ["--quick", "1"], ["--no-batch-invariant=yes"]])
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
            Run("speculative coupled", sp.decode, (SelfDraft(1),), lambda m: {"num_draft": 3, "verify": "coupled"}),
            Run("broken", broken)]
    out = sweep(model, PROMPTS, (), 10, rows)
    for name in ("lookahead", "speculative coupled"):
        for mode in ("greedy", "seeded"):
            assert out[name][mode] == {"identical": 3, "total": 3, "first": None}
    for mode in ("greedy", "seeded"):
        assert out["broken"][mode]["identical"] == 2
        assert out["broken"][mode]["first"]["prompt"] == "b#0" and out["broken"][mode]["first"]["position"] == 3


def test_compare_names_the_first_difference_and_a_shorter_run():
    assert compare(["p", "q"], [[1, 2], [3, 4, 5]], [[1, 2], [3, 4]])["first"] == {
        "prompt": "q", "position": 2, "plain": [5], "decoder": []}
    assert compare(["p"], [[1, 2]], [[1, 9]])["identical"] == 0
