"""No import loop among the modules of the kernel package (`twell`, kernels/) and the toolkit (sparsify/): the
graph of every import they make, top-level or inside functions, read from the source with ast."""
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {"twell": ROOT / "kernels", "sparsify": ROOT / "sparsify"}


def module_files() -> dict:
    """Dotted module name -> file, for every module of both packages (sparsify.remote included)."""
    files = {}
    for package, folder in PACKAGES.items():
        for path in folder.rglob("*.py"):
            parts = path.relative_to(folder).with_suffix("").parts
            files[".".join((package, *parts[:-1 if parts[-1] == "__init__" else None]))] = path
    return files


def imported(name: str, path: Path, files: dict) -> set:
    """The modules of both packages that module `name` imports, with the packages that an import from outside
    them runs first (their __init__)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    targets = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = package.rsplit(".", node.level - 1)[0] if node.level else ""
            base = ".".join(part for part in (base, node.module) if part)
            targets |= {base} | {f"{base}.{alias.name}" for alias in node.names}  # `from package import module`
    parents = {".".join(t.split(".")[:n]) for t in targets for n in range(1, t.count(".") + 1)}
    outside = {p for p in parents if not (name + ".").startswith(p + ".")}
    return {t for t in targets | outside if t in files and t != name}


def find_cycle(graph: dict):
    """One import loop as a list of modules, or None."""
    state, stack = {}, []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        state[node] = "done"
        stack.pop()
        return None

    return next((cycle for node in sorted(graph) if node not in state and (cycle := visit(node))), None)


def test_no_import_loop():
    files = module_files()
    graph = {name: imported(name, path, files) for name, path in files.items()}
    assert {"twell.gated_mlp", "twell.batched", "twell.training.hybrid", "sparsify.export",
            "sparsify.remote.modeling_twell"} <= set(graph)
    assert "twell.paths" in graph["twell.gated_mlp"] and "twell" in graph["sparsify.export"]
    assert "twell.format" in graph["twell.training.hybrid"]  # a relative import two levels up
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))


def test_find_cycle_finds_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None
