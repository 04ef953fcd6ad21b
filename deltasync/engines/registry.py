"""The engine registry: one entry per kind of engine, found by the name its spec starts with.

A spec string names an engine for the command line (``subscribe --engine SPEC``): ``NAME``,
``NAME:REST`` or, for a kind whose separator is ``@``, ``NAME@REST``. Each entry says where
its class lives (imported on first use, so torch and vLLM stay out until one is built), how
the rest of its spec is read, and what the engine needs around it: whether it loads versions
from the files of a directory copy (so it cannot be kept engine-first, with ``--state``
alone), which constructor option names the copy an agent keeps beside it, whether it holds
tensors in this process (so ``--tensors``/``--shard``/``--packcast`` apply and its
``MODULE:FACTORY`` is imported here), and which vLLM-style options it takes.

A new kind of engine is one :func:`register_engine` call (DESIGN.md section 8).
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..errors import UsageError
from .base import Engine

#: (kind, what follows NAME and its separator in the spec, the spec, options) -> the engine
Builder = Callable[["EngineKind", str, str, dict[str, Any]], Engine]


@dataclass(frozen=True, kw_only=True)
class EngineKind:
    """One kind of engine, as :func:`build_engine` and ``subscribe --engine`` know it."""

    name: str
    """What a spec starts with (``torch``, ``vllm``, …)."""
    module: str
    """Module holding the class: absolute, or relative to ``deltasync.engines`` (``.fanout``)."""
    cls: str
    """The engine class's name in ``module``."""
    build: Builder
    """Reads the rest of the spec and the options, and makes the engine."""
    specs: tuple[str, ...]
    """The spec forms, as error messages and docs show them."""
    separator: str = ":"
    """What follows ``name`` in a spec with more to it."""
    loads_files: bool = False
    """The engine loads each version from the files of a directory copy: it needs one (no
    engine-first ``--state``)."""
    copy_option: str | None = None
    """The constructor option the CLI sets to the directory copy it keeps, when it keeps one."""
    in_process: bool = False
    """The engine holds tensors in this process (``MODULE:FACTORY`` is imported here; with
    ``holds_parts``, ``--tensors``/``--shard``/``--packcast`` apply)."""
    holds_parts: bool = False
    """A model may be held in part (names matching patterns, row slices)."""
    options: frozenset[str] = frozenset()
    """Options only this kind takes (others drop them when given to every kind)."""

    def load(self) -> type[Engine]:
        """The engine class (its module imported now)."""
        module = importlib.import_module(self.module, __package__)
        cls: type[Engine] = getattr(module, self.cls)
        return cls


_REGISTRY: dict[str, EngineKind] = {}
_NAME = re.compile(r"[^:@]*")
#: options any kind may be given by a caller that does not know the kind; dropped where not taken
_SHARED_OPTIONS = frozenset({"pause_mode"})


def register_engine(kind: EngineKind) -> None:
    """Make ``kind`` known to :func:`build_engine` and ``subscribe --engine``."""
    if not kind.name or not _NAME.fullmatch(kind.name):
        raise UsageError(f"an engine name must be non-empty, without ':' or '@', got {kind.name!r}")
    if kind.name in _REGISTRY:
        raise UsageError(f"an engine named {kind.name!r} is already registered")
    _REGISTRY[kind.name] = kind


def engine_kinds() -> tuple[EngineKind, ...]:
    """Every registered kind, in registration order."""
    return tuple(_REGISTRY.values())


def specs() -> tuple[str, ...]:
    """Every spec form of every registered kind."""
    return tuple(s for kind in _REGISTRY.values() for s in kind.specs)


def find_engine(spec: str) -> tuple[EngineKind, str] | None:
    """The kind ``spec`` names and the rest of the spec after its separator ("" if none), or
    None for a spec no registered kind takes."""
    match = _NAME.match(spec)
    name = match.group() if match else ""
    kind = _REGISTRY.get(name)
    if kind is None or (spec != name and spec[len(name)] != kind.separator):
        return None
    return kind, spec[len(name) + 1:]


def parse_engine(spec: str) -> tuple[EngineKind, str]:
    """:func:`find_engine`, or a :class:`UsageError` listing the forms a spec takes."""
    found = find_engine(spec)
    if found is None:
        raise UsageError(f"unknown engine {spec!r}; expected one of: {', '.join(specs())}")
    return found


