"""Structure figures of the source tree, counted one way so rounds can be compared.

    python scripts/structure_figures.py [-v] [ROOT]  # ROOT: a checkout (default: this one)
    git worktree add /tmp/old 0c08cfc && python scripts/structure_figures.py /tmp/old

What is counted:

* modules: ``.py`` files under ``deltasync/``, ``storage/``, ``cli/`` and ``rl_integration/``
  (each file once: ``deltasync/storage`` and the like are links to the top-level folders),
  without the generated ``deltasync/v1/``;
* function length: lines from ``def`` to the function's last line (decorators not counted),
  every function and method, nested ones included; median and 90th percentile;
* long parameter lists: functions with more than 6 parameters, counting positional,
  keyword-only, ``*args`` and ``**kwargs``, not counting a first ``self`` or ``cls``;
* modules over 500 and over 700 lines;
* module-level import cycles: strongly connected groups (more than one module) of the graph
  of imports made when a module is imported (top-level statements, ``if``/``try`` blocks
  included, ``if TYPE_CHECKING:`` blocks and imports inside functions left out; an import of
  a module's own parent packages is no edge, ``from pkg import sub`` is an edge to ``sub``),
  each module named once under ``deltasync.``.
"""

from __future__ import annotations

import ast
import statistics
import sys
from pathlib import Path

FOLDERS = {"deltasync": "deltasync", "storage": "deltasync.storage", "cli": "deltasync.cli",
           "rl_integration": "deltasync.rl_integration"}


def modules(root: Path) -> dict[str, Path]:
    """Dotted name (under ``deltasync.``) -> file, each real file once."""
    found: dict[str, Path] = {}
    seen: set[Path] = set()
    for folder, package in FOLDERS.items():
        base = root / folder
        if not base.is_dir():
            continue
        for path in sorted(base.rglob("*.py")):
            rel = path.relative_to(base)
            if folder == "deltasync" and rel.parts[0] in {"v1", "storage", "cli", "rl_integration"}:
                continue  # generated, or reached through a link (counted from its own folder)
            real = path.resolve()
            if real in seen:
                continue
            seen.add(real)
            parts = list(rel.with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join([package, *parts])] = path
    return found


def _params(fn: ast.FunctionDef | ast.AsyncFunctionDef, in_class: bool) -> int:
    a = fn.args
    names = [*a.posonlyargs, *a.args]
    count = len(names) + len(a.kwonlyargs) + (a.vararg is not None) + (a.kwarg is not None)
    if in_class and names and names[0].arg in {"self", "cls"}:
        count -= 1
    return count


