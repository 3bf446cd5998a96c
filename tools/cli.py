"""What the tools' command lines share: one-line errors, output places checked first, files
written aside and renamed. (The engine's own CLI, engine/run.py, is never imported here.)"""
from __future__ import annotations

import argparse
import os
from pathlib import Path


class Parser(argparse.ArgumentParser):
    """Bad flags are one `error:` line and exit code 2, as in engine/run.py."""

    def error(self, message):
        self.exit(2, f"error: {message}\n")


def write_atomic(path: Path, data: bytes) -> None:
    # subtle: a reader (or a killed run) never sees half a file: write aside, then rename
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    tmp.replace(path)


def out_dir(path: Path) -> Path:
    """An --out directory, created if missing, checked before the long work that fills it."""
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ValueError(f"--out {path}: cannot create it ({e.strerror})") from None
    if not os.access(path, os.W_OK):
        raise ValueError(f"--out {path}: not writable")
    return path
