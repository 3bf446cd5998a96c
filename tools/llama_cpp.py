"""llama.cpp's plain greedy decoding on the same GGUF, as a speed anchor for the bench:

    make llama-cpp                        # builds build/llama.cpp/cmake/bin/llama-completion
    python -m tools.bench --llama-cpp build/llama.cpp/cmake/bin/llama-completion

Its figure is decode tokens/s over the very GGUF the engine's checkpoint was converted from,
run with llama.cpp's own Q4_1 kernels and as many threads as torch uses here: what a tuned C++
engine does with the same weights on the same cores. One run per prompt, interleaved with the
engine's like HF's reference; the numbers come from the perf lines llama.cpp prints to stderr
(`common_perf_print:` in 2026's builds, `llama_perf_context_print:` from late 2024,
`llama_print_timings:` before).

Which binary: `make llama-cpp` builds llama.cpp 0c1e57098 (the tree vendored in the sdist of
llama-cpp-python 0.3.36), whose one-shot completion is `llama-completion`; its `llama-cli` is
now a chat client. Builds of 2024 to mid 2025 did it in `llama-cli`, which takes the same
arguments. Any binary that accepts `-m -p -n --temp --top-k -s -t --ignore-eos -no-cnv
--no-display-prompt` and prints llama.cpp's perf lines works.

A binary is a stranger here: it runs in its own process group, killed with every child once it
passes the time left to its row or prints more than OUTPUT_LIMIT bytes on either stream; perf
lines that claim more decode steps than asked, or a step faster than SECONDS_FLOOR, are refused,
not reported as a figure. The row's time is one budget for all its calls together (ROW_SECONDS,
`tools.bench --llama-cpp-seconds`): a binary that answers --version and then hangs costs the
bench that budget once, not once per prompt and round.

But: llama.cpp prints text, not our token ids, so its tokens are not compared with plain's
(`tokens` is None). The prompt goes as the detokenized chat-templated text and llama.cpp
tokenizes it again (special tokens parsed); --ignore-eos makes it spend the whole budget.
"""
from __future__ import annotations

import contextlib
import math
import os
import re
import selectors
import signal
import subprocess
import time
from pathlib import Path
from typing import Callable

VERSION = re.compile(r"version:\s*(\S+(?: \([^)\n]*\))?)")         # "version: 4589 (abc1234)"
# "prompt eval time" is another line: nothing but spaces may stand between the prefix and "eval"
# (and bounded numbers: a 5000-digit count is no figure, and int() of it raises). Builds of 2026
# print `common_perf_print:` after a log prefix, "0.07.979.038 I ".
TIMING = (r"^(?:[\d.]+ [A-Z] )?(?:common_perf_print|llama_perf_context_print|llama_print_timings):\s+{} time\s*=\s*"
          r"(\d{{1,12}}(?:\.\d{{1,12}})?) ms /\s*(\d{{1,12}}) (?:tokens|runs)")
PROMPT_EVAL = re.compile(TIMING.format("prompt eval"), re.M)
EVAL = re.compile(TIMING.format("eval"), re.M)
# A real run prints tens of kB (the load log, the text); past this the binary is not llama.cpp
OUTPUT_LIMIT = 4 << 20                                             # bytes per stream
# 100,000 decode steps/s: faster than streaming even a 135M Q4_1 GGUF (about 100 MB) from the
# fastest memory made (8 TB/s, 12 us); a step timed below this is a broken clock or a lie
SECONDS_FLOOR = 1e-5
# s for the whole row, every call together: a row of the bench's 14 prompts x 3 rounds at 64
# tokens takes a few minutes even from a slow build (~8 s a call at 10 tok/s with its load)
ROW_SECONDS = 600


def last_line(text: str) -> str:
    return (text.strip().splitlines() or ["no output"])[-1][:200]


def timings(stderr: str) -> tuple[float, int, float, int]:
    """(prompt eval s, prompt tokens, eval s, eval runs) from llama.cpp's perf lines (the last
    of each, should a binary print them more than once)."""
    prompt, decode = PROMPT_EVAL.findall(stderr), EVAL.findall(stderr)
    if not (prompt and decode):
        raise ValueError(f"--llama-cpp: no llama.cpp timing lines in its stderr; last line: {last_line(stderr)}")
    (p_ms, p_n), (e_ms, e_n) = prompt[-1], decode[-1]
    return float(p_ms) / 1e3, int(p_n), float(e_ms) / 1e3, int(e_n)


