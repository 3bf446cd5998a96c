"""tools/llama_cpp.py against fake llama-cli binaries: the perf lines it parses, the flags it
passes, and every way a binary can fail being one line naming --llama-cpp, in bounded time and
memory (an endless printer, a child that keeps the pipes, perf lines that claim the impossible)."""
import json
import sys
import time
from pathlib import Path

import pytest

from tools.convert import default_gguf
from tools.bench import parse_args
from tools.llama_cpp import OUTPUT_LIMIT, reference

NEW = """\
llama_perf_sampler_print:    sampling time =       5.67 ms /    94 runs   (    0.06 ms per token, 16578.48 tokens per second)
llama_perf_context_print:        load time =     123.45 ms
llama_perf_context_print: prompt eval time =      45.12 ms /    30 tokens (    1.50 ms per token,   664.89 tokens per second)
llama_perf_context_print:        eval time =     789.01 ms /    63 runs   (   12.52 ms per token,    79.85 tokens per second)
llama_perf_context_print:       total time =     900.00 ms /    93 tokens
"""
OLD = """\
llama_print_timings:        load time =     100.00 ms
llama_print_timings:      sample time =       4.00 ms /    32 runs   (    0.12 ms per token,  8000.00 tokens per second)
llama_print_timings: prompt eval time =      20.00 ms /    12 tokens (    1.67 ms per token,   600.00 tokens per second)
llama_print_timings:        eval time =     500.00 ms /    31 runs   (   16.13 ms per token,    62.00 tokens per second)
llama_print_timings:       total time =     530.00 ms /    43 tokens
"""

# llama.cpp 0c1e57098 (llama-completion, 2026): a log prefix, then common_perf_print
NEWEST = """\
0.07.979.028 I common_perf_print:    sampling time =      28.73 ms
0.07.979.030 I common_perf_print:    samplers time =       1.42 ms /    79 tokens
0.07.979.035 I common_perf_print:        load time =    1155.17 ms
0.07.979.037 I common_perf_print: prompt eval time =     283.51 ms /    15 tokens (   18.90 ms per token,    52.91 tokens per second)
0.07.979.038 I common_perf_print:        eval time =    6379.09 ms /    63 runs   (  101.26 ms per token,     9.88 tokens per second)
0.07.979.038 I common_perf_print:       total time =    6715.98 ms /    78 tokens
"""


def fake(tmp_path: Path, stderr: str = NEW, code: int = 0, sleep: float = 0, version: str = "version: 4589 (abc1234)") -> Path:
    """A llama-cli stand-in: answers --version, else dumps its argv, prints text and `stderr`."""
    path = tmp_path / "llama-cli"
    path.write_text(f"#!{sys.executable}\n"
                    "import json, sys, time\n"
                    f"if sys.argv[1:] == ['--version']:\n    print({version!r}, file=sys.stderr); sys.exit(0)\n"
                    f"open({str(tmp_path / 'argv.json')!r}, 'w').write(json.dumps(sys.argv[1:]))\n"
                    f"time.sleep({sleep})\n"
                    "print('The sky is blue because')\n"
                    f"sys.stderr.write({stderr!r})\n"
                    f"sys.exit({code})\n")
    path.chmod(0o755)
    return path


@pytest.fixture
def gguf(tmp_path: Path) -> Path:
    path = tmp_path / "model.gguf"
    path.write_bytes(b"GGUF")
    return path


def detok(ids: list[int]) -> str:
    return "<|im_start|>user\n" + " ".join(map(str, ids))


def test_new_perf_lines_give_decode_and_end_to_end_rates(tmp_path, gguf):
    name, run = reference(fake(tmp_path), gguf, 64, detok, threads=2)
    out = run([1, 2, 3])
    assert name == "llama.cpp 4589 (abc1234) plain"
    assert out["decode_tok_s"] == pytest.approx(63 / 0.78901)
    assert out["tok_s"] == pytest.approx(64 / (0.04512 + 0.78901))
    assert out["forwards"] == 64
    assert out["tokens"] is None and out["drafted"] == [] and out["accepted"] == []
    assert out["text"] == "The sky is blue because\n"


