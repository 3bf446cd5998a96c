"""tools/size.py: each line of a module is counted once, as code, prose or blank, and every
module of engine/ is counted."""
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
    total = sum(len(p.read_text().splitlines()) for p in size.ENGINE.glob("*.py"))
    last = size.table().splitlines()[-1]
    assert last.startswith(f"| **engine/** | | **{total}** |")


def test_a_module_no_part_names_is_an_error_not_a_line_left_out(tmp_path):
    for m in (m for ms in size.PARTS.values() for m in ms):
        (tmp_path / f"{m}.py").write_text("x = 1\n")
    size.table(tmp_path)                                   # every module placed: a table
    (tmp_path / "newcomer.py").write_text("y = 2\n")
    with pytest.raises(ValueError, match="newcomer"):
        size.table(tmp_path)


def test_a_bad_flag_is_one_line_and_exit_2():
    import subprocess
    import sys
    r = subprocess.run([sys.executable, "-m", "tools.size", "--bogus"], capture_output=True, text=True,
                       cwd=size.ENGINE.parent)
    assert r.returncode == 2 and r.stdout == "" and r.stderr.strip().splitlines() == ["error: unrecognized arguments: --bogus"]
