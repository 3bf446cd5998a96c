"""How big the library is: lines per module of engine/, by part and by kind.

    python -m tools.size          # a Markdown table: each module's lines, code, prose; each part's ceiling

A line is code, prose (a docstring's or a comment's line, or one that only continues a string:
help text, a message) or blank. Each part has a ceiling (CEILING below) that holds
(tests/test_size.py): a change that takes a part past it shrinks something there, or raises the
ceiling in a commit that says which feature the lines buy (docs/size.md).
"""
from __future__ import annotations

import ast
import io
import tokenize
from pathlib import Path

from tools.cli import Parser, first

ENGINE = Path(__file__).resolve().parent.parent / "engine"
# the parts are engine/'s folders: the core at the top level, read in this order (README,
# "Reading order"; a core module not listed here comes after, by name), then one folder a part
CORE = ("llama", "kvcache", "sampling", "generate", "lookup", "lookahead", "draft", "speculative",
        "contrastive", "decoders", "trace")
SHIMS = ("run", "api")   # the card's command and the API's import path: door files at the top level
FOLDERS = {"adapt": "what adapts", "fast": "the exact fast paths", "load": "loading", "doors": "the front doors"}
# lines per part, a ceiling that holds (the first per-module budgets of a 2,600-line library went:
# docs/size.md); raised only by a commit that names what the lines buy
CEILING = {"the algorithms": 2000, "what adapts": 800, "the exact fast paths": 1250, "loading": 800,
           "the front doors": 1100}


def parts(engine: Path) -> dict[str, list[str]]:
    """{part: its modules, as paths under engine/ without .py}: the core's top-level files in
    reading order, then each folder's (its __init__: the docstring that says what it holds). A
    folder no part names is an error, so nothing goes uncounted."""
    top = [p.stem for p in engine.glob("*.py") if p.stem not in ("__init__", *SHIMS)]
    found = {"the algorithms": sorted(top, key=lambda m: (CORE.index(m) if m in CORE else len(CORE), m))}
    folders = sorted(d.name for d in engine.iterdir() if d.is_dir() and (d / "__init__.py").is_file())
    if set(folders) - set(FOLDERS):
        raise ValueError(f"engine/ folders not in tools/size.py's FOLDERS: {sorted(set(folders) - set(FOLDERS))}")
    for folder, part in FOLDERS.items():
        found[part] = sorted(f"{folder}/{p.stem}" for p in (engine / folder).glob("*.py"))
    found["the front doors"] += [m for m in SHIMS if (engine / f"{m}.py").is_file()]
    return found


def kinds(source: str) -> dict[str, int]:
    """{"code", "prose", "blank"}: how many of `source`'s lines are each. Prose: a docstring's
    or a comment's line, or a line of string literals alone (a help text or a message going on)."""
    lines = source.splitlines()
    prose = set()
    for node in ast.walk(ast.parse(source)):   # docstrings: a string first in a module, class or def
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr) \
                and isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str):
            prose.update(range(body[0].lineno, body[0].end_lineno + 1))
    marks, strings = {}, set()   # line -> its tokens that are neither text nor layout
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.STRING:
            strings.update(range(tok.start[0], tok.end[0] + 1))
        elif tok.type not in (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT,
                              tokenize.DEDENT, tokenize.ENDMARKER):
            marks.setdefault(tok.start[0], set()).add(tok.string)
    # a string going on, closed at most by `,`, `)` or `+`, is text; any other token makes code
    code = {n for n, m in marks.items() if not (n in strings and m <= {",", ")", "+"})} - prose
    blank = sum(not line.strip() for line in lines)
    return {"code": len(code), "prose": len(lines) - len(code) - blank, "blank": blank}


def part_lines(engine: Path = ENGINE) -> dict[str, int]:
    """{part: its lines}, as the table sums them."""
    return {part: sum(len((engine / f"{m}.py").read_text().splitlines()) for m in modules)
            for part, modules in parts(engine).items()}


def table(engine: Path = ENGINE) -> str:
    PARTS = parts(engine)
    rows = ["| part | module | lines | code | prose | blank | ceiling |", "|---|---|---|---|---|---|---|"]
    total = {"lines": 0, "code": 0, "prose": 0, "blank": 0}
    for part, modules in PARTS.items():
        sums = dict.fromkeys(total, 0)
        for m in modules:
            source = (engine / f"{m}.py").read_text()
            k = {"lines": len(source.splitlines()), **kinds(source)}
            sums = {f: sums[f] + k[f] for f in sums}
            rows.append(f"| {part} | {m} | {k['lines']} | {k['code']} | {k['prose']} | {k['blank']} | |")
        rows.append(f"| **{part}** | | **{sums['lines']}** | {sums['code']} | {sums['prose']} | {sums['blank']} | "
                    f"{CEILING.get(part, '-')} |")
        total = {f: total[f] + sums[f] for f in total}
    rows.append(f"| **engine/** | | **{total['lines']}** | {total['code']} | {total['prose']} | {total['blank']} | "
                f"{sum(CEILING.values())} |")
    return "\n".join(rows)


if __name__ == "__main__":
    Parser(prog="python -m tools.size", description=first(__doc__)).parse_args()   # --help; a bad flag: exit 2
    print(table())