def test_old_llama_print_timings_lines_parse_too(tmp_path, gguf):
    _, run = reference(fake(tmp_path, OLD), gguf, 32, detok, threads=2)
    out = run([1])
    assert out["decode_tok_s"] == pytest.approx(31 / 0.5)
    assert out["tok_s"] == pytest.approx(32 / 0.52)
    assert out["forwards"] == 32


def test_newest_common_perf_print_lines_parse_too(tmp_path, gguf):
    # the build `make llama-cpp` makes prints these; missing them would fail every real run
    _, run = reference(fake(tmp_path, NEWEST), gguf, 64, detok, threads=2)
    out = run([1])
    assert out["decode_tok_s"] == pytest.approx(63 / 6.37909)
    assert out["tok_s"] == pytest.approx(64 / (0.28351 + 6.37909))


def test_eval_line_is_not_the_prompt_eval_line(tmp_path, gguf):
    # only the prompt's line: taking it for the decode line would report 30 / 0.04512 tok/s
    only_prompt = NEW.splitlines()[2] + "\n"
    _, run = reference(fake(tmp_path, only_prompt), gguf, 64, detok, threads=2)
    with pytest.raises(ValueError, match="no llama.cpp timing lines"):
        run([1])
    # and the prompt line after the decode line is still not the decode line
    swapped = "\n".join(NEW.splitlines()[i] for i in (3, 2)) + "\n"
    _, run = reference(fake(tmp_path, swapped), gguf, 64, detok, threads=2)
    assert run([1])["decode_tok_s"] == pytest.approx(63 / 0.78901)


def test_budget_greedy_flags_and_prompt_text_reach_the_binary(tmp_path, gguf):
    _, run = reference(fake(tmp_path), gguf, 71, detok, threads=3)
    run([5, 6])
    argv = json.loads((tmp_path / "argv.json").read_text())
    pairs = dict(zip(argv, argv[1:]))
    assert pairs["-n"] == "71" and pairs["--temp"] == "0" and pairs["--top-k"] == "1"
    assert pairs["-t"] == "3" and pairs["-m"] == str(gguf)
    assert pairs["-p"] == detok([5, 6])
    assert {"--ignore-eos", "-no-cnv", "--no-display-prompt"} <= set(argv)


def test_unparsed_version_is_unknown(tmp_path, gguf):
    name, _ = reference(fake(tmp_path, version="llama.cpp, some build"), gguf, 8, detok, threads=1)
    assert name == "llama.cpp unknown plain"


@pytest.mark.parametrize("what", ["missing", "not executable", "a directory"])
def test_bad_binary_is_one_line_naming_the_flag(tmp_path, gguf, what):
    binary = tmp_path / "llama-cli"
    if what == "not executable":
        fake(tmp_path).chmod(0o644)
    elif what == "a directory":
        binary.mkdir()
    with pytest.raises(ValueError, match="^--llama-cpp ") as e:
        reference(binary, gguf, 8, detok, threads=1)
    assert "\n" not in str(e.value)


def test_missing_gguf_is_one_line_naming_the_flag(tmp_path):
    with pytest.raises(ValueError, match="^--llama-cpp .*GGUF") as e:
        reference(fake(tmp_path), tmp_path / "none.gguf", 8, detok, threads=1)
    assert "\n" not in str(e.value)


def test_failing_binary_reports_its_last_stderr_line(tmp_path, gguf):
    _, run = reference(fake(tmp_path, "loading...\nerror: bad model\n", code=1), gguf, 8, detok, threads=1)
    with pytest.raises(ValueError, match="--llama-cpp .*exit 1: error: bad model$"):
        run([1])


