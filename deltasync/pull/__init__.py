"""Pulling versions: bring tensors to a version, chunk by chunk, verified.

Read top-down: :mod:`~deltasync.pull.subscriber` (the public :class:`Subscriber`),
:mod:`~deltasync.pull.plan` (the cheapest path to a version), :mod:`~deltasync.pull.pipeline`
(fetch, decode, apply and verify chunk by chunk), :mod:`~deltasync.pull.select` (tensor and
partial pulls) and :mod:`~deltasync.pull.fetch` (ranged pack reads). Directory copies are the
floor above, :mod:`deltasync.local`."""
