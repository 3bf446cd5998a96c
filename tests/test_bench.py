"""The benchmark's CLI contract and its measurements' bookkeeping."""
import json
from pathlib import Path
import shlex

import pytest
import torch

from conftest import tiny_llama


def test_forward_cost_reports_every_k_for_every_model():
    from tools.bench import forward_cost, twin
    model = tiny_llama(0, vocab=64).float()
    out = forward_cost({"a": model, "b": twin(model)}, ks=(1, 3), prompt_len=5, repeats=2)
    assert set(out) == {"a", "b"} and set(out["a"]) == {1, 3}
    assert out["a"][1]["ratio"] == 1.0 and out["b"][3]["n"] == 2


@pytest.mark.parametrize("argv", [["--forward-cost", "--ks", "0"], ["--forward-cost", "--ks", "x"],
                                  ["--configs", "nope"], ["--roof", "--random-weights"], ["--memory", "--random-weights"],
                                  ["--forward-cost", "--repeats", "0"], ["--forward-cost", "--int4"],
                                  ["--memory", "--int4", "--dtype", "bfloat16"],
                                  ["--forward-cost", "--out", __file__]])   # --out names a file
def test_bad_arguments_exit_2_with_one_line(argv, capsys):
    from tools.bench import main
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2 and "error:" in capsys.readouterr().err


