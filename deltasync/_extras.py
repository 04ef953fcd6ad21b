"""Optional dependencies: which extra installs what, and one clear error when one is missing.

A host that only serves or follows a repository needs neither torch (tensors enter and leave
only in publishers of state dicts, tensor pulls and engines) nor boto3 (``s3://``) nor grpcio
(``grpc://`` and the relay). ``pip install 'deltasync[all]'`` installs every one of them.
"""

from __future__ import annotations

import importlib
from types import ModuleType

from .errors import MissingDependencyError

#: top-level module -> the extra that installs it
EXTRAS: dict[str, str] = {"torch": "torch", "boto3": "s3", "botocore": "s3", "grpc": "grpc"}


def require(module: str, what: str) -> ModuleType:
    """Import ``module`` (a dependency of an extra) for ``what``, or say which extra to install."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name != module.split(".")[0]:
            raise  # the package is there but broken (a missing submodule): not an install hint
        raise missing(e, what) from e


def import_needing_extras(module: str, what: str) -> ModuleType:
    """Import a deltasync module whose imports include optional dependencies; a missing one is
    reported as the extra that installs it."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name not in EXTRAS:
            raise  # another module, or a broken install of an extra (a submodule missing)
        raise missing(e, what) from e


def missing(e: ModuleNotFoundError, what: str) -> MissingDependencyError:
    top = (e.name or "").split(".")[0]
    extra = EXTRAS.get(top, "all")
    return MissingDependencyError(top or str(e), extra, what)
