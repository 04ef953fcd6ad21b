"""Reference asynchronous RL loop built on deltasync (``deltasync.rl_integration``).

Not built yet: this package is reserved for the RL loop (see the project's issues). It
holds no code so that nothing here is mistaken for a working loop.
"""
