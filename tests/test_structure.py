"""The package's shape: no import circles (lazy imports inside functions count too), and the floors
hold: nothing below the engine imports the engine or anything built on it."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "lmserve"
# the floors above the core, top first: the front doors (command line, server, benchmarks, planner;
# they may use each other's leaves, e.g. the engine flags), the offline API, the engine itself
FLOORS = (("lmserve.cli", "lmserve.server", "lmserve.router", "lmserve.bench", "lmserve.plan"), ("lmserve.llm",), ("lmserve.engine",))


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """module -> the lmserve modules it imports anywhere in its body (a package's __init__ counts as
    the package; `from pkg import name` points at pkg.name when that is a module)."""
    files = {module_name(p): p for p in ROOT.rglob("*.py")}
    graph: dict[str, set[str]] = {m: set() for m in files}
    facade = {f"lmserve.{a.name}": f"{n.module}.{a.name}" for n in ast.parse((ROOT / "__init__.py").read_text()).body
              if isinstance(n, ast.ImportFrom) for a in n.names}  # `from lmserve import LLM` -> lmserve.llm
    for mod, path in files.items():
        is_pkg = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text())):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    pkg = mod.split(".") if is_pkg else mod.split(".")[:-1]
                    pkg = pkg[:len(pkg) - node.level + 1]
                    base = ".".join(pkg + ([base] if base else []))
                targets = [facade.get(f"{base}.{a.name}", f"{base}.{a.name}") for a in node.names]
            for t in targets:
                while t and t not in files:
                    t = t.rpartition(".")[0]
                if t.startswith("lmserve") and t != mod:
                    graph[mod].add(t)
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def floor_of(mod: str) -> int:
    """0 for the core below the engine, higher for the FLOORS above it; the package itself (which
    re-exports LLM and Engine, and through which the names it re-exports are resolved) is on top."""
    if mod == "lmserve":
        return len(FLOORS) + 1
    for i, prefixes in enumerate(FLOORS):
        if any(mod == p or mod.startswith(p + ".") for p in prefixes):
            return len(FLOORS) - i
    return 0


def test_the_checker_sees_circles_and_floors():
    g = {"lmserve.a": {"lmserve.b"}, "lmserve.b": {"lmserve.c"}, "lmserve.c": {"lmserve.a"}, "lmserve.d": set()}
    assert circles(g) == [["lmserve.a", "lmserve.b", "lmserve.c"]]
    assert floor_of("lmserve.server.app") > floor_of("lmserve.engine") > floor_of("lmserve.scheduler") == 0
    graph = import_graph()
    assert "lmserve.kv.block_manager" in graph["lmserve.scheduler"]  # module-level import
    assert "lmserve.engine" in graph["lmserve.llm"]


def test_no_import_circles():
    assert circles(import_graph()) == []


def test_nothing_below_imports_what_stands_above():
    bad = [(m, t) for m, ts in import_graph().items() for t in ts if floor_of(t) > floor_of(m)]
    assert bad == []


def test_modules_stay_readable():
    """engine.py stays the readable heart (~250 lines); no module passes ~400 lines but the Triton
    kernels."""
    sizes = {module_name(p): len(p.read_text().splitlines()) for p in ROOT.rglob("*.py")}
    assert sizes["lmserve.engine"] <= 250
    kernels = ("lmserve.attention.triton_attn", "lmserve.layers.triton_quant")  # Triton kernel files
    assert {m: n for m, n in sizes.items() if n > 400 and m not in kernels} == {}
