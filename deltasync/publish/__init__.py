"""The trainer side: turn a state or a checkpoint directory into a committed version.

:mod:`~deltasync.publish.publisher` holds the public :class:`Publisher` (told by
:mod:`~deltasync.publish.config`, answering :mod:`~deltasync.publish.result`);
:mod:`~deltasync.publish.encode` the step every producer of versions shares (diff and encode
chunks into :mod:`~deltasync.publish.packs`), :mod:`~deltasync.publish.commit` the last
(the manifest, after checking what it names still exists); :mod:`~deltasync.publish.distributed`
many trainer ranks publishing one version; :mod:`~deltasync.publish.squash` deltas across strides."""