def test_no_timing_lines_is_an_error(tmp_path, gguf):
    _, run = reference(fake(tmp_path, "all done\n"), gguf, 8, detok, threads=1)
    with pytest.raises(ValueError, match="no llama.cpp timing lines.*all done"):
        run([1])


def test_long_stderr_line_is_truncated(tmp_path, gguf):
    _, run = reference(fake(tmp_path, "x" * 1000 + "\n", code=1), gguf, 8, detok, threads=1)
    with pytest.raises(ValueError) as e:
        run([1])
    # the binary's line is cut, whatever the length of the path before it (a long TMPDIR)
    said = str(e.value).partition(": exit 1: ")[2]
    assert 0 < len(said) <= 200 and set(said) == {"x"}


def test_hanging_binary_is_stopped_by_the_timeout(tmp_path, gguf):
    _, run = reference(fake(tmp_path, sleep=60), gguf, 8, detok, threads=1, budget=1)
    with pytest.raises(ValueError, match="--llama-cpp .*no answer within its row's 1 s"):
        run([1])


def shell(tmp_path: Path, body: str) -> Path:
    """A /bin/sh llama.cpp: answers --version, then runs `body` on any real call (sh starts in
    milliseconds, so its calls take the time `body` says)."""
    path = tmp_path / "llama-sh"
    path.write_text("#!/bin/sh\nif [ \"$1\" = --version ]; then echo 'version: 7 (5h3ll)' >&2; exit 0; fi\n" + body)
    path.chmod(0o755)
    return path


def test_a_binary_that_answers_version_then_hangs_is_one_line_at_the_rows_deadline(tmp_path, gguf):
    # the case: a build that answers --version, then never answers the real call
    name, run = reference(shell(tmp_path, "sleep 30\n"), gguf, 8, detok, threads=1, budget=1)
    assert name == "llama.cpp 7 (5h3ll) plain"
    t0 = time.monotonic()
    with pytest.raises(ValueError, match="^--llama-cpp .*no answer within its row's 1 s, all its calls "
                                         "together \\(0 runs answered") as e:
        run([1])
    assert time.monotonic() - t0 < 5 and "\n" not in str(e.value)


def test_the_rows_deadline_is_one_for_all_its_calls_not_one_per_call(tmp_path, gguf):
    # Why: a row is 14 prompts x 3 rounds of calls; a deadline per call let a binary that slows
    # to a crawl cost 42 deadlines. Each call here takes 1 s of a 2.5 s row: the third is
    # stopped (broken variant run: the whole budget given to every call lets all three pass)
    slow = "sleep 1\necho 'The sky is blue because'\nprintf '%s' '" + NEW.replace("63 runs", "7 runs") + "' >&2\n"
    _, run = reference(shell(tmp_path, slow), gguf, 8, detok, threads=1, budget=2.5)
    run([1]), run([2])
    t0 = time.monotonic()
    with pytest.raises(ValueError, match="row's 2.5 s, all its calls together \\(2 runs answered"):
        run([3])
    assert time.monotonic() - t0 < 1


def hostile(tmp_path: Path, body: str) -> Path:
    """A binary that answers --version like llama.cpp, then runs `body` (Python) on any real call."""
    path = tmp_path / "llama-completion"
    path.write_text(f"#!{sys.executable}\nimport os, subprocess, sys, time\n"
                    "if sys.argv[1:] == ['--version']:\n    print('version: 1 (f00)', file=sys.stderr); sys.exit(0)\n"
                    + body)
    path.chmod(0o755)
    return path


@pytest.mark.parametrize("stream", ["stdout", "stderr"])
def test_endless_output_is_cut_at_the_limit_not_kept(tmp_path, gguf, stream):
    # why: a binary that prints without end (a wrong mode, a loop) must not fill our memory
    # until the timeout: the run stops at OUTPUT_LIMIT bytes, long before the 5 s timeout
    # (the printer is throttled to ~60 MB/s so a broken variant costs little memory either)
    endless = f"while True:\n    sys.{stream}.write('x' * 65536); sys.{stream}.flush(); time.sleep(0.001)\n"
    _, run = reference(hostile(tmp_path, endless), gguf, 8, detok, threads=1, budget=5)
    t0 = time.monotonic()
    with pytest.raises(ValueError, match=f"^--llama-cpp .*more than {OUTPUT_LIMIT >> 20} MiB of output") as e:
        run([1])
    assert time.monotonic() - t0 < 4 and "\n" not in str(e.value)


