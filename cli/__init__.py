"""The deltasync command line (``deltasync.cli``)."""

# This folder is deltasync.cli, reached through the link deltasync/cli; imported from the
# checkout root as plain `cli` it would be a second copy of every module and class in it.
if __name__ != "deltasync.cli":
    raise ImportError(f"import deltasync.cli, not {__name__}: the folder cli/ is the package deltasync.cli "
                      "(one module, one identity)")
