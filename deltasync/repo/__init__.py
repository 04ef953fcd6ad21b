"""A repository of versions in a store: reading and committing manifests and refs
(:mod:`~deltasync.repo.repository`), retention and garbage collection
(:mod:`~deltasync.repo.retention`), full verification (:mod:`~deltasync.repo.verify`) and the
``inspect`` description of a version (:mod:`~deltasync.repo.describe`)."""
