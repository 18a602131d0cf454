"""No function in src/torchloom is longer than MAX_LINES: a longer one does several jobs, so split it by job."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parent.parent / "src" / "torchloom"
MAX_LINES = 60
# "path/to/module.py:qualified.name" of functions allowed to be longer, each with its reason. Keep it empty.
ALLOWED: set[str] = set()


def long_functions(root: Path, limit: int) -> dict[str, int]:
    """Every function or method under `root` longer than `limit` lines (decorators not counted), by
    "path:qualified.name" (path relative to `root`), with its length."""
    found: dict[str, int] = {}
    for path in sorted(root.rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        stack: list[tuple[ast.AST, str]] = [(tree, "")]
        while stack:
            node, prefix = stack.pop()
            for child in ast.iter_child_nodes(node):
                name = prefix
                if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    name = f"{prefix}{child.name}"
                    lines = child.end_lineno - child.lineno + 1
                    if not isinstance(child, ast.ClassDef) and lines > limit:
                        found[f"{path.relative_to(root).as_posix()}:{name}"] = lines
                    name += "."
                stack.append((child, name))
    return found


def test_no_function_is_longer_than_60_lines():
    too_long = {name: n for name, n in long_functions(SRC, MAX_LINES).items() if name not in ALLOWED}
    assert not too_long, (f"functions over {MAX_LINES} lines; split each by job: "
                          + ", ".join(f"{name} ({n} lines)" for name, n in sorted(too_long.items())))


def test_the_allow_list_names_only_functions_that_are_still_long():
    stale = ALLOWED - set(long_functions(SRC, MAX_LINES))
    assert not stale, f"no longer over {MAX_LINES} lines; remove from ALLOWED: {sorted(stale)}"


def test_lengths_count_nested_functions_and_methods_on_their_own(tmp_path):
    body = "\n".join(f"    x{i} = {i}" for i in range(59))
    (tmp_path / "m.py").write_text(
        f"def short():\n    pass\n\n\ndef long():\n{body}\n    y = 1\n\n\n"
        f"class C:\n    def method(self):\n        def inner():\n{body.replace('    ', '            ')}\n"
        "            return 1\n        return inner\n",
        encoding="utf-8")
    assert long_functions(tmp_path, 60) == {"m.py:long": 61, "m.py:C.method": 63, "m.py:C.method.inner": 61}
