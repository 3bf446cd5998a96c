"""tools/size.py: each line of a module is counted once, as code, prose or blank, and every
module of engine/ is counted, by the folder it sits in. (The parts' import direction:
tests/test_imports.py.)"""
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


def test_every_part_holds_its_ceiling():
    # Why: a ceiling that does not hold is a wish; a change that takes a part past it must shrink
    # something there or raise the ceiling in a commit that says what the lines buy
    over = {p: n for p, n in size.part_lines().items() if n > size.CEILING[p]}
    assert over == {}, over


def test_a_part_past_its_ceiling_is_named(monkeypatch):
    # the broken variant: a ceiling below today's lines is caught, by name
    monkeypatch.setitem(size.CEILING, "loading", 10)
    assert {p for p, n in size.part_lines().items() if n > size.CEILING[p]} == {"loading"}


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


def test_a_bad_flag_is_one_line_and_exit_2():
    import subprocess
    import sys
    r = subprocess.run([sys.executable, "-m", "tools.size", "--bogus"], capture_output=True, text=True,
                       cwd=size.ENGINE.parent)
    assert r.returncode == 2 and r.stdout == "" and r.stderr.strip().splitlines() == ["error: unrecognized arguments: --bogus"]
