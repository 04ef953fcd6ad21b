"""Agents: long-running subscribers that follow a source of targets into a way of holding weights.

A source of targets says which version to serve next: a repository watched (its pin, else
its latest; the relay's Watch stream; identity checks) or a packcast group's rounds. A way of
holding weights brings what holds them to that version:

* :class:`Agent` (:mod:`.directory`) — a directory copy, optionally with an engine beside it;
* :class:`EngineAgent` (:mod:`.engine`) — an engine alone, with a state directory and kept
  objects but no copy;
* :class:`PackcastAgent` (:mod:`.packcast`) — the engine-first agent of each node of a
  packcast group (``subscribe --packcast``), fed by node 0's rounds.

Every one of them is a :class:`BaseAgent` (:mod:`.base`: the run loop, retries, each move's
record, engine swaps); the repository watched is :mod:`.watch` (:class:`~.watch.Targets`, the
source of targets, and :class:`~.watch.RepositoryWatch`), the figures, metrics and the state's
stats record are :mod:`.figures`. Beside them: :mod:`.config` (:class:`AgentConfig`,
:class:`Update`), :mod:`.status` (what ``deltasync status`` reads), :mod:`.packcast_spec`
(``--packcast`` parsed), :mod:`.report` (fleet reports) and :mod:`.live` (live checks of an
engine's weights, and the control socket that asks for them). The names below are imported
on first use: torch and the engines stay out until an agent needs them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .. import _lazy

#: public name -> module (imported on first use)
_LAZY: _lazy.Table = {
    "BaseAgent": "base",
    "Agent": "directory",
    "rollback": "directory",
    "AgentConfig": "config",
    "Update": "config",
    "EngineAgent": "engine",
    "PackcastAgent": "packcast",
    "PackcastOptions": "packcast",
    "read_status": "status",
}
__all__ = sorted(_LAZY)
__getattr__, __dir__ = _lazy.exports(__name__, _LAZY, globals())

if TYPE_CHECKING:
    from .base import BaseAgent as BaseAgent
    from .config import AgentConfig as AgentConfig, Update as Update
    from .directory import Agent as Agent, rollback as rollback
    from .engine import EngineAgent as EngineAgent
    from .packcast import PackcastAgent as PackcastAgent, PackcastOptions as PackcastOptions
    from .status import read_status as read_status
