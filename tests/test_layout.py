"""The layout: the tree on disk is the tree Python imports, one table per lazy package, and
module-level imports that go down the floors of the data flow without cycles."""

from __future__ import annotations

import ast
import importlib
import importlib.util
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

import deltasync

ROOT = Path(__file__).resolve().parent.parent
PKG = Path(deltasync.__file__).resolve().parent  # the checkout's, or an installed copy of it

#: The floors of the data flow, bottom first. A module may import (at module level) from its
#: own floor and the floors below. Function-level imports are the deliberate exceptions
#: (docs/DESIGN.md, "Package map"): the publisher's cache is a local copy refreshed by a pull,
#: and Subscriber.update_dir is the library's short way to fill a directory copy.
FLOORS: list[set[str]] = [
    {"errors", "_extras", "_lazy", "progress", "retry", "durable", "metrics", "v1", "format"},
    {"storage"},
    {"repo"},
    {"pull"},
    {"publish"},
    {"local", "ops"},
    {"engines", "relay"},
    {"agents"},
    {"integrations", "cli", "rl_integration", "demo", "testing", "__main__", "__init__"},
]
LAZY_PACKAGES = ["deltasync", "deltasync.agents", "deltasync.engines", "deltasync.relay", "deltasync.storage",
                 "deltasync.rl_integration"]


def _floor(module: str) -> int:
    top = module.split(".")[1] if module.count(".") else "__init__"
    for i, names in enumerate(FLOORS):
        if top in names:
            return i
    raise AssertionError(f"{module}: no floor for deltasync.{top}: add it to FLOORS")


def _modules() -> Iterator[tuple[str, Path]]:
    paths = [Path(d) / f for d, _, files in os.walk(PKG, followlinks=True) for f in files if f.endswith(".py")]
    for path in sorted(paths):  # through the links deltasync/storage, cli, rl_integration
        rel = path.relative_to(PKG).with_suffix("")
        parts = ["deltasync", *rel.parts]
        if parts[-1] == "__init__":
            parts.pop()
        yield ".".join(parts), path


def _eager_imports(module: str, path: Path) -> set[str]:
    """deltasync modules imported at module level, outside ``if TYPE_CHECKING:``."""
    tree = ast.parse(path.read_text())
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                target = ".".join([*base, node.module] if node.module else base)
            else:
                target = node.module or ""
            if target.startswith("deltasync"):
                found.add(target)
                found.update(f"{target}.{a.name}" for a in node.names)  # `from . import _lazy`
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("deltasync"))
    return found


def test_the_tree_on_disk_is_the_tree_python_imports() -> None:
    for sub in ("storage", "cli", "rl_integration"):
        link = ROOT / "deltasync" / sub
        assert link.is_symlink() and os.readlink(link) == f"../{sub}", f"deltasync/{sub} must link to the top-level {sub}/"
    for module, path in _modules():  # found, not imported: some need vLLM, __main__ runs the CLI
        spec = importlib.util.find_spec(module)
        assert spec is not None and Path(spec.origin or "").resolve() == path.resolve(), module


def test_no_module_level_import_cycles() -> None:
    modules = dict(_modules())
    graph = {m: {t for t in _eager_imports(m, p) if t in modules and t != m} for m, p in modules.items()}
    for m in graph:  # a package's __init__ is imported by each of its modules: not an edge back
        graph[m] = {t for t in graph[m] if not m.startswith(t + ".")}
    state: dict[str, int] = {}

    def visit(m: str, stack: list[str]) -> None:
        state[m] = 1
        for t in sorted(graph[m]):
            if state.get(t) == 1:
                raise AssertionError("import cycle: " + " -> ".join([*stack[stack.index(t):], t]))
            if t not in state:
                visit(t, [*stack, t])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])


def test_module_level_imports_go_down_the_floors() -> None:
    climbs = []
    for module, path in _modules():
        for target in _eager_imports(module, path):
            if target.count(".") and target.split(".")[1] in {n for f in FLOORS for n in f} and _floor(target) > _floor(module):
                climbs.append(f"{module} -> {target}")
    assert not climbs, "imports that climb a floor:\n" + "\n".join(sorted(climbs))


