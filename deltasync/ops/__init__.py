"""Operations over a whole repository, built on :mod:`deltasync.repo` and :mod:`deltasync.pull`:
garbage collection (:mod:`~deltasync.ops.retention`), full verification
(:mod:`~deltasync.ops.verify`) and the ``inspect`` description of a version
(:mod:`~deltasync.ops.describe`)."""
