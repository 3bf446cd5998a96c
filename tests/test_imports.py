"""The library's import picture (README, "Reading order") holds: each part imports only the parts
below it, so the core reads as the algorithms alone, and the only code that asks what this
machine is (CPU flags, /proc, oneDNN layouts) is engine/fast/machine.py.

    doors --> adapt --> fast --> load --> core --> machine      (each may import any part to its right)
"""
import ast
from pathlib import Path

import pytest

ENGINE = Path(__file__).resolve().parent.parent / "engine"
ORDER = ["doors", "adapt", "fast", "load", "core", "machine"]    # a part may import itself and those after it
SHIMS = {"engine.run", "engine.api"}                               # the card's command, the API's import path
MACHINE_WORDS = ("/proc", "get_cpu_capability", "_is_amx", "_mkldnn", "cpuinfo", "sysconf")


def part(module: str) -> str:
    if module == "engine.fast.machine":
        return "machine"
    pieces = module.split(".")
    return pieces[1] if len(pieces) > 2 and (ENGINE / pieces[1]).is_dir() else "core"


def modules() -> dict[str, Path]:
    found = {}
    for path in sorted(ENGINE.rglob("*.py")):
        name = ".".join(("engine",) + path.relative_to(ENGINE).with_suffix("").parts)
        found[name.removesuffix(".__init__")] = path
    return found


def imports(path: Path) -> set[str]:
    """Every engine module `path` imports, at its top or inside a function."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("engine"):
            out |= {f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules() else node.module
                    for a in node.names}
        elif isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.startswith("engine")}
    return out


def arrows() -> list[tuple[str, str]]:
    """(importer, imported) pairs that break the picture."""
    bad = []
    for name, path in modules().items():
        if name in SHIMS or name == "engine":
            continue
        for target in imports(path):
            if target == "engine" or part(target) == "doors" and part(name) == "doors":
                continue
            if ORDER.index(part(target)) < ORDER.index(part(name)):
                bad.append((name, target))
    return bad


def test_each_part_imports_only_the_parts_below_it():
    assert arrows() == []


def test_the_picture_is_checked_by_arrows_not_assumed(monkeypatch):
    # the broken variant: the core importing a loader (as the model's docstring once sent readers
    # up into the doors) is an arrow the test names
    real = imports
    monkeypatch.setitem(globals(), "imports", lambda p: real(p) | ({"engine.load.weights"} if p.name == "kvcache.py" else set()))
    assert ("engine.kvcache", "engine.load.weights") in arrows()


@pytest.mark.parametrize("name", [n for n in modules() if part(n) == "core" and n not in SHIMS and n != "engine"])
def test_the_core_reads_nothing_of_the_machine(name):
    text = modules()[name].read_text()
    assert [w for w in MACHINE_WORDS if w in text] == []


def test_the_readme_draws_the_same_picture():
    readme = (ENGINE.parent / "README.md").read_text()
    assert "engine/doors/ --> engine/adapt/ --> engine/fast/ --> engine/load/ --> engine/*.py" in readme