def _functions(tree: ast.AST) -> list[tuple[str, int, int]]:
    """(name, lines, parameters) of every function in ``tree``."""
    out: list[tuple[str, int, int]] = []

    def walk(node: ast.AST, in_class: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                end = child.end_lineno or child.lineno
                out.append((child.name, end - child.lineno + 1, _params(child, in_class)))
                walk(child, False)
            elif isinstance(child, ast.ClassDef):
                walk(child, True)
            else:
                walk(child, in_class)

    walk(tree, False)
    return out


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _module_imports(tree: ast.Module, name: str, is_package: bool, known: set[str]) -> set[str]:
    package = name if is_package else name.rpartition(".")[0]
    targets: set[str] = set()

    def canon(dotted: str) -> str:
        for folder, pkg in FOLDERS.items():
            if folder != "deltasync" and (dotted == folder or dotted.startswith(folder + ".")):
                return pkg + dotted[len(folder):]
        return dotted

    def add(dotted: str) -> bool:
        dotted = canon(dotted)
        # a module's own packages are initialised before it: an edge to them is no cycle
        if dotted in known and dotted != name and not name.startswith(dotted + "."):
            targets.add(dotted)
        return dotted in known

    def visit(stmts: list[ast.stmt]) -> None:
        for s in stmts:
            if isinstance(s, ast.Import):
                for alias in s.names:
                    add(alias.name)
            elif isinstance(s, ast.ImportFrom):
                if s.level:
                    base = package.split(".")
                    base = base[: len(base) - (s.level - 1)]
                    mod = ".".join([*base, *(s.module.split(".") if s.module else [])])
                else:
                    mod = s.module or ""
                # ``from pkg import sub``: the edge is to the submodule; a name is from ``pkg``
                if not all([add(f"{mod}.{alias.name}") for alias in s.names]):
                    add(mod)
            elif isinstance(s, ast.If):
                if not _is_type_checking(s.test):
                    visit(s.body)
                visit(s.orelse)
            elif isinstance(s, ast.Try):
                visit(s.body)
                for h in s.handlers:
                    visit(h.body)
                visit(s.orelse)
                visit(s.finalbody)
            elif isinstance(s, (ast.With, ast.AsyncWith)):
                visit(s.body)

    visit(tree.body)
    return targets


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected groups of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    groups: list[list[str]] = []
    counter = 0
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, it = work[-1]
            for nxt in it:
                if nxt not in index:
                    index[nxt] = low[nxt] = counter
                    counter += 1
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    group = []
                    while True:
                        m = stack.pop()
                        on_stack.discard(m)
                        group.append(m)
                        if m == node:
                            break
                    if len(group) > 1:
                        groups.append(sorted(group))
    return groups


def figures(root: Path) -> dict[str, object]:
    mods = modules(root)
    lengths: list[int] = []
    long_params: list[str] = []
    sizes: dict[str, int] = {}
    graph: dict[str, set[str]] = {}
    known = set(mods)
    for name, path in mods.items():
        text = path.read_text()
        sizes[name] = len(text.splitlines())
        tree = ast.parse(text)
        for fn, lines, params in _functions(tree):
            lengths.append(lines)
            if params > 6:
                long_params.append(f"{name}.{fn} ({params})")
        graph[name] = _module_imports(tree, name, path.name == "__init__.py", known)
    lengths.sort()
    p90 = lengths[min(len(lengths) - 1, int(0.9 * len(lengths)))] if lengths else 0
    return {
        "modules": len(mods),
        "functions": len(lengths),
        "function_lines_median": statistics.median(lengths) if lengths else 0,
        "function_lines_p90": p90,
        "functions_over_6_params": len(long_params),
        "modules_over_500_lines": sorted((n for n, s in sizes.items() if s > 500), key=lambda n: -sizes[n]),
        "modules_over_700_lines": sorted((n for n, s in sizes.items() if s > 700), key=lambda n: -sizes[n]),
        "import_cycles": _cycles(graph),
        "sizes": sizes,
        "long_params": sorted(long_params),
    }


def main() -> None:
    args = [a for a in sys.argv[1:] if not a.startswith("-")]
    root = Path(args[0]) if args else Path(__file__).resolve().parent.parent
    f = figures(root)
    print(f"root: {root}")
    print(f"modules: {f['modules']}  functions: {f['functions']}")
    print(f"function length (lines): median {f['function_lines_median']}, p90 {f['function_lines_p90']}")
    print(f"functions with > 6 parameters (not self/cls): {f['functions_over_6_params']}")
    sizes = f["sizes"]
    assert isinstance(sizes, dict)
    for key in ("modules_over_500_lines", "modules_over_700_lines"):
        names = f[key]
        assert isinstance(names, list)
        print(f"{key}: {len(names)}  " + ", ".join(f"{n} ({sizes[n]})" for n in names))
    cycles = f["import_cycles"]
    assert isinstance(cycles, list)
    print(f"module-level import cycles: {len(cycles)}" + "".join(f"\n  {' <-> '.join(c)}" for c in cycles))
    if "-v" in sys.argv:
        print("long parameter lists:\n  " + "\n  ".join(f["long_params"]))  # type: ignore[arg-type]


if __name__ == "__main__":
    main()
