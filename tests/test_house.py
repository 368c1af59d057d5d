"""The house rules a newcomer relies on (docs/design.md §2): no module of the suite, nor the
README, is longer than one sitting's read, the layout table names every module, and no import
goes round in a circle."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
MAX_LINES = 400
MODULES = sorted(p for folder in ("conformance", "backends", "references")
                 for p in (ROOT / folder).rglob("*.py"))


README_BYTES = 12 * 1024  # a newcomer reads it in one sitting; the rest lives in docs/


def test_the_readme_is_read_in_one_sitting():
    size = len((ROOT / "README.md").read_bytes())
    assert size <= README_BYTES, (f"README.md has {size} bytes; move details to docs/ (at most "
                                  f"{README_BYTES})")


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


def installed_name(path: Path) -> str:
    """The module's name once installed: the adapters and references live under ``conformance``."""
    parts = path.relative_to(ROOT).with_suffix("").parts
    name = ".".join(parts if parts[0] == "conformance" else ("conformance", *parts))
    return name.removesuffix(".__init__")


def module_imports() -> dict[str, set[str]]:
    """Each module of the suite and the suite's modules it imports at module level (imports
    inside functions are deferred on purpose and do not count)."""
    names = {installed_name(p): p for p in MODULES}

    def known(module: str) -> str | None:
        while module and module not in names:
            module = module.rpartition(".")[0]
        return module or None

    graph = {}
    for name, path in names.items():
        imported = set()
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                imported.add(node.module)
            elif isinstance(node, ast.Import):
                imported |= {alias.name for alias in node.names}
        graph[name] = {k for k in map(known, imported) if k and k != name}
    return graph


def test_no_module_imports_one_that_imports_it_back():
    graph = module_imports()
    done: set[str] = set()

    def walk(module: str, path: list[str]) -> list[str] | None:
        if module in path:
            return [*path[path.index(module):], module]
        if module in done:
            return None
        for imported in sorted(graph[module]):
            circle = walk(imported, [*path, module])
            if circle:
                return circle
        done.add(module)
        return None

    for module in sorted(graph):
        circle = walk(module, [])
        assert circle is None, "import circle: " + " -> ".join(circle)


def test_what_a_command_does_lives_on_the_command_line_side():
    # a subject (bench, explore, a backend's build) that held its own command handler imported
    # the runner and the command line back, and made the import circle this file guards against
    line_side = ("conformance.cli", "conformance.commands", "conformance.__main__")
    misplaced = []
    for path in MODULES:
        if installed_name(path).startswith(line_side):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef) and (node.name.startswith("handle_")
                                                       or node.name.endswith("_command")):
                misplaced.append(f"{path.relative_to(ROOT)}: def {node.name}")
            elif (isinstance(node, ast.ImportFrom) and node.module
                  and node.module.startswith(line_side[:2])):
                misplaced.append(f"{path.relative_to(ROOT)}: imports {node.module}")
    assert not misplaced, "belongs in conformance/commands/: " + "; ".join(misplaced)


def test_a_verdict_is_recorded_by_one_class():
    # a check's Outcome and the report's Result held the same fields twice, and each field
    # added to one had to be copied across by hand
    verdict_fields = {"check", "status", "error", "message"}
    holders = []
    for path in MODULES:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                fields = {item.target.id for item in node.body
                          if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name)}
                if verdict_fields <= fields:
                    holders.append(f"{path.relative_to(ROOT)}: {node.name}")
    assert holders == ["conformance/result.py: Result"], holders
