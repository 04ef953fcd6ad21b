"""Local copies: a directory kept at a version (the agents that follow a repository into
one are :mod:`deltasync.agents`).

:mod:`~deltasync.local.slotfill` (bring the slot not served forward in place),
:mod:`~deltasync.local.slots` (two slots and the atomic switch),
:mod:`~deltasync.local.placement` (where tensor bytes sit in files),
:mod:`~deltasync.local.state` (the copy's LMDB state and lock),
:mod:`~deltasync.local.check` (check and repair a copy),
:mod:`~deltasync.local.cache` (the files of objects kept, and the store that reads through them) and
:mod:`~deltasync.local.kept` (the one way an agent or a worker keeps, prunes and drops them).

The names below are the face the engines use (they read a version's bytes from a copy, under
its lock); ``tests/test_layout.py`` keeps engines
off the modules behind it.
"""

from __future__ import annotations

from .cache import CachedStore as CachedStore, LocalCache as LocalCache
from .kept import KeptObjects as KeptObjects
from .placement import Bits as Bits, Placement as Placement, placements as placements, read_placed as read_placed
from .slots import boot_id as boot_id, other as other, slot_dir as slot_dir
from .state import (
    CopyInUseError as CopyInUseError,
    LocalState as LocalState,
    PullStopped as PullStopped,
    StateDB as StateDB,
    copy_lock as copy_lock,
    read_local_state as read_local_state,
)
