"""The toolkit stays readable for a newcomer: in sparsify/, cli.py and benchmarks/ no file is over 600 lines, no
function over 80, and no module imports another's private (underscored) name: what crosses a file is public."""
import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FILES = sorted([ROOT / "cli.py", *(ROOT / "sparsify").rglob("*.py"), *(ROOT / "benchmarks").rglob("*.py")])
MAX_FILE_LINES, MAX_FUNCTION_LINES = 600, 80


@pytest.mark.parametrize("path", FILES, ids=lambda path: str(path.relative_to(ROOT)))
def test_short_files_short_functions_no_private_imports(path):
    text = path.read_text()
    assert text.count("\n") <= MAX_FILE_LINES
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            assert node.end_lineno - node.lineno < MAX_FUNCTION_LINES, f"{node.name} (line {node.lineno})"
        if isinstance(node, ast.ImportFrom):
            private = [alias.name for alias in node.names if alias.name.startswith("_") and alias.name != "__version__"]
            assert not private, f"line {node.lineno}: from {node.module} import {', '.join(private)}"