def test_missing_checkpoint_is_a_clean_error(tmp_path, capsys):
    from tools.bench import main
    assert main(["--forward-cost", "--checkpoint", str(tmp_path / "none")]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith("tools.bench: error:")


def test_compare_runs_every_config_and_checks_tokens_against_plain():
    # why: the benchmark's "same tokens" column is the exactness claim next to every speedup
    from tools.bench import CONFIGS, compare, markdown
    from engine import speculative
    model = tiny_llama(0, vocab=8, n_layers=3)
    configs = {"plain": CONFIGS["plain"], "lookahead W5 N4 G5": CONFIGS["lookahead W5 N4 G5"],
               "spec": ("speculative", speculative.EarlyExit(1), dict(num_draft=2))}
    prompts = {"a": [[1, 2, 3, 1, 2]], "b": [[4, 5], [6]]}
    table = compare(model, prompts, configs, repeats=1, max_new_tokens=12)
    for name in configs:
        for cat in prompts:
            assert table[name][cat]["same_tokens_as_plain"] == 1.0
    assert table["plain"]["a"]["speedup"] == 1.0 and table["plain"]["a"]["tokens_per_forward"] == 1.0
    # "all" pools every prompt, and each cell carries the spread of its per-run speedups
    assert table["spec"]["all"]["speedup_range"][0] <= table["spec"]["all"]["speedup"] <= table["spec"]["all"]["speedup_range"][1]
    assert table["spec"]["b"]["acceptance_by_position"]           # drafts were tried
    assert "| lookahead W5 N4 G5 |" in markdown(table)


def test_an_outside_reference_is_one_more_row_checked_against_plain():
    # why: HF's generate runs as a callable config, interleaved with ours; its tokens are
    # compared too, so a reference that answers differently shows under "same tokens"
    from tools.bench import CONFIGS, compare, hf_reference
    from engine.generate import generate, plain
    from engine.sampling import Random, Sampler
    model = tiny_llama(0, vocab=8)

    def reference(prompt, shift=0):
        steps = plain(model, prompt, sampler=Sampler(), rng=Random(0), max_new_tokens=6)
        tokens = [(t + shift) % 8 for t in generate(steps, max_new_tokens=6)]
        return {"tokens": tokens, "tok_s": 1.0, "forwards": len(tokens), "drafted": [], "accepted": []}
    configs = {"plain": CONFIGS["plain"], "same": reference, "other": lambda p: reference(p, 1)}
    table = compare(model, {"a": [[1, 2, 3]]}, configs, repeats=1, max_new_tokens=6)
    assert table["same"]["a"]["same_tokens_as_plain"] == 1.0
    assert table["other"]["a"]["same_tokens_as_plain"] == 0.0
    assert table["same"]["a"]["tokens_per_forward"] == 1.0
    assert hf_reference("/nonexistent/python", Path("."), 6) is None
    with pytest.raises(ValueError, match="--hf-python"):   # named on the command line: an error
        hf_reference("/nonexistent/python", Path("."), 6, required=True)


def test_compiled_rows_are_held_to_the_compiled_plains_tokens(monkeypatch):
    # why: the compiled exact path (--compile) is a path of its own, whose plain may print other
    # tokens than eager plain; its lookahead and lookup must be compared with its plain, or
    # the "same tokens" column would blame them for the compiler's rounding. Caught broken
    # variant: a baseline() that answers plain for every row (0% against eager plain here)
    import tools.bench as bench
    other = tiny_llama(1, vocab=8)                     # "compiled": another model, other tokens
    monkeypatch.setattr(bench, "build", lambda *a, **k: other)
    monkeypatch.setattr(bench, "compile_step", lambda model, notify: model)
    configs = {"plain": bench.CONFIGS["plain"]} | bench.compiled_configs(Path("."), "", (), 10)
    assert set(configs) == {"plain", "plain --compile", "lookahead auto --compile", "lookup --compile",
                            "speculative n-gram adaptive --compile", "plain again --compile"}
    table = bench.compare(tiny_llama(0, vocab=8), {"a": [[1, 2, 3, 1, 2, 3]]}, configs, repeats=1, max_new_tokens=10)
    assert table["plain --compile"]["a"]["same_tokens_as_plain"] == 0.0     # another path
    for name in ("lookahead auto", "lookup", "speculative n-gram adaptive", "plain again"):
        assert table[f"{name} --compile"]["a"]["same_tokens_as_plain"] == 1.0


def test_a_row_is_compared_with_plain_on_its_own_path():
    # why: a speed-up and a "same tokens" cell mean something only against plain on the same
    # model and kernels; a plain row of another path is itself a speed-up over plain
    from tools.bench import baseline
    configs = ["plain", "plain --int4", "lookahead auto --int4", "plain --int4 --compile",
               "lookup --int4 --compile", "lookup --compile", "speculative int4 adaptive",
               "plain again --int4 --compile", "plain again"]
    assert [baseline(n, configs) for n in configs] == [
        "plain", "plain", "plain --int4", "plain", "plain --int4 --compile", "plain", "plain",
        "plain --int4 --compile", "plain"]


def test_a_text_only_reference_is_a_row_whose_tokens_are_not_compared():
    # why: llama.cpp prints text, not our ids: its row has a speed but no "same tokens" claim
    from tools.bench import CONFIGS, compare, markdown
    model = tiny_llama(0, vocab=8)
    text_only = lambda p: {"tokens": None, "tok_s": 2.0, "forwards": 6, "drafted": [], "accepted": []}
    table = compare(model, {"a": [[1, 2, 3]]}, {"plain": CONFIGS["plain"], "llama.cpp": text_only},
                    repeats=1, max_new_tokens=6)
    assert table["llama.cpp"]["a"]["same_tokens_as_plain"] is None
    assert table["llama.cpp"]["a"]["tokens_per_forward"] == 1.0
    assert "| llama.cpp |" in markdown(table) and "not compared" in markdown(table)
    assert table["plain"]["a"]["same_tokens_as_plain"] == 1.0


def test_hfs_reference_splits_its_decode_from_its_prompt_and_answers_the_golden_tokens():
    # why: HF's row in the decode table is the AVX2 target's yardstick (issue 24: int4 plain
    # >= 3x HF); its rate must leave the prompt's forward out, as the engine's and llama.cpp's do
    import sys
    from tools.bench import hf_reference
    from engine.load.weights import DEFAULT_CHECKPOINT
    pytest.importorskip("transformers")
    if not (DEFAULT_CHECKPOINT / "config.json").is_file():
        pytest.skip("run `make weights` first")
    case = json.loads((Path(__file__).parent / "golden.json").read_text())["cases"][0]
    name, run = hf_reference(sys.executable, DEFAULT_CHECKPOINT, 8)
    r = run(case["input_ids"])
    assert r["tokens"] == case["output_ids"][:8] and name.startswith("HF transformers")
    # the decode rate counts 7 tokens over the steps after the prompt's: faster than the whole
    assert r["decode_tok_s"] > r["tok_s"] > 0


def test_the_decode_table_compares_rates_with_the_prompts_forward_excluded():
    # why: issue 24 compares decode tok/s with llama.cpp's eval rate; a prompt's forward costs
    # the engine more than llama.cpp's prompt eval, so rates with it would compare prefills too
    from tools.bench import CONFIGS, compare, markdown
    model = tiny_llama(0, vocab=8)
    timed = lambda p: {"tokens": None, "tok_s": 2.0, "decode_tok_s": 3.0, "forwards": 6, "drafted": [], "accepted": []}
    unsplit = lambda p: {"tokens": None, "tok_s": 2.0, "forwards": 6, "drafted": [], "accepted": []}
    table = compare(model, {"a": [[1, 2, 3]]}, {"plain": CONFIGS["plain"], "llama.cpp": timed, "hf": unsplit},
                    repeats=1, max_new_tokens=6)
    assert table["llama.cpp"]["a"]["decode_tok_s"] == 3.0 and table["hf"]["a"]["decode_tok_s"] is None
    assert table["plain"]["a"]["decode_tok_s"] > 0
    decode = markdown(table).split("Decode tok/s")[1]
    assert "| llama.cpp | 3.0 | 3.0 |" in decode and "| hf | - | - |" in decode


def test_a_bad_llama_cpp_binary_exits_2_before_the_long_run(tmp_path, capsys):
    from tools.bench import main
    from engine.load.weights import DEFAULT_CHECKPOINT
    if not (DEFAULT_CHECKPOINT / "config.json").is_file():
        pytest.skip("needs make weights")
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    argv = ["--quick", "--rounds", "1", "--configs", "plain", "--hf-python", "/nonexistent/python",
            "--llama-cpp", str(tmp_path / "none"), "--gguf", str(gguf), "--out", str(tmp_path / "out")]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--llama-cpp" in err[0], err   # the one line: no "loading" ahead of it
    assert main(argv[:-6] + ["--out", str(tmp_path / "out")]) == 2   # the python named, not there
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--hf-python" in err[0], err


def test_split_refuses_an_out_it_cannot_write_in_one_line(tmp_path, capsys):
    # Why: tools.split printed "split: fp32" before its error line for --out /dev/full
    from tools.split import main
    from engine.load.weights import DEFAULT_CHECKPOINT
    if not (DEFAULT_CHECKPOINT / "config.json").is_file():
        pytest.skip("needs make weights")
    (tmp_path / "file").write_text("")
    assert main(["--checkpoint", str(DEFAULT_CHECKPOINT), "--out", str(tmp_path / "file" / "below")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "error:" in err[0] and "--out" in err[0], err


@pytest.mark.parametrize("tie", [False, True])
def test_weight_bytes_counts_what_one_token_reads(tie):
    # every matrix and norm once, the head included; of the embedding table only a row is read,
    # so an untied model's table is not counted and a tied one's is counted once, as the head
    from tools.bench import weight_bytes
    model = tiny_llama(0, vocab=64, tie=tie)
    params = sum(p.numel() for p in model.parameters())
    table = model.tok_embeddings.weight.numel()
    assert weight_bytes(model.config, 8) == 8 * (params - (0 if tie else table))


def test_cost_plot_is_written_whole(tmp_path):
    from tools.bench import plot_cost
    cost = {"engine": {1: {"ms": 30.0}, 8: {"ms": 33.0}}, "naive": {"1": {"ms": 50.0}, "8": {"ms": 70.0}}}
    plot_cost(cost, tmp_path / "c.png")                     # int keys live, str keys from JSON
    assert (tmp_path / "c.png").read_bytes()[:4] == b"\x89PNG" and len(list(tmp_path.iterdir())) == 1


def test_forward_cost_run_writes_its_json_plot_and_command(tmp_path, capsys):
    # why: `make bench` prints tables; the JSON and the plot it leaves are what docs/ keeps
    from tools.bench import main
    argv = ["--forward-cost", "--random-weights", "--ks", "1,2", "--repeats", "1", "--out", str(tmp_path)]
    assert main(argv) == 0
    saved = json.loads((tmp_path / "forward-cost.json").read_text())
    assert set(saved["forward_cost"]["engine"]) == {"1", "2"}
    assert saved["command"] == "python -m tools.bench " + shlex.join(argv)
    assert (tmp_path / "forward-cost.png").stat().st_size > 0
    # a figure is true of one machine: the JSON names it (CPU, the ISA flags that change
    # kernels, threads, torch and its dispatch)
    m = saved["machine"]
    assert m["cpu"] and m["torch"] == torch.__version__ and m["threads"] >= 1 and m["dispatch"]
    assert set(m["isa"]) <= {"avx2", "avx512f", "avx512_bf16", "avx512_fp16", "avx512_vnni", "amx_tile", "amx_bf16"}


def test_host_split_counts_every_forward_and_restores_the_model():
    # why: "host work per step" is step time less the time inside the model; an early-exit
    # draft runs the model through lower()/upper()/head(), which must count as model time too
    from tools.bench import CONFIGS, host_split
    from engine import speculative
    from engine.llama import Llama
    model = tiny_llama(0, vocab=8, n_layers=3)
    before = (Llama.blocks, Llama.head)
    configs = {"plain": CONFIGS["plain"], "spec": ("speculative", speculative.EarlyExit(1), dict(num_draft=2))}
    split = host_split(model, [1, 2, 3, 1, 2], configs, max_new_tokens=8, repeats=1)
    assert set(split) == {"plain", "spec"}
    for s in split.values():
        assert s["forward_ms"] > 0 and s["host_ms"] >= 0 and 0 <= s["host_share"] <= 1
    assert (Llama.blocks, Llama.head) == before


TOOLS = ("bench", "split", "exact", "fidelity", "quality", "prove", "prove_hf", "scale", "convert")


def test_every_tool_starts_with_docstrings_stripped():
    # Why: the tools' --help descriptions come from their docstrings, which python -OO strips
    # (None); each tool must still start there, as engine.doors.cli does (tests/test_cli.py)
    import subprocess
    import sys
    code = ("import contextlib, importlib, io, sys\n"
            f"for t in {TOOLS!r}:\n"
            "    with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):\n"
            "        importlib.import_module('tools.' + t).main(['--help'])\n"
            "    print(t, 'ok')\n")
    out = subprocess.run([sys.executable, "-OO", "-c", code], capture_output=True, text=True,
                         cwd=Path(__file__).resolve().parent.parent, timeout=300)
    assert out.returncode == 0 and out.stdout.split() == [w for t in TOOLS for w in (t, "ok")], out.stderr[-2000:]


def test_a_figure_taken_under_another_kernel_dispatch_says_so(monkeypatch):
    # why: `make test`'s second dispatch (ATEN_CPU_CAPABILITY=avx2 and its two companions) or
    # OMP_NUM_THREADS change the kernels and threads a figure was measured with; the machine
    # line every table carries names them, and names nothing when none is set
    from engine.fast.artifacts import kernel_env
    from tools.machine import describe, machine
    for k in kernel_env():
        monkeypatch.delenv(k, raising=False)
    assert machine()["env"] == {} and "=" not in describe(machine())
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    assert describe(machine()).endswith(", ONEDNN_MAX_CPU_ISA=AVX2")


def test_a_steps_bytes_are_what_its_modules_hold_on_every_path():
    # why: the roof divides bandwidth by the bytes a step reads; counted from fp32 shapes it
    # overstated a 4-bit step's 4x (and a packed weight, which has no storage, broke the count)
    from engine.fast.packed import prepack, quantize_int4
    from tools.bench import step_bytes, weight_bytes
    from conftest import int4_copy
    fp32 = prepack(tiny_llama(0, vocab=64, tie=True).float())
    assert step_bytes(fp32) == weight_bytes(fp32.config, 4) + 4 * fp32.config.dim   # and one embedding row
    q = int4_copy(tiny_llama(0, vocab=64, tie=True, hidden=64).float())
    layers = sum(t.nbytes for b in q.layers for m in (b.attention.wqkv, b.feed_forward.w2) for t in (m.packed, m.scales))
    assert layers < step_bytes(q) < weight_bytes(q.config, 4) / 3
