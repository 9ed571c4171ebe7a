"""The guides stay readers' pages: short, and naming only code and pages that exist.

Guide pages are README.md and docs/*.md; docs/results/ holds benchmark output and records of
experiments, which may name code as it was when they were measured.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
GUIDES = sorted((ROOT / "docs").glob("*.md"))
PAGES = [ROOT / "README.md", *GUIDES]
MAX_GUIDE_LINES = 250
"""Issue 34: every guide page stays a reader's page."""

# A path of this repository's code, not a tail of another one (sglang/srt/eplb/...py).
CODE_PATH = re.compile(r"(?<![\w/.-])((?:eplb|planners|benchmarks)/[\w/]*\.py)\b")
# A relative Markdown link: [text](target), target without a scheme.
LINK = re.compile(r"\]\(((?![a-z]+:)[^)#\s]+)(?:#[^)]*)?\)")


def _name(page: Path) -> str:
    return str(page.relative_to(ROOT))


@pytest.mark.parametrize("page", GUIDES, ids=_name)
def test_guide_pages_are_short(page):
    lines = len(page.read_text().splitlines())
    assert lines <= MAX_GUIDE_LINES, (f"{_name(page)} has {lines} lines, more than {MAX_GUIDE_LINES}: move "
                                      f"measurements and history to docs/results/, or split the page")


@pytest.mark.parametrize("page", PAGES, ids=_name)
def test_code_paths_named_in_guides_exist(page):
    missing = sorted({p for p in CODE_PATH.findall(page.read_text()) if not (ROOT / p).is_file()})
    assert not missing, f"{_name(page)} names files that are not in the tree: {', '.join(missing)}"


@pytest.mark.parametrize("page", PAGES, ids=_name)
def test_relative_links_in_guides_exist(page):
    missing = sorted({t for t in LINK.findall(page.read_text()) if not (page.parent / t).exists()})
    assert not missing, f"{_name(page)} links to pages that are not in the tree: {', '.join(missing)}"


def test_the_path_pattern_skips_other_projects_paths():
    text = "see `eplb/core/jit.py`, planners/greedy.py:plan and sglang/srt/eplb/eplb_algorithms/deepseek.py"
    assert CODE_PATH.findall(text) == ["eplb/core/jit.py", "planners/greedy.py"]
