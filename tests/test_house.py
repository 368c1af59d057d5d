"""The house rules a newcomer relies on (docs/design.md §2): no module of the suite is longer
than one sitting's read, and the layout table names every module."""

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
MAX_LINES = 400
MODULES = sorted(p for folder in ("conformance", "backends", "references")
                 for p in (ROOT / folder).rglob("*.py"))


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_module_is_longer_than_the_limit(path):
    lines = len(path.read_text().splitlines())
    assert lines <= MAX_LINES, (f"{path.relative_to(ROOT)} has {lines} lines; split it by job "
                                f"(at most {MAX_LINES})")


def test_the_layout_table_names_every_module_of_the_harness():
    design = (ROOT / "docs" / "design.md").read_text()
    layout = design[design.index("## §2 Layout"):design.index("\n## ", design.index("## §2"))]
    missing = [p.name for p in (ROOT / "conformance").glob("*.py")
               if p.name not in ("__init__.py", "__main__.py") and f"{p.name}`" not in layout
               and f"{p.name}," not in layout]
    assert not missing, f"docs/design.md §2 does not name {missing}"