def bounded_run(argv: list[str], timeout: float, limit: int = OUTPUT_LIMIT) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of argv, or TimeoutError / OverflowError: its whole process
    group is killed at `timeout` s or once a stream passes `limit` bytes, so neither an endless
    printer nor a child that keeps our pipes open costs more than that."""
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, start_new_session=True)
    out = {proc.stdout: bytearray(), proc.stderr: bytearray()}
    deadline = time.monotonic() + timeout
    try:
        with selectors.DefaultSelector() as pipes:
            for f in out:
                pipes.register(f, selectors.EVENT_READ)
            while pipes.get_map():                       # until both pipes close
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError
                for key, _ in pipes.select(left):
                    chunk = os.read(key.fd, 1 << 16)
                    if not chunk:
                        pipes.unregister(key.fileobj)
                    elif len(out[key.fileobj]) + len(chunk) > limit:
                        raise OverflowError
                    out[key.fileobj] += chunk
        code = proc.wait(max(deadline - time.monotonic(), 0))
    except subprocess.TimeoutExpired:
        raise TimeoutError from None
    finally:
        if proc.returncode is None:                      # still running: it and its children go
            with contextlib.suppress(OSError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        for f in out:
            f.close()
    text = lambda b: b.decode(errors="replace")
    return code, text(out[proc.stdout]), text(out[proc.stderr])


def reference(binary: str | Path, gguf: Path, max_new_tokens: int,
              detokenize: Callable[[list[int]], str], threads: int,
              budget: float = ROW_SECONDS) -> tuple[str, Callable[[list[int]], dict]]:
    """llama.cpp's greedy decoding as one more bench config: (name, run), where run(prompt ids)
    answers in `compare`'s form. A bad binary or GGUF is a one-line ValueError, before any run;
    so is a row whose calls, --version included, take more than `budget` s together."""
    if not str(binary).strip():                    # Path("") is ".", a directory: say what it was
        raise ValueError("--llama-cpp: empty path; give a llama-completion binary (make llama-cpp)")
    binary, gguf = Path(binary), Path(gguf)
    if not (binary.is_file() and os.access(binary, os.X_OK)):
        raise ValueError(f"--llama-cpp {binary}: not an executable file")
    if not gguf.is_file():
        raise ValueError(f"--llama-cpp {binary}: GGUF {gguf} is not a file")

    spent, runs_done = [0.0], [0]       # the row's seconds so far, every call counted; runs answered

    def call(args: list[str], most: float = math.inf) -> tuple[int, str, str]:
        """The binary's answer within what is left of the row's budget (and `most`)."""
        left, t0 = budget - spent[0], time.monotonic()
        seconds = min(most, left)
        try:
            if seconds <= 0:
                raise TimeoutError
            return bounded_run([str(binary), *args], seconds)
        except TimeoutError:
            if seconds < left:                                   # its own bound (--version's), not the row's
                raise ValueError(f"--llama-cpp {binary}: no answer to {args[0]} within {seconds:g} s") from None
            raise ValueError(f"--llama-cpp {binary}: no answer within its row's {budget:g} s, all its calls "
                             f"together ({runs_done[0]} runs answered; --llama-cpp-seconds): stopped") from None
        except OverflowError:
            raise ValueError(f"--llama-cpp {binary}: more than {OUTPUT_LIMIT >> 20} MiB of output "
                             "on one stream; stopped") from None
        except OSError as e:                                     # a bad shebang, say
            raise ValueError(f"--llama-cpp {binary}: {e}") from None
        finally:
            spent[0] += time.monotonic() - t0

    _, out, err = call(["--version"], 60)
    version = VERSION.search(err + out)

    def run(prompt: list[int]) -> dict:
        code, out, err = call(["-m", str(gguf), "-p", detokenize(prompt), "-n", str(max_new_tokens),
                               "--temp", "0", "--top-k", "1", "-s", "0", "-t", str(threads),
                               "--ignore-eos", "-no-cnv", "--no-display-prompt"])
        runs_done[0] += 1
        if code != 0:
            raise ValueError(f"--llama-cpp {binary}: exit {code}: {last_line(err)}")
        prompt_s, _, eval_s, runs = timings(err)
        if runs < 1 or eval_s <= 0:
            raise ValueError(f"--llama-cpp {binary}: no decode step timed (eval {runs} runs); "
                             "--max-new-tokens must be >= 2")
        # the first token comes from the prompt's forward: at most max_new_tokens - 1 steps
        # are asked for; one more is slack for a build that also decodes the last token
        if runs > max_new_tokens or eval_s / runs < SECONDS_FLOOR:
            raise ValueError(f"--llama-cpp {binary}: impossible perf line: {runs} decode steps in "
                             f"{eval_s * 1e3:g} ms for {max_new_tokens} tokens asked")
        generated = min(runs + 1, max_new_tokens)
        return {"tokens": None, "tok_s": generated / (prompt_s + eval_s), "decode_tok_s": runs / eval_s,
                "forwards": generated, "drafted": [], "accepted": [], "text": out}
    return f"llama.cpp {version[1] if version else 'unknown'} plain", run