def build_engine(spec: str, **options: Any) -> Engine:
    """An engine from a spec string (what ``deltasync subscribe --engine`` takes).

    * ``torch`` with ``model=<nn.Module or dict of tensors>``, or ``torch:pkg.mod:factory``
      where ``factory()`` returns the module (built on the device it should serve from);
    * ``fanout`` (this process is rank 0 of an initialised torch.distributed group, or
      one is initialised from the ``MASTER_ADDR``/``RANK``/``WORLD_SIZE`` environment),
      optionally ``fanout:pkg.mod:factory`` for a module this rank serves too;
    * ``vllm@URL``: a vLLM server with the deltasync backend; ``model_dir=`` the copy its
      workers read (``pause_mode=`` keep, wait or abort);
    * ``http:PRESET@URL`` with ``model_dir=`` (where versions are written for the server
      to load); PRESET is ``sglang``, ``vllm`` or ``generic``;
    * any kind added with :func:`register_engine`.

    ``repo`` (URL, Store or Repository) is required for all; other options go to the
    engine's constructor (e.g. ``version``, ``workers``, ``timeout``, ``trusted_keys``).
    """
    if "repo" not in options:
        raise UsageError("build_engine needs repo=")
    kind, rest = parse_engine(spec)
    for name in _SHARED_OPTIONS - kind.options:
        options.pop(name, None)
    return kind.build(kind, rest, spec, options)


def construct(kind: EngineKind, *args: Any, **options: Any) -> Engine:
    """``kind``'s class called with ``args`` and ``options``; an option it does not take is a
    :class:`UsageError` naming the engine."""
    cls = kind.load()
    try:
        engine: Engine = cls(*args, **options)
    except TypeError as e:  # an option the engine does not take
        raise UsageError(f"{cls.kind} engine: {e}") from None
    return engine


def call_factory(ref: str) -> Any:
    """What ``MODULE:FACTORY`` returns: ``MODULE`` imported, ``FACTORY()`` called."""
    module_name, sep, attr = ref.partition(":")
    if not sep or not module_name or not attr:
        raise UsageError(f"expected MODULE:FACTORY (e.g. mypkg.models:build), got {ref!r}")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise UsageError(f"cannot import {module_name!r}: {e}") from None
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise UsageError(f"{module_name}:{attr} is not a callable factory")
    return factory()


# -- the engines deltasync ships ------------------------------------------------------------------


def _torch(kind: EngineKind, rest: str, spec: str, options: dict[str, Any]) -> Engine:
    model = options.pop("model", None)
    if rest:
        if model is not None:
            raise UsageError("give either a torch:MODULE:FACTORY spec or model=, not both")
        model = call_factory(rest)
    if model is None:
        raise UsageError("the torch engine needs a model: --engine torch:MODULE:FACTORY, or model= from Python")
    repo = options.pop("repo")
    return construct(kind, model, repo, **options)


def _fanout(kind: EngineKind, rest: str, spec: str, options: dict[str, Any]) -> Engine:
    from .fanout import init_from_env

    model = options.pop("model", None)
    if rest:
        model = call_factory(rest)
    init_from_env()
    return construct(kind, model, **options)


def _vllm(kind: EngineKind, rest: str, spec: str, options: dict[str, Any]) -> Engine:
    if not rest:
        raise UsageError(f"vllm engine spec must be vllm@URL, got {spec!r}")
    return construct(kind, rest, **options)


def _http(kind: EngineKind, rest: str, spec: str, options: dict[str, Any]) -> Engine:
    preset, at, url = rest.partition("@")
    if not at or not preset or not url:
        raise UsageError(f"http engine spec must be http:PRESET@URL, got {spec!r}")
    if not options.get("model_dir"):
        raise UsageError("the http engine needs model_dir=: a directory the server can read, where versions are written")
    return construct(kind, url, preset=preset, **options)


for _kind in (
    EngineKind(name="torch", module=".torch_engine", cls="TorchEngine", build=_torch, specs=("torch:MODULE:FACTORY",),
               copy_option="copy", in_process=True, holds_parts=True),
    EngineKind(name="fanout", module=".fanout", cls="FanoutEngine", build=_fanout, specs=("fanout[:MODULE:FACTORY]",),
               copy_option="copy", in_process=True),
    EngineKind(name="vllm", module=".vllm.engine", cls="VllmEngine", build=_vllm, specs=("vllm@URL",), separator="@",
               copy_option="model_dir", options=frozenset({"pause_mode", "repo_url"})),
    EngineKind(name="http", module=".http_engine", cls="HttpEngine", build=_http,
               specs=("http:sglang@URL", "http:vllm@URL", "http:generic@URL"), loads_files=True,
               copy_option="model_dir"),
):
    register_engine(_kind)
