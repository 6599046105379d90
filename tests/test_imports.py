"""The package has no import circle: no module reaches itself through its imports (deferred ones too)."""

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parent.parent / "draftheads"


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