def _type_checking_names(path: Path) -> dict[str, str]:
    """name -> module, for the names a package imports under ``if TYPE_CHECKING:``."""
    out: dict[str, str] = {}
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            for imp in node.body:
                assert isinstance(imp, ast.ImportFrom) and imp.level == 1 and imp.module
                for alias in imp.names:
                    assert alias.asname == alias.name, f"{path}: import {alias.name} as {alias.name} (a re-export)"
                    out[alias.name] = imp.module
    return out


@pytest.mark.parametrize("package", LAZY_PACKAGES)
def test_each_lazy_package_has_one_table_that_type_checkers_see_too(package: str) -> None:
    mod = importlib.import_module(package)
    table = dict(mod._LAZY)
    assert _type_checking_names(Path(mod.__file__ or "")) == table
    assert set(table) <= set(dir(mod))  # (storage leaves its extras out of __all__: star imports work without them)
    for name in table:
        assert getattr(mod, name) is not None


def test_old_flat_module_names_are_gone() -> None:
    for old in ("agent", "gc", "subscriber", "localstate", "dtypes", "relay_cache", "local.agent", "local.engine_agent",
                "local.report", "local.live", "engines.packcast_agent"):
        with pytest.raises(ModuleNotFoundError):
            importlib.import_module(f"deltasync.{old}")


def test_engines_use_only_the_public_face_of_local_copies() -> None:
    """Engines read versions from copies through ``deltasync.local`` (its ``__init__``), never
    through the modules behind it (slots, state, placement…), at module level or inside functions."""
    reaching = []
    for module, path in _modules():
        if not module.startswith("deltasync.engines"):
            continue
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
                target = ".".join([*base, node.module] if node.module else base) if node.level else node.module or ""
                if target.startswith("deltasync.local."):
                    reaching.append(f"{module}: from {target} import ...")
    assert not reaching, "\n".join(reaching)


LINKED = ("storage", "cli", "rl_integration")


@pytest.mark.parametrize("name", [*LINKED, "storage._local", "cli.main"])
def test_a_linked_folder_is_not_a_second_package(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """From the checkout root, ``import storage`` would load every module of deltasync.storage a
    second time, with classes that are not deltasync's (``storage.Store is not
    deltasync.storage.Store``): it is refused, naming the import to use."""
    monkeypatch.syspath_prepend(str(ROOT))
    top = name.partition(".")[0]
    with pytest.raises(ImportError, match=rf"import deltasync\.{top}, not {top}"):
        importlib.import_module(name)
    assert not [m for m in list(sys.modules) if m == top or m.startswith(top + ".")]
    assert importlib.import_module(f"deltasync.{name}").__name__ == f"deltasync.{name}"


def _imports(path: Path) -> Iterator[ast.Import | ast.ImportFrom]:
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node


def test_linked_folders_import_deltasync_relatively() -> None:
    """What storage/, cli/ and rl_integration/ import of deltasync they import relatively, like the
    rest of the package (at module level and inside functions)."""
    absolute = []
    for sub in LINKED:
        for path in sorted((ROOT / sub).rglob("*.py")):
            for node in _imports(path):
                names = [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else (
                    [a.name for a in node.names] if isinstance(node, ast.Import) else [])
                absolute += [f"{path.relative_to(ROOT)}:{node.lineno}: {n}" for n in names
                             if n == "deltasync" or n.startswith("deltasync.")]
    assert not absolute, "absolute imports of deltasync:\n" + "\n".join(absolute)


def _is_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:  # a name inside a module, not a module
        return False


def test_private_modules_stay_inside_their_package() -> None:
    """A ``_``-module is its package's business: other packages use the package's public names
    (at module level and inside functions)."""
    crossing = []
    for module, path in _modules():
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        for node in _imports(path):
            if isinstance(node, ast.ImportFrom):
                base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
                target = ".".join([*base, node.module] if node.module else base) if node.level else node.module or ""
                targets = [target, *(f"{target}.{a.name}" for a in node.names)]
            else:
                targets = [a.name for a in node.names]
            for t in targets:
                parts = t.split(".")
                private = next((i for i, p in enumerate(parts) if p.startswith("_") and not p.startswith("__")), None)
                if not t.startswith("deltasync.") or private is None:
                    continue
                owner, priv = ".".join(parts[:private]), ".".join(parts[: private + 1])
                inside = package == owner or package.startswith(owner + ".")
                if not inside and _is_module(priv):
                    crossing.append(f"{module}: {priv}")
    assert not crossing, "private modules of other packages:\n" + "\n".join(sorted(set(crossing)))
