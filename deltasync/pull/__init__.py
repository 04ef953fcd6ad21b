"""The subscriber side: bring a local copy (tensors in memory, or a directory) to a version.

Read top-down: :mod:`~deltasync.pull.subscriber` (the public :class:`Subscriber`),
:mod:`~deltasync.pull.plan` (the cheapest path to a version), :mod:`~deltasync.pull.pipeline`
(fetch, decode, apply and verify chunk by chunk), :mod:`~deltasync.pull.select` (tensor and
partial pulls); for directory copies :mod:`~deltasync.pull.slotfill` (bring the slot not served
forward in place), :mod:`~deltasync.pull.slots` (two slots and the atomic switch),
:mod:`~deltasync.pull.placement` (where tensor bytes sit in files), :mod:`~deltasync.pull.state`
(the copy's LMDB state and journal), :mod:`~deltasync.pull.check` (check and repair a copy),
:mod:`~deltasync.pull.cache` (objects a copy keeps for rollbacks) and
:mod:`~deltasync.pull.fetch` (ranged pack reads)."""
