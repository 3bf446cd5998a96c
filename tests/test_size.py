"""tools/size.py: each line of a module is counted once, as code, prose or blank, and every
module of engine/ is counted, by the folder it sits in. And the folders keep their direction:
the core (engine/'s top level) imports nothing from them."""
import ast
from pathlib import Path

import pytest

from tools import size

SAMPLE = '''"""A module docstring
over two lines."""
import os  # a comment after code is code's line

# a comment alone is prose
X = """a string that is data,
not a docstring"""
Y = ("a message that goes on "
     "over a second line")
Z = max(1,
        2,
)


def f():
    """A function's docstring."""

    return os.sep
'''


def test_each_line_is_code_prose_or_blank_as_a_reader_sees_it():
    # code: import, the first lines of X and Y, Z's three lines (a closing mark alone is code),
    # def, return; prose: the docstrings' 3 lines, the comment, and the second lines of X and Y
    # (a string going on is text, not code)
    assert size.kinds(SAMPLE) == {"code": 8, "prose": 6, "blank": 4}
    assert sum(size.kinds(SAMPLE).values()) == len(SAMPLE.splitlines())


def test_the_table_counts_every_line_of_engine():
    total = sum(len(p.read_text().splitlines()) for p in size.ENGINE.rglob("*.py"))
    last = size.table().splitlines()[-1]
    assert last.startswith(f"| **engine/** | | **{total}** |")


def test_a_folder_no_part_names_is_an_error_not_lines_left_out(tmp_path):
    for folder in size.FOLDERS:
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "__init__.py").write_text('"""doc"""\n')
    (tmp_path / "llama.py").write_text("x = 1\n")
    (tmp_path / "newcomer.py").write_text("y = 2\n")              # a new core module: counted, after the listed
    assert size.parts(tmp_path)["the algorithms"] == ["llama", "newcomer"]
    size.table(tmp_path)
    (tmp_path / "extras").mkdir()
    (tmp_path / "extras" / "__init__.py").write_text("")
    with pytest.raises(ValueError, match="extras"):
        size.table(tmp_path)


def core_imports_from_folders(engine: Path) -> list[str]:
    """'module: imported name' for each import in a core file (engine/'s top level, less the
    door shims) of a module under one of engine/'s folders."""
    folders = {d.name for d in engine.iterdir() if d.is_dir() and (d / "__init__.py").is_file()}
    bad = []
    for path in sorted(engine.glob("*.py")):
        if path.stem in size.SHIMS:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [f"{node.module}.{a.name}" for a in node.names] if isinstance(node, ast.ImportFrom) and node.module else []
            bad += [f"{path.stem}: {n}" for n in names if n.startswith("engine.") and n.split(".")[1] in folders]
    return bad


def test_the_core_imports_nothing_from_the_part_folders():
    # Why: a reader learning the algorithms reads engine/'s top level and may skip every folder;
    # that holds only while no core module reaches into one (the parts import the core, not back)
    assert core_imports_from_folders(size.ENGINE) == []


def test_the_direction_check_sees_a_core_module_that_imports_a_part(tmp_path):
    # the broken variant: a core module that imports the policy, as the registry once did
    (tmp_path / "adapt").mkdir()
    (tmp_path / "adapt" / "__init__.py").write_text("")
    (tmp_path / "decoders.py").write_text("from engine.adapt import policy\nfrom engine import lookup\n")
    (tmp_path / "run.py").write_text("from engine.doors.cli import main\n")   # a shim may
    assert core_imports_from_folders(tmp_path) == ["decoders: engine.adapt.policy"]


def test_a_bad_flag_is_one_line_and_exit_2():
    import subprocess
    import sys
    r = subprocess.run([sys.executable, "-m", "tools.size", "--bogus"], capture_output=True, text=True,
                       cwd=size.ENGINE.parent)
    assert r.returncode == 2 and r.stdout == "" and r.stderr.strip().splitlines() == ["error: unrecognized arguments: --bogus"]
