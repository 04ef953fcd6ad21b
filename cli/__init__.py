"""The deltasync command line (``deltasync.cli``)."""
