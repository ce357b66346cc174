"""The code stays readable for a newcomer: in sparsify/, kernels/, cli.py and benchmarks/ no file is over 600 lines,
no function over 80 but @triton.jit and @gluon.jit kernels, and no module reaches another's private (underscored)
name, by import or by attribute: what crosses a file is public. And the README names only files the repository
holds."""
import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FILES = sorted([ROOT / "cli.py", *(ROOT / "sparsify").rglob("*.py"), *(ROOT / "kernels").rglob("*.py"),
                *(ROOT / "benchmarks").rglob("*.py")])
MAX_FILE_LINES, MAX_FUNCTION_LINES = 600, 80
PROJECT = ("twell", "sparsify", "cli")  # the packages whose modules' private names stay in their files
JIT = {"triton.jit", "gluon.jit"}
NAMED_TUPLE_API = {"_fields", "_replace", "_asdict", "_make", "_field_defaults"}  # public, underscored against clashes


def private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__") and name not in NAMED_TUPLE_API


def project_modules(tree) -> set:
    """The names under which a file imports modules (or names) of the project."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {alias.asname or alias.name.split(".")[0] for alias in node.names
                      if alias.name.split(".")[0] in PROJECT}
        elif isinstance(node, ast.ImportFrom) and (node.level or node.module.split(".")[0] in PROJECT):
            names |= {alias.asname or alias.name for alias in node.names}
    return names


def private_attributes(tree) -> list:
    """`module._name` (or a longer chain) on a name imported from the project or on a module looked up in
    sys.modules: (line, the expression)."""
    imported, found = project_modules(tree), []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and private(node.attr):
            root = node.value
            while isinstance(root, ast.Attribute):
                root = root.value
            by_name = isinstance(root, ast.Subscript) and ast.unparse(root.value) == "sys.modules"
            if isinstance(root, ast.Name) and root.id in imported or by_name:
                found.append((node.lineno, ast.unparse(node)))
    return found


@pytest.mark.parametrize("path", FILES, ids=lambda path: str(path.relative_to(ROOT)))
def test_short_files_short_functions_no_private_imports(path):
    text = path.read_text()
    assert text.count("\n") <= MAX_FILE_LINES
    tree = ast.parse(text)
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not JIT & {
                ast.unparse(d) for d in node.decorator_list}:
            assert node.end_lineno - node.lineno < MAX_FUNCTION_LINES, f"{node.name} (line {node.lineno})"
        if isinstance(node, ast.ImportFrom):
            names = [alias.name for alias in node.names if private(alias.name)]
            assert not names, f"line {node.lineno}: from {node.module} import {', '.join(names)}"
    assert not private_attributes(tree)


def test_private_attributes_are_found():
    tree = ast.parse("import twell.hybrid as H\nfrom twell import cost_model\nimport torch\n"
                     "H._pack(1)\ncost_model.GATE._x\ntorch._C.y\nH.__name__\nH.Stats._fields\n"
                     "sys.modules['twell.gated_mlp']._CACHE\n")
    assert sorted(private_attributes(tree)) == [(4, "H._pack"), (5, "cost_model.GATE._x"),
                                                (9, "sys.modules['twell.gated_mlp']._CACHE")]


def test_the_readme_names_only_files_the_repository_holds():
    """Each file a link or an inline `path` of the README names exists: a bare JSON name under benchmarks/results/
    (as its table gives them), anything else from the repository root. Code blocks name outputs too (demo-sparse/):
    they are left out."""
    text = re.sub(r"```.*?```", "", (ROOT / "README.md").read_text(), flags=re.S)
    named = re.findall(r"\]\(([^)#\s]+)", text) + [
        name for span in re.findall(r"`([^`]+)`", text) for name in re.split(r"[\s,]+", span)
        if re.fullmatch(r"[\w./-]+\.(json|yaml|py|md|sh)|[\w.-]+(/[\w.-]+)*/", name)]
    assert len(named) > 10
    missing = [name for name in named
               if not (ROOT / name).exists() and not (ROOT / "benchmarks" / "results" / name).is_file()]
    assert not missing
