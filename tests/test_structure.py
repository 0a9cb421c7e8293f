"""The shape of the finetune/ package, read from its source with ast (no imports, no processes): no import
cycles, no overlong functions. Each check comes with a test on a planted package showing it can fail."""

from __future__ import annotations

import ast
import textwrap
from collections import deque
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SKIP = ("metric_modules",)  # evaluate metric scripts, loaded by path: not modules of the package
LIMIT = 60  # lines of a function, from `def` (decorators excluded) to its last line, docstring included

# Functions allowed over LIMIT: "path:qualname" -> why it is better whole. At most 5, each with its reason; an
# entry that no longer exists or is back under the limit fails the test (remove it). Empty on purpose for now:
# whoever restructures a module and decides a function should stay long adds it here, e.g.
#     "finetune/report/card.py:card_text": "the model card's template: one f-string per section",
LONG_ALLOWED: dict[str, str] = {}


def modules_of(root: Path, package: str, skip=SKIP) -> dict[str, Path]:
    """Dotted module name -> file, for every .py under root/package (a package is named by its __init__.py)."""
    out = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        if any(s in parts for s in skip):
            continue
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def imported_names(node: ast.Import | ast.ImportFrom, module: str, is_package: bool) -> list[str]:
    """The absolute dotted names an import statement names: `import a.b` -> a.b; `from a import x` -> a.x (x may be
    a submodule or a name in a; `*` -> a); relative imports resolved against the importing module."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    base = node.module or ""
    if node.level:
        here = module.split(".") if is_package else module.split(".")[:-1]  # the package `.` means
        if node.level - 1 > len(here):
            return []
        anchor = here[: len(here) - (node.level - 1)]
        base = ".".join(anchor + ([node.module] if node.module else []))
    return [base if alias.name == "*" else f"{base}.{alias.name}" for alias in node.names]


def import_graph(root: Path, package: str, skip=SKIP) -> tuple[set[str], dict[str, dict[str, str]]]:
    """Modules of the package and its import edges: importer -> {imported: "file:line" of the first such import}.
    Every import statement counts, wherever it is (function bodies, if/try, `if TYPE_CHECKING:`)."""
    files = modules_of(root, package, skip)
    edges: dict[str, dict[str, str]] = {m: {} for m in files}
    for module, path in files.items():
        is_package = path.name == "__init__.py"
        tree = ast.parse(path.read_text(), str(path))
        imports = sorted(
            (n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))), key=lambda n: n.lineno
        )
        for node in imports:
            for name in imported_names(node, module, is_package):
                # The deepest module it names: `from pkg import name` -> pkg.name when a submodule, else pkg.
                parts = name.split(".")
                prefixes = (".".join(parts[:i]) for i in range(len(parts), 0, -1))
                target = next((p for p in prefixes if p in files), None)
                if target and target != module:
                    edges[module].setdefault(target, f"{path.relative_to(root)}:{node.lineno}")
    return set(files), edges


def strongly_connected(nodes: set[str], edges: dict[str, dict[str, str]]) -> list[list[str]]:
    """Tarjan's strongly connected components, iterative (an explicit stack of successor iterators), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []  # visited nodes not yet assigned to a component
    out = []

    def enter(node: str) -> tuple[str, Iterator[str]]:
        index[node] = low[node] = len(index)
        stack.append(node)
        return node, iter(sorted(edges[node]))

    for start in sorted(nodes):
        work = [] if start in index else [enter(start)]
        while work:
            node, successors = work[-1]
            succ = next((s for s in successors if s not in index or s in stack), None)
            if succ is not None and succ not in index:
                work.append(enter(succ))  # descend; node's iterator resumes when succ is done
            elif succ is not None:
                low[node] = min(low[node], index[succ])  # an edge back into the current path
            else:  # node is finished: pass its low link up, and close its component if it is the root
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    cut = stack.index(node)
                    out.append(sorted(stack[cut:]))
                    del stack[cut:]
    return out


def shortest_cycle(component: list[str], edges: dict[str, dict[str, str]]) -> list[str]:
    """A shortest cycle inside a strongly connected component, as [a, b, ..., a] (a BFS from each member)."""
    cycles = []
    for start in component:
        paths = {start: [start]}  # node -> the shortest path from start to it
        queue = deque([start])
        while queue:
            node = queue.popleft()
            if start in edges[node]:  # no self-edges, so node != start
                cycles.append(paths[node] + [start])
                break
            for succ in sorted(set(edges[node]) & set(component) - paths.keys()):
                paths[succ] = paths[node] + [succ]
                queue.append(succ)
    return min(cycles, key=len)


def cycle_report(nodes: set[str], edges: dict[str, dict[str, str]]) -> list[str]:
    """One paragraph per import cycle (component of more than one module): its members, a shortest cycle with
    the file:line of each edge, and every import inside the component (the edges to cut from)."""
    out = []
    for component in strongly_connected(nodes, edges):
        if len(component) < 2:
            continue
        cycle = shortest_cycle(component, edges)
        lines = [f"import cycle among {len(component)} modules: {', '.join(component)}", "  e.g. " + " -> ".join(cycle)]
        lines += [f"    {a} -> {b}  ({edges[a][b]})" for a, b in zip(cycle, cycle[1:])]
        lines.append("  all imports inside it:")
        lines += [f"    {a} -> {b}  ({edges[a][b]})" for a in component for b in sorted(edges[a]) if b in component]
        out.append("\n".join(lines))
    return out


