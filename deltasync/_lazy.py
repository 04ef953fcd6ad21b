"""Public names imported on first use: the one mechanism behind ``deltasync``,
``deltasync.agents``, ``deltasync.engines``, ``deltasync.relay``, ``deltasync.storage`` and
``deltasync.rl_integration``.

Each of those packages keeps one table, ``_LAZY``: public name -> module relative to the
package. :func:`exports` turns the table into the package's ``__getattr__`` and ``__dir__``;
a missing optional dependency is reported as the extra to install, naming what needed it
(``need(name)``; by default the public name). Type checkers cannot follow a ``__getattr__``, so each package also imports
the same names under ``TYPE_CHECKING``; ``tests/test_structure.py`` checks that those imports
and the table agree.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from ._extras import import_needing_extras

#: public name -> the module that defines it, relative to the package
Table = Mapping[str, str]


def exports(
    package: str, table: Table, namespace: dict[str, Any], need: Callable[[str], str] | None = None
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``__getattr__`` and ``__dir__`` for ``package`` (whose globals are ``namespace``)."""

    def __getattr__(name: str) -> Any:
        module = table.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        what = need(name) if need is not None else f"{package}.{name}"
        value = getattr(import_needing_extras(f"{package}.{module}", what), name)
        namespace[name] = value  # the next look-up is a plain attribute
        return value

    def __dir__() -> list[str]:
        return sorted({*namespace, *table})

    return __getattr__, __dir__
