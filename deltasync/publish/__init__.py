"""The trainer side: turn a state or a checkpoint directory into a committed version.

:mod:`~deltasync.publish.publisher` holds the public :class:`Publisher`;
:mod:`~deltasync.publish.encode` the steps every producer of versions shares (diff and encode
chunks into packs, then commit); :mod:`~deltasync.publish.distributed` many trainer ranks
publishing one version; :mod:`~deltasync.publish.squash` deltas across strides."""