def function_lengths(root: Path, package: str, skip=SKIP) -> dict[str, tuple[int, str]]:
    """{"path:qualname": (lines, "path:line")} for every function and method, nested ones included."""
    out: dict[str, tuple[int, str]] = {}

    def visit(node: ast.AST, prefix: str, rel: str) -> None:
        for child in ast.iter_child_nodes(node):
            name = prefix
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = f"{prefix}{child.name}"
                if not isinstance(child, ast.ClassDef):  # lineno is the `def` line: decorators excluded
                    lines = child.end_lineno - child.lineno + 1
                    key = f"{rel}:{name}"
                    out[key] = max(out.get(key, (0, "")), (lines, f"{rel}:{child.lineno}"))
                name += "."
            visit(child, name, rel)

    for path in modules_of(root, package, skip).values():
        visit(ast.parse(path.read_text(), str(path)), "", str(path.relative_to(root)))
    return out


def long_functions(root: Path, package: str, allowed=(), skip=SKIP) -> list[str]:
    """`path:line qualname (N lines)` for every function over LIMIT not in allowed, longest first."""
    found = [(n, where, key) for key, (n, where) in function_lengths(root, package, skip).items() if n > LIMIT]
    return [
        f"{where} {key.split(':', 1)[1]} ({n} lines)"
        for n, where, key in sorted(found, key=lambda f: -f[0])
        if key not in allowed
    ]


def test_no_import_cycles():
    """No module of finetune/ imports itself back, directly or through others, even from inside a function."""
    nodes, edges = import_graph(ROOT, "finetune")
    assert len(nodes) >= 20, sorted(nodes)
    assert any(edges.values()), "no imports found: the graph builder is broken"
    cycles = cycle_report(nodes, edges)
    assert cycles == [], f"{len(cycles)} import cycle(s) in finetune/:\n\n" + "\n\n".join(cycles)


def plant(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


def test_the_cycle_check_sees_a_cycle(tmp_path):
    """A planted cycle a -> b -> c -> a (relative, function-local, `from pkg import submodule`) is found; the same
    package without c's import back is clean."""
    common = {
        "pkg/__init__.py": "",
        "pkg/a.py": "from . import b\n",
        "pkg/b.py": "def f():\n    from pkg.sub import c\n    return c\n",
        "pkg/sub/__init__.py": "",
    }
    cyclic = plant(tmp_path / "cyclic", {**common, "pkg/sub/c.py": "import os\n\nif os:\n    from ..a import b\n"})
    nodes, edges = import_graph(cyclic, "pkg")
    assert edges["pkg.a"] == {"pkg.b": "pkg/a.py:1"} and edges["pkg.b"] == {"pkg.sub.c": "pkg/b.py:2"}
    assert edges["pkg.sub.c"] == {"pkg.a": "pkg/sub/c.py:4"}
    [report] = cycle_report(nodes, edges)
    assert "pkg.a -> pkg.b -> pkg.sub.c -> pkg.a" in report, report
    acyclic = plant(tmp_path / "acyclic", {**common, "pkg/sub/c.py": "import os\n"})
    assert cycle_report(*import_graph(acyclic, "pkg")) == []


def test_no_function_over_60_lines():
    """Functions fit on a screen; the few exceptions are named in LONG_ALLOWED with a reason."""
    assert len(LONG_ALLOWED) <= 5, "LONG_ALLOWED is for a few exceptions, not a second rule"
    lengths = function_lengths(ROOT, "finetune")
    long = {k for k, (n, _) in lengths.items() if n > LIMIT}
    stale = [f"{k}: {f'{lengths[k][0]} lines' if k in lengths else 'gone'}" for k in LONG_ALLOWED if k not in long]
    assert stale == [], f"remove from LONG_ALLOWED (gone, or now {LIMIT} lines or fewer):\n" + "\n".join(stale)
    found = long_functions(ROOT, "finetune", LONG_ALLOWED)
    assert found == [], f"{len(found)} function(s) over {LIMIT} lines (split them):\n" + "\n".join(found)


def test_the_length_check_sees_a_long_function(tmp_path):
    """A planted 61-line method is caught, a 60-line decorated function is not."""

    def function(name, lines):  # the def line, a docstring, then `pass` lines: `lines` lines in all
        return f'def {name}():\n    """Doc."""\n' + "    pass\n" * (lines - 2)

    text = "import functools\n\n\n@functools.cache\n" + function("ok", 60)  # lines 4, 5-64
    text += "\n\nclass C:\n" + textwrap.indent(function("long", 61), "    ")  # lines 67, 68-128
    plant(tmp_path, {"pkg/__init__.py": "", "pkg/mod.py": text})
    assert function_lengths(tmp_path, "pkg")["pkg/mod.py:ok"][0] == 60
    assert long_functions(tmp_path, "pkg") == ["pkg/mod.py:68 C.long (61 lines)"]
