"""What the tools' command lines share: one-line errors, output places checked first, files
written aside and renamed. (The engine's own CLI, engine/doors/cli.py, is never imported here.)"""
from __future__ import annotations

import argparse
import os
import signal
import sys
import tempfile
import threading
from pathlib import Path
from typing import Callable


def one_line(work: Callable[[], object]) -> int:
    """work() as a tool's main runs it: SIGTERM (kill, a CI timeout) unwinds like Ctrl-C, so
    temporaries go; a ValueError or OSError (a disk that fills mid-write) is one `error:` line
    and exit 2; Ctrl-C exits 130."""
    previous = signal.signal(signal.SIGTERM, lambda *_: sys.exit(143)) \
        if threading.current_thread() is threading.main_thread() else None
    try:
        work()
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    return 0


class Parser(argparse.ArgumentParser):
    """Bad flags are one `error:` line and exit code 2, as in engine/doors/cli.py."""

    def error(self, message):
        self.exit(2, f"error: {message}\n")


def first(doc: str | None, sep: str = "\n") -> str | None:
    """A tool's --help description: its docstring up to `sep` (None under python -OO, which
    strips docstrings: the help then has no description, and the tool still runs)."""
    return doc and doc.split(sep)[0]


def write_atomic(path: Path, data: bytes) -> None:
    # subtle: a reader (or a killed run) never sees half a file: write aside, then rename; the
    # aside name is unique, so two runs writing the same file cannot clobber each other's
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(tmp, 0o644)   # mkstemp makes it private; a report is meant to be read
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def at_most(p: argparse.ArgumentParser, args, limits: dict[str, int]) -> None:
    """Each flag (dest name -> its upper bound) in [1, bound], else one error line, exit 2."""
    for name, top in limits.items():
        v = getattr(args, name)
        if not 1 <= v <= top:
            p.error(f"--{name.replace('_', '-')} must be in [1, {top}], got {v}")


def out_dir(path: Path) -> Path:
    """An --out directory, created if missing, checked before the long work that fills it."""
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ValueError(f"--out {path}: cannot create it ({e.strerror})") from None
    if not os.access(path, os.W_OK):
        raise ValueError(f"--out {path}: not writable")
    return path
