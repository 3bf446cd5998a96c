"""The pages cite only what the repository ships: every file path a README or a docs/ page
names exists, every relative link resolves, and every `engine.x.y` / `tools.x` name it gives is
a module there (and, past the module, a name in its source)."""
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", ROOT / "tools" / "README.md", ROOT / "weights" / "README.md",
         *sorted((ROOT / "docs").glob("*.md"))]
PATH = re.compile(r"(?<![\w/.])((?:engine|tools|tests|docs|weights)/[\w./-]+\.(?:py|md|json|png|txt))")
LINK = re.compile(r"\]\(([^)#:]+)\)")
DOTTED = re.compile(r"`((?:engine|tools)\.[\w.]+)")


def missing(page: Path, text: str) -> list[str]:
    out = []
    for p in PATH.findall(text):
        if "NAME" not in p and not ((ROOT / p).exists() or (page.parent / p).exists()):
            out.append(p)
    out += [f"link {p}" for p in LINK.findall(text) if not (page.parent / p).exists()]
    for name in DOTTED.findall(text):
        parts = name.rstrip(".").split(".")
        for i in range(len(parts), 0, -1):
            path = ROOT.joinpath(*parts[:i])
            source = path.with_suffix(".py") if path.with_suffix(".py").exists() else path / "__init__.py"
            if source.exists():
                if parts[i:] and not re.search(rf"\b{re.escape(parts[i])}\b", source.read_text()):
                    out.append(name)
                break
        else:
            out.append(name)
    return out


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_a_page_names_only_what_is_there(page):
    assert missing(page, page.read_text()) == []


def test_a_stale_name_is_caught():
    # the broken variant: the pages once named `engine.quality` and `api.build`, gone since
    assert missing(ROOT / "docs" / "x.md", "see `engine.quality` and engine/doors/gone.py and [x](nope.md)") == \
        ["engine/doors/gone.py", "link nope.md", "engine.quality"]
