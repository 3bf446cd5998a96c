"""This machine's prices for the adaptive choices (engine/adapt/policy.py), measured once and kept.

    cost(k rows) / cost(1 row)       a k-row forward of this model: `calibrated(model)`
    t(draft row) / t(target row)     a draft token: `draft_price(target, draft)`
    rows round alike?                the CLI's exact-path claim: `probed(model)`

Each is measured on first use (a few seconds), kept in ~/.cache/engine/ and read back by every
later run, so the prices fit the machine yet never move between runs: the same command, seed
and machine print the same tokens on every path, the inexact ones (bf16 or int4 without their
exact kernels, bf16 on CUDA) included. A
table can also be given (`load_table`: `python -m tools.bench --forward-cost`'s JSON). Where
none can be kept (a read-only home), nothing is measured: the policy prices by fixed constants
by matmul kind and CPU dispatch (policy.SLOPE, policy.DRAFT_COST), alike on every run.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import stat
import time
from pathlib import Path
from typing import Callable

import torch

from engine import llama
from engine.fast import artifacts, invariant, packed
from engine.fast.artifacts import cache_home, kernel_env, model_key, sweep, unwritable
from engine.kvcache import KVCache
from engine.llama import Llama

MAX_TABLE_BYTES = 1 << 20   # a forward-cost JSON of every k up to 4096 is ~0.3 MB
# s: a price temporary this old is no live run's (a measurement takes seconds), whatever its PID
STALE_SECONDS = 3600


def load_table(path: str | Path) -> dict[int, float]:
    """The k -> cost(k)/cost(1) ratios of a `tools.bench --forward-cost` JSON (its first model)."""
    return table_from(read_bounded_json(path), path)


def read_bounded_json(path: str | Path):
    """A regular file's JSON, read to at most MAX_TABLE_BYTES: a FIFO nobody writes, /dev/zero, a
    file that keeps growing or bad JSON is one error, not a hang or a full memory."""
    try:
        file = Path(path)
        if str(file) in ("", "."):
            raise OSError("an empty path names no file")
        # subtle: O_NONBLOCK so that opening a FIFO returns at once (fstat then refuses it)
        fd = os.open(file, os.O_RDONLY | os.O_NONBLOCK)
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise OSError("not a regular file")
        with os.fdopen(fd, "rb") as f:
            data = f.read(MAX_TABLE_BYTES + 1)
        if len(data) > MAX_TABLE_BYTES:
            raise OSError(f"larger than {MAX_TABLE_BYTES:,} bytes")
        return json.loads(data)
    except (OSError, ValueError, RecursionError) as e:   # RecursionError: deeply nested JSON
        raise ValueError(f"{path}: not a forward-cost JSON from tools.bench ({str(e)[:200]})") from None


def table_from(d, path: str | Path) -> dict[int, float]:
    try:
        rows = next(iter(d["forward_cost"].values()))
        table = {int(k): float(r["ratio"]) for k, r in rows.items()}
    except (ValueError, KeyError, TypeError, StopIteration, AttributeError) as e:
        raise ValueError(f"{path}: not a forward-cost JSON from tools.bench ({e})") from None
    # subtle: a k-row forward costs at least about one row; a ratio near 0 (or k = 1 priced
    # near 0) would make the adaptive choices pay any number of rows for nothing, silently
    if 1 not in table or any(k < 1 or not 0.5 <= v < 1e6 for k, v in table.items()):
        raise ValueError(f"{path}: the cost table needs k = 1 and ratios in [0.5, 1e6) for k >= 1")
    return table


# --------------------------------------------------------------------------- this machine's table

# row counts measured, interpolated between: torch's int4 kernel costs steps of four rows (5
# rows as much as 8: docs/archive/speed-log.md), so both ends of each step are measured up to 16
ROW_COUNTS = (1, 2, 3, 4, 5, 8, 9, 12, 13, 16, 24, 32)
HOW = "paired medians, with the step after, checked"   # in the kept table's key: a new way measures anew
# a larger k may read at most this much cheaper than a smaller one: the spread of paired medians
# on a busy 2-core VM; beyond it a table contradicts itself (a busy spell) and is measured again
CONTRADICTION = 0.10
TRIES = 3


def contradiction(table: dict[int, float]) -> tuple[int, int] | None:
    """(j, k), j < k, where k rows are priced cheaper than j beyond CONTRADICTION; else None."""
    ks = sorted(table)
    return next(((j, k) for i, j in enumerate(ks) for k in ks[i + 1:]
                 if table[k] < table[j] * (1 - CONTRADICTION)), None)


def measure(model: Llama, ks=ROW_COUNTS, context: int = 100, repeats: int = 7) -> dict[int, float]:
    """cost(k)/cost(1) on this machine, as a decoder pays it between one-row steps:

        a, b, c = one-row, k-row, one-row forwards, in a row, after a cache of `context` tokens
        cost(k) = median over `repeats` of (b + c - a) / a

    subtle: each k-row forward is timed beside the one-row forward just before it, so a slow
    spell weighs on both; and it is charged what it costs the step after it (on a Zen 5, a
    one-row step right after one of 5 rows or more takes ~1.2x). The fastest of a few, the old
    rule, caught k-row forwards on lucky spells: 3 rows 1.25x, where the loop paid 1.35x."""
    cache = KVCache.for_model(model, context + max(ks))

    def seconds(k: int) -> float:
        t = forward_seconds(model, cache, context, k)
        cache.truncate(context)
        return t

    forward_seconds(model, cache, 0, context)
    seconds(1)                                         # warms the kernels up
    ratios: dict[int, list[float]] = {k: [] for k in ks if k > 1}
    for _ in range(repeats):
        for k in ratios:
            a, b, c = seconds(1), seconds(k), seconds(1)
            ratios[k].append((b + c - a) / a)
    return {1: 1.0} | {k: max(sorted(r)[len(r) // 2], 1.0) for k, r in ratios.items()}


def forward_seconds(model: Llama, cache: KVCache, start: int, k: int) -> float:
    device = model.tok_embeddings.weight.device
    t0 = time.perf_counter()
    model(torch.zeros(1, k, dtype=torch.long, device=device), torch.arange(start, start + k, device=device), cache)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def calibrated(model: Llama, folder: Path | None = None, notify: Callable[[str], None] | None = None,
               live: Callable[[str], None] | None = None, measure_now: bool = True) -> dict[int, float] | None:
    """This machine's table for this model, measured on first use and read back after (`kept`);
    None where it cannot be kept (the policy then prices by policy.SLOPE), or where it is not
    kept yet and not `measure_now` (a run that answers first and measures after). A table that
    contradicts itself is measured again, up to TRIES times in all (`live` hears it at once);
    the last, if it still does, is kept as its running maximum over k."""
    def table() -> dict:
        for attempt in range(1, TRIES + 1):
            ratios = measure(model)
            bad = contradiction(ratios)
            if bad is None:
                break
            if attempt == TRIES:   # busy throughout: a k-row forward priced as at least any fewer rows
                ratios = {k: max(r for j, r in ratios.items() if j <= k) for k in sorted(ratios)}
                break
            if live:
                j, k = bad
                live(f"{k} rows priced {ratios[k]:.2f}x, below {j} rows' {ratios[j]:.2f}x (a busy spell?): "
                     f"measuring again [{attempt + 1}/{TRIES}]")
        return {"forward_cost": {"engine": {str(k): {"ratio": r} for k, r in ratios.items()}},
                "tries": attempt, "contradiction": bad}
    found = kept(table_key(model), table, folder, notify, check=table_from,
                 live=live, what="k-row forward costs", measure_now=measure_now)
    return None if found is None else table_from(*found)


def table_key(model: Llama) -> str:
    return f"{model_key(model)}|{ROW_COUNTS}|{HOW}"


def kept_path(key: str, folder: Path | None = None) -> Path:
    """Where `kept` keeps the measurement under `key`."""
    return (folder or cache_home() / "engine") / f"cost-{hashlib.sha256(key.encode()).hexdigest()[:16]}.json"


def draft_price(target: Llama, draft: Llama, folder: Path | None = None,
                notify: Callable[[str], None] | None = None, live: Callable[[str], None] | None = None,
                measure_now: bool = True) -> float | None:
    """One draft token's cost in one-row target forwards on this machine, kept like the table
    (None where it cannot be kept: policy.DRAFT_COST then)."""
    found = kept(f"draft|{model_key(target)}|{model_key(draft)}",
                 lambda: {"draft_cost": measure_draft(target, draft)}, folder, notify, check=draft_cost,
                 live=live, what="draft's price", measure_now=measure_now)
    return None if found is None else draft_cost(*found)


def draft_cost(data: dict, path: Path) -> float:
    c = data.get("draft_cost") if isinstance(data, dict) else None
    if isinstance(c, bool) or not isinstance(c, (int, float)) or not 0.01 <= c <= 100:
        raise ValueError(f"{path}: draft_cost must be a number in [0.01, 100], got {c!r}")
    return float(c)


def probed(model: Llama, folder: Path | None = None) -> bool:
    """invariant.rows_round_alike(model), probed once per machine and model key and kept like
    the table: the probe runs 67 one-row head calls (~0.7 s a run on a 2-vCPU EPYC), and its
    answer is the kernels', so it cannot change between runs. Probed anew where nothing can be
    kept or the kept file is unreadable. In the key beside model_key: the CPU's flags (a VM may
    hide AMX or AVX-512 under one model name), the variables that choose kernels, and the code
    of the probe and of the kernels it probes (an older engine's answer is not this one's)."""
    code = hashlib.sha256(b"".join(Path(m.__file__).read_bytes() for m in (invariant, packed, llama)))
    flags = artifacts.cpuinfo("flags") or artifacts.cpuinfo("Features")                   # x86 | ARM
    key = f"rows_round_alike|{model_key(model)}|{flags}|{kernel_env()}|{code.hexdigest()[:16]}"
    try:
        found = kept(key, lambda: {"rows_round_alike": invariant.rows_round_alike(model)}, folder, None)
    except ValueError:                                                 # a kept file cut short, say
        found = None
    if found is None:
        return invariant.rows_round_alike(model)
    return isinstance(found[0], dict) and found[0].get("rows_round_alike") is True


def measure_draft(target: Llama, draft: Llama, context: int = 100, repeats: int = 5) -> float:
    """t(draft, 1 row) / t(target, 1 row), each the fastest of `repeats` forwards, interleaved
    so that a busy spell weighs on both alike."""
    t = d = math.inf
    for _ in range(repeats):
        t, d = min(t, one_row_seconds(target, context)), min(d, one_row_seconds(draft, context))
    return min(max(d / t, 0.01), 100.0)


def one_row_seconds(model: Llama, context: int) -> float:
    cache = KVCache.for_model(model, context + 1)
    forward_seconds(model, cache, 0, context)
    return forward_seconds(model, cache, context, 1)


def kept(key: str, measure: Callable[[], dict], folder: Path | None,
         notify: Callable[[str], None] | None, check: Callable[[dict, Path], object] = lambda d, p: d,
         live: Callable[[str], None] | None = None, what: str = "forward costs",
         measure_now: bool = True) -> tuple[dict, Path] | None:
    """(measure()'s JSON object, where it is kept): measured once per key, then read back.

    Kept in ~/.cache/engine/ (or $XDG_CACHE_HOME), named by a hash of the key; the first
    writer wins a race, and every process uses the file as written. Delete it to measure
    again. A kept file that is not JSON, holds another key or fails `check(data, path)` (a
    ValueError) is measured anew, once, with a notice. `notify` hears one line when this call measured,
    so a CLI can say where it went; `live` hears one before it measures, so a user is told at once.
    None where nothing can be kept (a read-only home): the caller then prices by fixed
    constants, since a measurement taken anew by every run would let runs print apart. None
    too where nothing is kept yet and not `measure_now`: that run prices by the constants and
    measures after it has answered.
    """
    folder = folder or cache_home() / "engine"
    path = kept_path(key, folder)
    sweep_stale(folder)               # every run, not only one that measures: most read all back
    if path.is_file():
        try:
            return read_kept(path, key, check), path
        except ValueError as e:   # cut short, edited, another key's: measured anew, once
            if notify:
                notify(f"{e}: measuring it anew")
            with contextlib.suppress(OSError):
                path.unlink()
    if not measure_now or unwritable(folder):   # (an unwritable cache: the front doors said so, once)
        return None
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with open(tmp, "wb") as f:                     # opened first: a read-only home measures nothing
            if live:
                live(f"measuring this machine's {what} once (seconds; later runs read them back)")
            f.write(json.dumps({"key": key, **measure()}).encode())   # seconds, once per machine
        try:
            os.link(tmp, path)                         # subtle: fails if another process won
        except FileExistsError:
            return read_kept(path, key, check), path
        except OSError:                                # a file system without hard links:
            if path.exists():                          # rename (atomic too), unless one won
                return read_kept(path, key, check), path
            os.rename(tmp, path)
        if notify:
            # subtle: a busy spell makes every k-row forward look dear, for good
            notify(f"measured this machine's forward costs into {path}; every later "
                   "run reads them back (delete it to measure again, on an idle machine)")
    except OSError as e:
        if notify:
            notify(f"cannot keep this machine's forward costs in {folder} ({e.strerror or e}): "
                   "priced by fixed constants instead (set XDG_CACHE_HOME to a writable folder)")
        return None
    finally:
        with contextlib.suppress(OSError):
            tmp.unlink()
    return read_kept(path, key, check), path


def sweep_stale(folder: Path) -> None:
    """What killed runs left half-written in `folder`: artifacts.sweep (a temporary whose PID is no
    live process), and a price temporary (`.cost-*.json.PID`) older than STALE_SECONDS.

    subtle: PIDs come back (a container's runs often get the same few), so a killed run's file
    may name a live process; by the PID alone it would then be kept for good."""
    sweep(folder)
    with contextlib.suppress(OSError):
        for f in folder.glob(".cost-*.json.*"):
            with contextlib.suppress(OSError):
                if f.is_file() and time.time() - f.stat().st_mtime > STALE_SECONDS:
                    f.unlink()


def read_kept(path: Path, key: str, check: Callable[[dict, Path], object]) -> dict:
    """A kept file's JSON object, if it is one, for `key`, and `check` passes it; else ValueError."""
    data = read_bounded_json(path)
    if not isinstance(data, dict) or data.get("key", key) != key:
        raise ValueError(f"{path} was measured for another key")
    check(data, path)
    return data
