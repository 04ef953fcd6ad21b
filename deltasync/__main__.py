"""``python -m deltasync`` is the ``deltasync`` command."""

from deltasync.cli.main import main

main()
