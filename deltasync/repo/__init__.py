"""A repository of versions in a store: its key layout, reading and committing manifests and
refs, blobs and squashes (:mod:`~deltasync.repo.repository`). Operations over a whole
repository (gc, verify, inspect) are the floor above, :mod:`deltasync.ops`."""
