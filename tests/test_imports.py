"""The package has no import circle: no module reaches itself through its imports (deferred ones too).
Training and inference import neither each other, and inference imports no data generation, at module
level or inside functions."""

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parent.parent / "draftheads"
APART = {"training": {"inference"}, "inference": {"training", "datagen"}}
"""Layer -> the layers it must not import (data generation sits above both and may use either)."""


def _module(path: Path) -> str:
    parts = path.relative_to(PKG.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def test_no_import_cycles():
    files = {_module(p): p for p in PKG.rglob("*.py")}
    graph = {m: {n.module for n in ast.walk(ast.parse(p.read_text())) if isinstance(n, ast.ImportFrom)
                 and n.module in files} for m, p in files.items()}
    state: dict[str, int] = {}
    cycles = []

    def visit(m, stack):
        state[m] = 1
        stack.append(m)
        for d in sorted(graph[m]):
            if state.get(d) == 1:
                cycles.append(stack[stack.index(d):] + [d])
            elif d not in state:
                visit(d, stack)
        stack.pop()
        state[m] = 2

    for m in sorted(files):
        if m not in state:
            visit(m, [])
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


def imported_names(source: str, module: str, is_package: bool = False) -> list[tuple[ast.stmt, list[str]]]:
    """Every import statement anywhere in ``module``'s body, with the absolute names it may bring in:
    ``import a.b`` gives ``a.b``; ``from a import b`` gives ``a`` and ``a.b`` (``b`` may be a submodule);
    relative imports are resolved against ``module``'s package."""
    package = module if is_package else module.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out.append((node, [alias.name for alias in node.names]))
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parent + ([base] if base else []))
            out.append((node, [base] + [f"{base}.{alias.name}" for alias in node.names]))
    return out


def _layer(name: str) -> str | None:
    parts = name.split(".")
    return parts[1] if len(parts) > 1 and parts[0] == "draftheads" else None


def test_the_walk_sees_deferred_relative_and_package_imports():
    src = ("import draftheads.inference.engine\n"
           "def f():\n    from draftheads import inference\n"
           "def g():\n    from ..inference.tree import Tree\n")
    found = imported_names(src, "draftheads.training.module")
    names = {name for _, names in found for name in names}
    assert [node.lineno for node, _ in found] == [1, 3, 5]
    assert {"draftheads.inference.engine", "draftheads.inference", "draftheads.inference.tree"} <= names


def test_training_and_inference_stay_apart():
    bad = []
    for path in sorted(PKG.rglob("*.py")):
        module = _module(path)
        banned = APART.get(_layer(module), set())
        for node, names in imported_names(path.read_text(), module, path.name == "__init__.py"):
            if any(_layer(name) in banned for name in names):
                bad.append(f"{module} line {node.lineno}: {ast.unparse(node)}")
    assert not bad, "imports across layers that must stay apart:\n" + "\n".join(bad)
