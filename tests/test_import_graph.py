"""The package's modules import each other without circles: every relative import, at module
level or inside a function (where a circle hides), read from the source."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SKIP = {"tests", "bench", "conformance", ".venv", ".ci", "build", "api_workflows", "example_workflows"}


def _modules() -> dict[str, Path]:
    found = {}
    for path in ROOT.rglob("*.py"):
        rel = path.relative_to(ROOT)
        if rel.parts[0] in SKIP or rel.parts[0].startswith("."):
            continue
        parts = list(rel.with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def _resolve(module: str, is_package: bool, level: int, name: str | None) -> str:
    base = module.split(".") if module else []
    if not is_package:
        base = base[:-1]
    base = base[:len(base) - (level - 1)] if level > 1 else base
    return ".".join([*base, *(name.split(".") if name else [])])


def import_graph() -> dict[str, set[str]]:
    modules = _modules()
    graph = {}
    for module, path in modules.items():
        is_package = path.name == "__init__.py"
        edges = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.level > 0:
                target = _resolve(module, is_package, node.level, node.module)
                for alias in node.names:
                    sub = f"{target}.{alias.name}" if target else alias.name
                    edges.add(sub if sub in modules else target)
        graph[module] = {e for e in edges if e in modules and e != module}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    found, state, stack = [], {}, []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                found.append(stack[stack.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node)
    return found


def test_the_graph_is_read():
    graph = import_graph()
    assert "runner.cli" in graph["runner"] or "runner.run_command" in graph["runner.cli"]
    assert "wan.attention" in graph["wan.dit"]


def test_no_module_imports_itself_through_others():
    # packages' __init__ re-exporting their modules is not a circle of code: skip the edge
    # from a module to the __init__ of its own package
    graph = {m: {e for e in edges if not m.startswith(e + ".")}
             for m, edges in import_graph().items()}
    assert _cycles(graph) == []


def test_no_command_imports_the_cli():
    graph = import_graph()
    commands = [m for m in graph if m.startswith("runner.") and m.endswith("_command")]
    assert commands and all("runner.cli" not in graph[m] for m in commands)
