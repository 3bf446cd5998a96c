"""llama.cpp's plain greedy decoding on the same GGUF, as a speed anchor for the bench:

    python -m tools.bench --llama-cpp ~/llama.cpp/build/bin/llama-cli

Its figure is decode tokens/s over the very GGUF the engine's checkpoint was converted from,
run with llama.cpp's own Q4_1 kernels and as many threads as torch uses here: what a tuned C++
engine does with the same weights on the same cores. One run per prompt, interleaved with the
engine's like HF's reference; the numbers come from the perf lines llama.cpp prints to stderr
(`llama_perf_context_print:` since late 2024, `llama_print_timings:` before).

Get a binary by building llama.cpp: `cmake -B build && cmake --build build -j --target llama-cli`.
The arguments are llama-cli's of 2024-2025 (`-no-cnv` for one completion, not a chat). Later
builds moved that mode to `llama-completion`, and `llama-simple` takes fewer flags: any binary
that accepts these arguments and prints llama.cpp's perf lines works.

But: llama.cpp prints text, not our token ids, so its tokens are not compared with plain's
(`tokens` is None). The prompt goes as the detokenized chat-templated text and llama.cpp
tokenizes it again (special tokens parsed); --ignore-eos makes it spend the whole budget.
"""
from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path
from typing import Callable

VERSION = re.compile(r"version:\s*(\S+(?: \([^)\n]*\))?)")         # "version: 4589 (abc1234)"
# "prompt eval time" is another line: nothing but spaces may stand between the prefix and "eval"
TIMING = r"^(?:llama_perf_context_print|llama_print_timings):\s+{} time\s*=\s*([\d.]+) ms /\s*(\d+) (?:tokens|runs)"
PROMPT_EVAL = re.compile(TIMING.format("prompt eval"), re.M)
EVAL = re.compile(TIMING.format("eval"), re.M)


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


def reference(binary: str | Path, gguf: Path, max_new_tokens: int,
              detokenize: Callable[[list[int]], str], threads: int,
              timeout: float = 600) -> tuple[str, Callable[[list[int]], dict]]:
    """llama.cpp's greedy decoding as one more bench config: (name, run), where run(prompt ids)
    answers in `compare`'s form. A bad binary or GGUF is a one-line ValueError, before any run."""
    binary, gguf = Path(binary), Path(gguf)
    if not (binary.is_file() and os.access(binary, os.X_OK)):
        raise ValueError(f"--llama-cpp {binary}: not an executable file")
    if not gguf.is_file():
        raise ValueError(f"--llama-cpp {binary}: GGUF {gguf} is not a file")

    def call(args: list[str]) -> subprocess.CompletedProcess:
        try:
            return subprocess.run([str(binary), *args], stdin=subprocess.DEVNULL, capture_output=True,
                                  text=True, errors="replace", timeout=timeout)
        except subprocess.TimeoutExpired:
            raise ValueError(f"--llama-cpp {binary}: no answer within {timeout:g} s") from None
        except OSError as e:                                     # a bad shebang, say
            raise ValueError(f"--llama-cpp {binary}: {e}") from None

    found = call(["--version"])
    version = VERSION.search(found.stderr + found.stdout)

    def run(prompt: list[int]) -> dict:
        done = call(["-m", str(gguf), "-p", detokenize(prompt), "-n", str(max_new_tokens),
                     "--temp", "0", "--top-k", "1", "-s", "0", "-t", str(threads),
                     "--ignore-eos", "-no-cnv", "--no-display-prompt"])
        if done.returncode != 0:
            raise ValueError(f"--llama-cpp {binary}: exit {done.returncode}: {last_line(done.stderr)}")
        prompt_s, _, eval_s, runs = timings(done.stderr)
        if runs < 1 or eval_s <= 0:
            raise ValueError(f"--llama-cpp {binary}: no decode step timed (eval {runs} runs); "
                             "--max-new-tokens must be >= 2")
        generated = runs + 1                      # the first token comes from the prompt's forward
        return {"tokens": None, "tok_s": generated / (prompt_s + eval_s), "decode_tok_s": runs / eval_s,
                "forwards": generated, "drafted": [], "accepted": [], "text": done.stdout}
    return f"llama.cpp {version[1] if version else 'unknown'} plain", run