def test_a_child_holding_the_pipes_dies_with_the_binary_at_the_timeout(tmp_path, gguf):
    # why: a wrapper script's child inherits its pipes; killing only the wrapper either waits
    # out the child (30 s here) for the pipes to close or leaves it running on a shared CPU
    holder = (f"child = subprocess.Popen(['sleep', '30'])\nopen({str(tmp_path / 'child')!r}, 'w').write(str(child.pid))\n"
              "time.sleep(30)\n")
    _, run = reference(hostile(tmp_path, holder), gguf, 8, detok, threads=1, budget=1)
    t0 = time.monotonic()
    with pytest.raises(ValueError, match="^--llama-cpp .*no answer within its row's 1 s, .*: stopped$"):
        run([1])
    assert time.monotonic() - t0 < 10
    stat = Path(f"/proc/{(tmp_path / 'child').read_text()}/stat")
    for _ in range(100):                     # gone, or a zombie its new parent has yet to reap
        if not stat.exists() or stat.read_text().rsplit(")", 1)[1].split()[0] == "Z":
            break
        time.sleep(0.02)
    else:
        raise AssertionError("the binary's child still runs")


@pytest.mark.parametrize("eval_line", [
    "eval time =     789.01 ms /    63 runs",     # 63 decode steps when 8 tokens were asked
    "eval time =       0.01 ms /     7 runs",     # 1.4 us a step: faster than any memory reads the GGUF
])
def test_perf_lines_claiming_impossible_speed_are_refused(tmp_path, gguf, eval_line):
    # why: the llama.cpp row is the anchor every engine figure is read against; a binary that
    # claims more tokens than asked, or steps below a physical floor, must not become that row
    lines = NEW.replace(NEW.splitlines()[3][:NEW.splitlines()[3].index(" runs") + 5],
                        "llama_perf_context_print:        " + eval_line)
    assert eval_line in lines
    _, run = reference(fake(tmp_path, lines), gguf, 8, detok, threads=1)
    with pytest.raises(ValueError, match="^--llama-cpp .*impossible perf line") as e:
        run([1])
    assert "\n" not in str(e.value)


def test_seven_steps_for_eight_tokens_in_a_plausible_time_is_a_figure(tmp_path, gguf):
    # the counterpart: the refusal above is not of ordinary runs
    lines = NEW.replace("789.01 ms /    63 runs", "87.50 ms /     7 runs")
    _, run = reference(fake(tmp_path, lines), gguf, 8, detok, threads=1)
    assert run([1])["decode_tok_s"] == pytest.approx(7 / 0.0875)


def test_empty_path_is_an_error_not_a_bench_without_the_row(tmp_path, gguf, capsys):
    # why: `--llama-cpp ""` (an unset variable in a script) was falsy, so the bench ran an hour
    # without the row it was asked for; and Path("") is ".", which would be named as the binary
    with pytest.raises(ValueError, match="^--llama-cpp: empty path"):
        reference("", gguf, 8, detok, threads=1)
    with pytest.raises(SystemExit) as e:
        parse_args(["--llama-cpp", ""])
    assert e.value.code == 2
    assert capsys.readouterr().err.startswith("error: --llama-cpp: empty path")


def test_default_gguf_is_the_packaged_q4_1_or_a_make_weights_hint():
    try:
        path = default_gguf()
    except FileNotFoundError as e:
        assert "make weights" in str(e)
    else:
        assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.is_file()


def test_default_gguf_absent_package_says_make_weights(monkeypatch):
    import importlib.util
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match="make weights"):
        default_gguf()
