"""Old module names, kept importable after the package was grouped into subpackages.

``import deltasync.gc`` or ``from deltasync.subscriber import Subscriber`` (the flat layout of
earlier releases) give the module that now lives under ``deltasync.repo``, ``deltasync.pull``
and so on: the same module object, so patching through either name patches both. New code
should import the new names; this table only keeps existing user code working.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
from collections.abc import Sequence
from types import ModuleType

#: old module name (under ``deltasync.``) -> where it lives now
MOVED: dict[str, str] = {
    "checkpoint": "format.checkpoint",
    "codec": "format.codec",
    "digest": "format.digest",
    "dtypes": "format.dtypes",
    "manifest": "format.manifest",
    "signing": "format.signing",
    "slices": "format.slices",
    "tensors": "format.tensors",
    "gc": "repo.retention",
    "inspect": "repo.describe",
    "repository": "repo.repository",
    "verify": "repo.verify",
    "distributed": "publish.distributed",
    "publisher": "publish.publisher",
    "squash": "publish.squash",
    "fetch": "pull.fetch",
    "localcache": "pull.cache",
    "localcopy": "pull.check",
    "localstate": "pull.state",
    "placement": "pull.placement",
    "slotfill": "pull.slotfill",
    "slots": "pull.slots",
    "subscriber": "pull.subscriber",
    "relay_cache": "relay.cache",
}


class _AliasLoader(importlib.abc.Loader):
    """Hands out the module under its new name instead of executing anything."""

    def __init__(self, target: str) -> None:
        self.target = target
        self._spec: importlib.machinery.ModuleSpec | None = None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        module = importlib.import_module(self.target)
        self._spec = module.__spec__
        return module

    def exec_module(self, module: ModuleType) -> None:
        # The import system stamped the alias's spec on the shared module: give it back its own.
        module.__spec__ = self._spec


class AliasFinder(importlib.abc.MetaPathFinder):
    """Finds ``deltasync.<old name>`` for every entry of :data:`MOVED`."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        prefix, _, name = fullname.partition(".")
        if prefix != "deltasync" or name not in MOVED:
            return None
        return importlib.machinery.ModuleSpec(fullname, _AliasLoader(f"deltasync.{MOVED[name]}"))


def install() -> None:
    if not any(isinstance(f, AliasFinder) for f in sys.meta_path):
        sys.meta_path.append(AliasFinder())
