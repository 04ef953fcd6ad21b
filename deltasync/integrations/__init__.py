"""deltasync inside the trainers people already run, each through the host's own plugin point.

* :mod:`deltasync.integrations.verl` — a verl checkpoint engine named ``deltasync``,
  registered with ``verl.checkpoint_engine.CheckpointEngineRegistry`` when the module is
  imported (verl imports it itself through ``checkpoint_engine.custom_backend_module``).
* :mod:`deltasync.integrations.transformers` — :class:`DeltasyncCallback`, a
  ``transformers.TrainerCallback`` that publishes the model every N optimizer steps
  (``Trainer`` and every subclass of it, TRL's ``GRPOTrainer`` included).

Each module imports its host framework at import time and says which package to install
when it is missing (:class:`deltasync.MissingDependencyError`); importing this package
imports neither. The reference page is ``docs/integrations.md``.
"""

from __future__ import annotations
